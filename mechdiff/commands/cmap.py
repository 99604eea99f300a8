"""``mechdiff cmap``: cross-model activation patching from a fine-tune into its base, per circuit group."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.circuit import load_circuit_file
from ..common.io import check_writable
from ..methods.cmap import CMAP_RULES
from ..methods.cmap_patches import CMAP_KINDS, parse_kinds
from ..models.modelset import ModelSet
from ..studies.circuits.cmap import cmap_run
from ._options import (
    add_dataset_options,
    add_model_options,
    model_kwargs,
    resolve_batch_size,
    task_from_args,
    task_options,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cmap", help="patch a fine-tune's head outputs / Q / K / V into its base, per circuit group")
    p.add_argument("--base", required=True, help="the receiving model (registry name or path)")
    p.add_argument("--finetune", required=True, help="the donor model (registry name or path)")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    p.add_argument("--kinds", default=",".join(CMAP_KINDS), help=f"comma-separated, from {', '.join(CMAP_KINDS)}")
    p.add_argument("--groups", default=None, help="comma-separated groups (default: all, plus the whole circuit)")
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="do not restore the base's other head outputs for Q/K/V (patch whole KV groups, every reader)",
    )
    p.add_argument(
        "--rule",
        default=CMAP_RULES[0],
        choices=list(CMAP_RULES),
        help="base: K/V up to and including each group's position, that position left free "
        "(mechdiff's); paper: K/V strictly before it, every position but the last reset to the base, "
        "q/k/v for last-token groups only",
    )
    p.add_argument("--n-random", type=int, default=0, help="draws of layer-matched random heads per group (control)")
    p.add_argument("--out", default="results/cmap", help="output directory")
    add_dataset_options(p, n=200)
    add_model_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    kinds = parse_kinds(args.kinds)
    check_writable(args.out)
    models = ModelSet([args.base, args.finetune], **model_kwargs(args))  # configs only: no weights yet
    circuit = load_circuit_file(args.circuit, models.shape.n_layers, models.shape.n_heads)
    base, finetune = models[models.names[0]], models[models.names[1]]
    resolve_batch_size(args, base)
    print(
        cmap_run(
            base,
            finetune,
            circuit,
            task_from_args(args),
            args.n,
            args.seed,
            task_options(args),
            kinds,
            args.batch_size,
            args.groups.split(",") if args.groups else None,
            not args.no_isolate,
            args.n_random,
            args.rule,
            Path(args.out),
        )
    )
    return 0
