"""``mechdiff run [TASK.toml]``: the whole study of a task file, of any kind, from task spec to report.

Argument parsing only: the study is `mechdiff.studies.base.load_study` (the file's ``[study] kind``).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Optional


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run the whole study of a task file, of any kind (default: the embedded "
        "SmolLM2 circuits study); prints its stage plan first",
    )
    p.add_argument(
        "task_file",
        nargs="?",
        default=None,
        help="a task file (tasks/*.toml; its [study] kind: circuits (default), knowledge, headmap); "
        "without one, the embedded default study",
    )
    p.add_argument("--out", default=None, help="results directory (default: the file's [output] dir)")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the stage plan (each stage: cached or not, its cost in the committed run.json) and, for a "
        "study of any kind, each stage's predicted peak memory and time on this machine (and --plan-device), then stop",
    )
    p.add_argument(
        "--plan-device",
        default=None,
        help="with --plan: also predict each stage on this named device (h100-80gb, h200-141gb, a100-80gb, "
        "a100-40gb); the models' configs are read, no weights",
    )
    p.add_argument(
        "--plan-disk",
        type=float,
        default=None,
        metavar="GIB",
        help="with --plan-device: the disk free under TMPDIR on that machine, in GiB (scratch files such as DCM's "
        "pair cache are checked against it; default 64, a single-GPU machine's)",
    )
    p.add_argument(
        "--plan-host",
        type=float,
        default=None,
        metavar="GIB",
        help="with --plan-device: that machine's host memory, in GiB (what DCM holds in memory is checked against "
        "it; default 128, a single-GPU machine's)",
    )
    p.add_argument(
        "--task",
        default=None,
        help="circuits kind: override [task] name: a registered task (ioi, ...) or a directory from "
        "`mechdiff dataset import`",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into the results directory even when its run.json records another task or kind of study",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--model",
        default=None,
        help="circuits kind: only this model's stages (one process per model shares the cores; a plain "
        "`mechdiff run` afterwards writes the report from the cache)",
    )
    p.add_argument(
        "--workers",
        type=_workers_option,
        default=None,
        help="circuits kind: 1 runs every stage in this process; N (the number of models) runs one process per "
        "model, side by side. Default: one per model where the machine has 2 cores or more and the memory the "
        "resource plan predicts, else 1 ($MECHDIFF_WORKERS sets the default)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads of this process (default: torch's)")
    # Placement overrides of how models load (unset: the file's values or the defaults).
    p.add_argument("--dtype", default=None, help="override [models] dtype: float32 (as the paper), bfloat16, float16")
    p.add_argument("--device", default=None, help="override [models] device: cpu, cuda, cuda:1")
    p.add_argument("--device-map", default=None, help="override [models] device_map: auto shards over the GPUs")
    p.add_argument(
        "--remote",
        action="store_true",
        default=None,
        help="every forward pass on NDIF (nnsight; API key from $NDIF_API_KEY)",
    )
    p.set_defaults(func=main)


def _workers_option(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--workers {value}: give 1 (one process) or the number of models")
    return n


def _planned_workers(inputs, requested: Optional[int], threads: Optional[int]):
    """The processes and threads a plain run of the planned study (``inputs``, `PlanInputs`) would use here
    (`._workers.plan_workers`; a kind other than circuits runs in one process), as the plan's `Workers`."""
    from types import SimpleNamespace

    import torch

    from ..studies.planner import Workers
    from ._workers import plan_workers

    plan = plan_workers(SimpleNamespace(kind=inputs.kind, spec=inputs.settings), requested)
    each = plan.threads if plan.workers > 1 else threads or torch.get_num_threads()
    return Workers(plan.workers, each, plan.reason, inputs.models[0])


def main(args: argparse.Namespace) -> int:
    from ..studies.base import check_run_dir, load_study, plan_then_run
    from ._workers import WorkerFailed, default_workers, plan_workers, run_workers

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    if args.plan_device and not args.plan:
        raise ValueError("--plan-device predicts a plan: give it with --plan")
    if args.plan_disk is not None and not args.plan_device:
        raise ValueError("--plan-disk is the named device's disk: give it with --plan-device")
    if args.plan_host is not None and not args.plan_device:
        raise ValueError("--plan-host is the named device's host memory: give it with --plan-device")
    if args.plan:
        from ..studies.planner import print_resources

        requested = args.workers if args.workers is not None else default_workers()
        workers = partial(_planned_workers, requested=requested, threads=args.threads)
        plan = (args.task_file, args.plan_device, args.dtype, args.task, args.plan_disk, args.plan_host, workers)
        if print_resources(*plan):
            return 0
    models = {key: getattr(args, key) for key in ("dtype", "device", "device_map", "remote")}
    study = load_study(
        args.task_file,
        out=args.out,
        progress=not args.no_progress,
        models={k: v for k, v in models.items() if v is not None},
        task=args.task,
    )
    if args.model:
        check_run_dir(study, args.force)
        study.run_model(args.model)
        print(f"stages of {args.model} done in {study.dir}; run without --model for the report")
        return 0
    requested = args.workers if args.workers is not None else default_workers()
    workers = plan_workers(study, requested) if not args.plan else None
    if workers is not None and workers.workers > 1:
        check_run_dir(study, args.force)
        print(f"{study.kind} study into {study.dir}: {workers.reason}", flush=True)
        try:
            run_workers(args, study, workers)
        except WorkerFailed as err:
            print(f"mechdiff run: error: {err}", file=sys.stderr)
            return 1
        study.forget()  # the workers wrote the stage records: read them from the cache
        for cache in study.caches():  # as computed by this run, not reused
            cache.computed_since = study.started
    elif workers is not None and requested is None and study.kind == "circuits":
        print(f"one process: {workers.reason}", flush=True)
    report = plan_then_run(study, plan_only=args.plan, force=args.force)
    if report is not None:
        print(f"report: {report}")
    return 0
