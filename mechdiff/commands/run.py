"""``mechdiff run [TASK.toml]``: the whole study, from task spec to report."""

from __future__ import annotations

import argparse

from ..tasks.spec import default_spec, load_spec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the whole study of a task file (default: the embedded SmolLM2 study)")
    p.add_argument("task_file", nargs="?", default=None,
                   help="a task spec (tasks/*.toml); without one, the embedded default study")
    p.add_argument("--out", default=None, help="results directory (default: the spec's [output] dir)")
    p.add_argument("--task", default=None,
                   help="override [task] name: a registered task (ioi, ...) or a directory from `mechdiff dataset import`")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--model", default=None,
                   help="only this model's stages (one process per model shares the cores; a plain `mechdiff run` "
                        "afterwards writes the report from the cache)")
    # Placement overrides of the task file's [models] section (unset: the file's values).
    p.add_argument("--dtype", default=None, help="override [models] dtype: float32 (as the paper), bfloat16, float16")
    p.add_argument("--device", default=None, help="override [models] device: cpu, cuda, cuda:1")
    p.add_argument("--device-map", default=None, help="override [models] device_map: auto shards over the GPUs")
    p.add_argument("--remote", action="store_true", default=None,
                   help="every forward pass on NDIF (nnsight; API key from $NDIF_API_KEY)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    spec = load_spec(args.task_file) if args.task_file else default_spec()  # checked before anything loads
    if args.task is not None:
        from ..tasks.spec import check_task

        check_task(args.task)  # before anything loads
        spec.task.name = args.task
    for key in ("dtype", "device", "device_map", "remote"):
        if getattr(args, key, None) is not None:
            setattr(spec.models, key, getattr(args, key))
    from ..study import Study

    study = Study(spec, progress=not args.no_progress, out_dir=args.out)
    if args.model:
        study.run_model(args.model)
        print(f"stages of {args.model} done in {study.dir}; run without --model for the report")
        return 0
    report = study.run()
    print(f"report: {report}")
    for name, rec in study.cache.records.items():
        print(f"  {name:32s} {'cached' if rec.cached else f'{rec.seconds:7.1f} s'}")
    return 0
