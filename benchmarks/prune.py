"""Cost of the pruning's evaluations F(C \\ {v}): incremental (resumed from F(C)'s run) against full runs.

Loads a finished study's circuit and scores F(C \\ {v}) for a sample of its pairs on the pruning's own
prompts both ways, checks they agree, and prints seconds per pair and the ratio to a plain forward pass.

    python benchmarks/prune.py tasks/entity_tracking.toml smollm2-et --sample 24
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.scoring import Scorer
from mechdiff.studies.circuits.spec import load_spec
from mechdiff.studies.circuits.study import CircuitsStudy as Study


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task_file")
    p.add_argument("model")
    p.add_argument("--sample", type=int, default=24, help="pairs of the circuit to remove, one at a time")
    p.add_argument("--store", default="/tmp/prune-bench.h5", help="activation store for the means")
    args = p.parse_args()
    study = Study(load_spec(args.task_file), progress=False)
    study.store = args.store
    if not study.cache.path(f"circuit:{args.model}").is_file():
        raise SystemExit(f"no circuit of {args.model} in {study.dir}: run the study first")
    circuit = Circuit.from_dict(study.circuit(args.model).result["circuit"])
    scorer = study.scorer(args.model, "prune", study.spec.scoring.prune_n)
    plain = Scorer(scorer.model, scorer.records, scorer.means, scorer.batch_size, progress=False)
    pairs = circuit.pairs()
    sample = random.Random(0).sample(pairs, min(args.sample, len(pairs)))
    t = time.perf_counter()
    plain.full()
    forward = time.perf_counter() - t
    scorer.keep_without(pairs, [sample[0]])  # F(C)'s run, kept for every later removal
    timings = {}
    for name, score in (
        ("full", lambda v: plain.keep([u for u in pairs if u != v])),
        ("incremental", lambda v: scorer.keep_without(pairs, [v])),
    ):
        t = time.perf_counter()
        results = [score(v) for v in sample[1:]]
        timings[name] = ((time.perf_counter() - t) / len(results), results)
    (full, a), (inc, b) = timings["full"], timings["incremental"]
    error = max(float(np.abs(x.prob - y.prob).max()) for x, y in zip(a, b))
    print(f"{args.model}: {len(pairs)} pairs, {len(scorer.records)} prompts; plain forward {forward:.2f} s")
    print(
        f"F(C \\ {{v}}) per pair: full {full:.2f} s ({full / forward:.2f}x forward), incremental {inc:.2f} s "
        f"({inc / forward:.2f}x forward); speed-up {full / inc:.2f}x; max |prob difference| {error:.1e}"
    )


if __name__ == "__main__":
    main()
