#!/usr/bin/env bash
# GPU check: the resource planner's prediction beside measurement on one CUDA GPU, no weights, no network.
#
#   bash benchmarks/gpu.sh              # from the repository root, with the venv active or at .venv
#   bash benchmarks/gpu.sh --cpu        # the same script's reduced form on CPU (2 layers, a few prompts)
#
# Randomly initialised models of LLaMA-7B's width (mechdiff/data/configs/llama-7b.json, depth cut) run the stages
# the planner counts (accuracy, a mean-ablation matrix cell, a path-patching step with every head an exact
# sender, held whole and in two parts, a DCM epoch with its pair cache, a CMAP pass; benchmarks/gpu.py), each printed beside the planner's
# memory (torch.cuda.max_memory_allocated above the stage's start) and time (wall, synchronised), on the named
# device of the GPU's kind and at the GPU's measured matrix-multiply rate: 4 layers in bfloat16, then LLaMA-7B's
# whole 32-layer config in bfloat16 (accuracy) where it fits, 2 layers in float32 and in float16. Sized for under
# 6 minutes on one H100; every step has its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${MECHDIFF_GPU_OUT:-$(mktemp -d /tmp/mechdiff-gpu-XXXX)}
export PYTHONPATH="$PWD:benchmarks${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t_start=$(date +%s)

if [ "${1:-}" = "--cpu" ]; then
    echo "== reduced form on CPU: 2 layers of LLaMA-7B's width, bfloat16, a few prompts a stage"
    "$PY" benchmarks/gpu.py --device cpu --layers 2 --quick --json "$OUT/cpu.json" | tee "$OUT/cpu.txt"
    echo "gpu.sh: done in $(( $(date +%s) - t_start )) s; figures in $OUT"
    exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA GPU visible to torch; 'bash benchmarks/gpu.sh --cpu' runs the reduced form" >&2
    exit 2
fi
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
echo "results: $OUT"

echo "== 4 layers of LLaMA-7B's width, bfloat16, every stage; then the whole 32-layer config (accuracy) if it fits"
timeout 200 "$PY" benchmarks/gpu.py --device cuda --layers 4 --dtype bfloat16 --full --json "$OUT/bf16.json" \
    | tee "$OUT/bf16.txt"
echo "== 2 layers, float32 (the paper's dtype), every stage"
timeout 90 "$PY" benchmarks/gpu.py --device cuda --layers 2 --dtype float32 --json "$OUT/fp32.json" | tee "$OUT/fp32.txt"
echo "== 2 layers, float16 (checked on a GPU only), accuracy and the path-patching step"
timeout 60 "$PY" benchmarks/gpu.py --device cuda --layers 2 --dtype float16 --stages accuracy,path-step-A \
    --json "$OUT/fp16.json" | tee "$OUT/fp16.txt"
echo "gpu.sh: done in $(( $(date +%s) - t_start )) s; figures in $OUT"
