"""Benchmark the embedded default study: wall time and peak memory of each stage, and the
patching overhead ratio, all measured in this one process.

    python benchmarks/study.py                   # the default study into a fresh directory
    python benchmarks/study.py --task tasks/entity_tracking.toml --out /tmp/bench-study

Stages are timed by the study itself (``StageRecord.seconds``); peak resident memory is read
after every stage (``ru_maxrss``: the process peak so far, so a stage's own peak is the first
row where the figure rises). The overhead ratio is one path-patching pass (step A: the sender
patched and every other head frozen) over a plain forward pass on the same batch, for a sender in
the first layer and one in the second-to-last (that pass resumes at the sender's layer).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

import torch
from patching import timed  # benchmarks/patching.py: median of repeated calls after a warm-up
from tabulate import tabulate

from mechdiff.common.components import Head
from mechdiff.patching.core import run
from mechdiff.patching.path import path_patch
from mechdiff.patching.path_pairs import prepare
from mechdiff.runs.stages import StageCache
from mechdiff.studies.circuits.spec import default_spec, load_spec
from mechdiff.studies.circuits.study import CircuitsStudy as Study
from mechdiff.tasks.entity_tracking import path_patching_pairs


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mib() -> str:
    """Peak CUDA memory allocated so far (all GPUs), or "-" without CUDA."""
    if not torch.cuda.is_available():
        return "-"
    return f"{sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 2**20:.0f}"


def overhead(study: Study, n: int, repeats: int = 3) -> list[dict]:
    """Median time of one step-A path-patching pass over a plain forward on the same prompts, for a
    sender in the first layer (the whole model runs) and one in the second-to-last layer (the
    pass resumes there from the clean residual and skips the blocks before it)."""
    model = study.model(study.spec.models.base)
    pairs = path_patching_pairs(study.tokenizer, n, study.spec.task.n_boxes, seed=0)
    batch = prepare(model, pairs)

    def plain() -> None:
        with torch.no_grad():
            run(model, batch.clean_ids)

    base = timed(plain, repeats)
    out = []
    for layer in (0, model.shape.n_layers - 2):
        sender = [Head(layer, 0)]
        t = timed(lambda: path_patch(model, batch, sender, "last", None, 1, progress=False), repeats)
        out.append(
            {"sender": sender[0].name, "plain forward": base, "path-patching pass": t, "ratio": t / base, "n": n}
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=None, help="task file (default: the embedded default study)")
    ap.add_argument("--out", default=None, help="results directory (default: a fresh temporary one)")
    ap.add_argument("--overhead-n", type=int, default=16, help="prompts for the overhead ratio")
    ap.add_argument("--device", default=None, help="override [models] device: cpu, cuda")
    ap.add_argument("--device-map", default=None, help="override [models] device_map: auto shards over the GPUs")
    ap.add_argument("--dtype", default=None, help="override [models] dtype: float32, bfloat16, float16")
    args = ap.parse_args()
    spec = load_spec(args.task) if args.task else default_spec()
    for key in ("device", "device_map", "dtype"):
        if getattr(args, key) is not None:
            setattr(spec.models, key, getattr(args, key))
    out = args.out or tempfile.mkdtemp(prefix="mechdiff-bench-")
    spec.output.store = f"{out}/activations.h5"
    rows = []
    original = StageCache.run

    def timed_run(self, name, inputs, compute):
        rec = original(self, name, inputs, compute)
        rows.append([name, "cached" if rec.cached else f"{rec.seconds:.1f}", f"{peak_mib():.0f}", peak_gpu_mib()])
        return rec

    StageCache.run = timed_run
    t0 = time.perf_counter()
    study = Study(spec, progress=False, out_dir=out)
    study.run()
    total = time.perf_counter() - t0
    StageCache.run = original
    print(tabulate(rows, headers=["stage", "wall s", "peak RSS MiB so far", "peak GPU MiB so far"]))
    print(f"\nwhole study: {total:.0f} s; report: {out}/report.md")
    print()
    for o in overhead(study, args.overhead_n):
        print(
            f"patching overhead on {o['n']} prompts, sender {o['sender']}: plain forward "
            f"{o['plain forward']:.2f} s, path-patching pass {o['path-patching pass']:.2f} s, ratio {o['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
