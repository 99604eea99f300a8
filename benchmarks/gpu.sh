#!/usr/bin/env bash
# GPU check: the paper's study on one CUDA GPU, per-stage times and the patching overhead ratio.
#
#   bash benchmarks/gpu.sh                 # from the repository root, with the venv active or at .venv
#   MECHDIFF_GPU_N=200 bash benchmarks/gpu.sh
#
# With LLaMA-7B and Goat-7B's weights present (Hugging Face cache, or the hub reachable and
# HF_HUB_OFFLINE unset): scores the released LLaMA-7B circuit on both beside the published figures
# (the reproduction stage of tasks/entity_tracking_llama7b.toml, with fewer prompts), then times one
# path-patching pass against a plain forward on LLaMA-7B. Without them: the embedded SmolLM2 study,
# whole, on the GPU. Sized for under 10 minutes on one H100/H200-class GPU (most of it loading two
# 7B models in float32); every step has its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
N=${MECHDIFF_GPU_N:-100}             # prompts for the reproduction (the paper: 500)
DTYPE=${MECHDIFF_GPU_DTYPE:-float32} # as the paper; bfloat16 halves load time and memory
OUT=${MECHDIFF_GPU_OUT:-$(mktemp -d /tmp/mechdiff-gpu-XXXX)}
export PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); nothing to check" >&2
    exit 2
fi
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
echo "results: $OUT"
t_start=$(date +%s)

if "$PY" -c "from mechdiff.studies.reproduce import check_weights; check_weights(['llama-7b', 'goat-7b'])" 2>"$OUT/weights.txt"; then
    echo "== LLaMA-7B / Goat-7B weights present: the paper's study (reproduction of the released circuit, $N prompts, $DTYPE)"
    sed -e "s/^finetunes = .*/finetunes = [\"goat-7b\"]/" \
        -e "/^\[reproduce\]/,/^\[/ s/^n = .*/n = $N/" \
        -e "s/^dtype = .*/dtype = \"$DTYPE\"/" \
        -e "s#^dir = .*#dir = \"$OUT/study\"#" \
        tasks/entity_tracking_llama7b.toml > "$OUT/llama7b-goat.toml"
    # per-stage times (reproduction: mean activations + full and circuit evaluation on each model) and
    # the overhead of one step-A path-patching pass over a plain forward, in the same process
    timeout 480 "$PY" benchmarks/study.py --task "$OUT/llama7b-goat.toml" --out "$OUT/study" --device cuda \
        --overhead-n 16 | tee "$OUT/study.txt"
    echo "== path patching on LLaMA-7B: step-A and step-B pass overheads (8 senders x 8 prompts per pass)"
    timeout 240 "$PY" benchmarks/patching.py --model llama-7b --device cuda --dtype "$DTYPE" --n 8 \
        --senders-per-pass 8 --skip-exact-all --out "$OUT/patching.json" | tee "$OUT/patching.txt"
else
    echo "== LLaMA-7B / Goat-7B weights absent ($(tr '\n' ' ' < "$OUT/weights.txt" | cut -c1-200)...)"
    echo "== the embedded SmolLM2 study, whole, on the GPU"
    timeout 420 "$PY" benchmarks/study.py --out "$OUT/study" --device cuda --overhead-n 16 | tee "$OUT/study.txt"
    echo "== path patching on SmolLM2-135M: overheads, exact-all vs screened for step A"
    timeout 120 "$PY" benchmarks/patching.py --model smollm2-135m --device cuda --n 8 --senders-per-pass 8 \
        --step A --k 8 --out "$OUT/patching.json" | tee "$OUT/patching.txt"
fi
echo "gpu.sh: done in $(( $(date +%s) - t_start )) s; figures in $OUT"
