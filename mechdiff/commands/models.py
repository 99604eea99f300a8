"""``mechdiff models``: what this machine can load (the registry, its trajectories' saved steps, run directories
given), each with what it needs; reads files and the hub cache only (`mechdiff.models.catalog`)."""

from __future__ import annotations

import argparse
import textwrap

from ..models.catalog import SavedSteps, registry_availability, run_steps, trajectories_availability


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the models mechdiff knows and what each needs here (GGUF, LoRA adapter, base, hub download); "
        "loads nothing",
    )
    p.add_argument(
        "runs",
        nargs="*",
        metavar="RUN_DIR",
        help="also list the saved steps of these run directories (step-NNNN checkpoints, `mechdiff finetune "
        "--save-every`), loaded as RUN_DIR@STEP",
    )
    p.add_argument("--long", action="store_true", help="also print each model's description")
    p.add_argument("--cache-dir", default=None, help="the Hugging Face cache to look in for hub ids")
    p.set_defaults(func=main)


def table(rows: list[list[str]]) -> str:
    """Rows as left-aligned columns, two spaces apart (the first row the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _steps(s: SavedSteps) -> str:
    shown = ", ".join(map(str, s.steps))
    return shown + (f" (missing here: {', '.join(map(str, s.missing))})" if s.missing else "")


def main(args: argparse.Namespace) -> int:
    models = registry_availability(args.cache_dir)
    rows = [["NAME", "KIND", "HERE", "NEEDS"]]
    rows += [[m.name, m.kind, "ready" if m.ready else "no", m.needs] for m in models]
    print("Registered models (load by NAME; or give a directory, a .gguf file, an adapter or hub:ORG/NAME):")
    print(table(rows))
    if args.long:
        for m in models:
            print(f"\n{m.name}:\n" + textwrap.fill(m.description, 100, initial_indent="  ", subsequent_indent="  "))
    steps = trajectories_availability(args.cache_dir) + [run_steps(r) for r in args.runs]
    rows = [["TRAJECTORY", "BASE", "HERE", "STEPS (load as NAME@STEP)"]]
    rows += [[s.name, s.base, "ready" if s.ready else "no", _steps(s)] for s in steps]
    print("\nSaved steps:")
    print(table(rows))
    for s in steps:
        print(f"  {s.name}: {s.needs}")
    ready = sum(m.ready for m in models)
    print(f"\n{ready} of {len(models)} registered models load here without a download.")
    return 0
