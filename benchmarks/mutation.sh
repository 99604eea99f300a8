#!/usr/bin/env bash
# Mutation testing of the core modules with mutmut (pip install -e ".[mutation]"); not part of CI.
# Mutates only [tool.mutmut] only_mutate in pyproject.toml (patching/, circuits/scoring.py, dcm.py, cmap.py,
# knowledge/forward.py) and runs, per mutant, only the fast tests of its test selection that cover the mutated
# function (-m "not slow"). Changing that selection resets every result (mutmut reruns its stats pass); to rerun
# chosen mutants without it: python benchmarks/mutation_rerun.py NAME ... (see benchmarks/mutation.md).
#   bash benchmarks/mutation.sh                      # every mutant of those modules (hours on 2 cores)
#   bash benchmarks/mutation.sh 'mechdiff.methods.dcm.*'     # a subset: mutmut's mutant-name globs
# Results: `mutmut results` (survivors), `mutmut show NAME` (a mutant's diff), mutants/ (scratch, ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg OMP_NUM_THREADS=1
JOBS="${MUTATION_JOBS:-2}"
mutmut run --max-children "$JOBS" "$@"
mutmut results
