"""``mechdiff cmap``: cross-model activation patching from a fine-tune into its base, per circuit group."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.circuit import load_circuit_file
from ..cmap import CMAP_KINDS, CMAP_RULES, CMAPResult, parse_kinds, run_cmap
from ..io import check_writable
from ..models.modelset import ModelSet
from ..report.bars import grouped_bars
from ..report.tables import estimate_columns, to_markdown, write_table
from ._options import (add_dataset_options, add_model_options, model_kwargs, resolve_batch_size, task_from_args,
                       task_options, write_json)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cmap", help="patch a fine-tune's head outputs / Q / K / V into its base, per circuit group")
    p.add_argument("--base", required=True, help="the receiving model (registry name or path)")
    p.add_argument("--finetune", required=True, help="the donor model (registry name or path)")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    p.add_argument("--kinds", default=",".join(CMAP_KINDS), help=f"comma-separated, from {', '.join(CMAP_KINDS)}")
    p.add_argument("--groups", default=None, help="comma-separated groups (default: all, plus the whole circuit)")
    p.add_argument("--no-isolate", action="store_true",
                   help="do not restore the base's other head outputs for Q/K/V (patch whole KV groups, every reader)")
    p.add_argument("--rule", default=CMAP_RULES[0], choices=list(CMAP_RULES),
                   help="base: K/V up to and including each group's position, that position left free "
                        "(mechdiff's); paper: K/V strictly before it, every position but the last reset to the base, "
                        "q/k/v for last-token groups only")
    p.add_argument("--n-random", type=int, default=0, help="draws of layer-matched random heads per group (control)")
    p.add_argument("--out", default="results/cmap", help="output directory")
    add_dataset_options(p, n=200)
    add_model_options(p)
    p.set_defaults(func=main)


def cmap_rows(result: CMAPResult) -> list[dict]:
    """The base and fine-tune rows, then one row per (scope, kind)."""
    rows = [{"scope": result.base, "position": "-", "kind": "base (unpatched)",
             **estimate_columns("accuracy", result.base_accuracy),
             **estimate_columns("answer_prob", result.base_answer_prob), "recovered": 0.0},
            {"scope": result.finetune, "position": "-", "kind": "fine-tune",
             **estimate_columns("accuracy", result.finetune_accuracy),
             **estimate_columns("answer_prob", result.finetune_answer_prob), "recovered": 1.0}]
    for r in [*result.rows, *result.random_rows]:
        scope = r.scope.removeprefix("random:")
        row = {"scope": r.scope, "position": result.positions.get(scope, "per group"), "kind": r.kind,
               **estimate_columns("accuracy", r.accuracy), **estimate_columns("answer_prob", r.answer_prob),
               "recovered": r.recovered}
        key = f"{r.scope}/{r.kind}"
        if key in result.outcomes:  # paired against the unpatched base on the same prompts
            row.update(estimate_columns("gain_vs_base", result.paired(key, "base")))
        rows.append(row)
    return rows


def write_outputs(result: CMAPResult, out: Path) -> list[dict]:
    """Tables (md/csv/tex/json), the bar chart and the full JSON."""
    rows = cmap_rows(result)
    caption = f"CMAP {result.finetune} -> {result.base}. {result.caption}"
    write_table(rows, out / "cmap", caption=caption)
    scopes = list(dict.fromkeys(r.scope for r in result.rows))
    kinds = list(dict.fromkeys(r.kind for r in result.rows))
    by = {(r.scope, r.kind): r.accuracy for r in result.rows}
    grouped_bars(out / "cmap.png", scopes, {k: [by.get((s, k)) for s in scopes] for k in kinds},
                 title=f"CMAP: {result.finetune} -> {result.base} (z projected by the base's o_proj; "
                       + ("the paper's rule)" if result.settings.get("rule") == "paper"
                          else "Q/K/V isolated per head)" if result.settings.get("isolate", True)
                          else "K/V patch whole KV groups)"),
                 references={f"base {result.base}": result.base_accuracy,
                             f"fine-tune {result.finetune}": result.finetune_accuracy})
    write_json(out / "cmap.json", result.to_dict())
    return rows


def main(args: argparse.Namespace) -> int:
    kinds = parse_kinds(args.kinds)
    check_writable(args.out)
    models = ModelSet([args.base, args.finetune], **model_kwargs(args))  # configs only: no weights yet
    circuit = load_circuit_file(args.circuit, models.shape.n_layers, models.shape.n_heads)
    base, finetune = models[models.names[0]], models[models.names[1]]
    resolve_batch_size(args, base)
    records = task_from_args(args).records(base.tokenizer, args.n, args.seed, **task_options(args))
    groups = args.groups.split(",") if args.groups else None
    result = run_cmap(base, finetune, circuit, records, kinds, args.batch_size, groups,
                      isolate=not args.no_isolate, n_random=args.n_random, seed=args.seed, rule=args.rule)
    rows = write_outputs(result, Path(args.out))
    print(to_markdown(rows))
    print(f"\n{result.caption}")
    return 0
