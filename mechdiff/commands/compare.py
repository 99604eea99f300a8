"""``mechdiff compare``: circuits x models (accuracy, faithfulness with CIs), overlap tables, membership heatmap."""

from __future__ import annotations

import argparse
from itertools import combinations
from pathlib import Path

from ..circuits.circuit import Circuit, load_circuit_file
from ..io import check_writable
from ..models.architectures import ModelShape
from ..circuits.overlap import overlap_table
from ..circuits.scoring import matrix_rows
from ..models.modelset import ModelSet
from ..report.membership import membership_heatmap
from ..report.tables import to_markdown, write_table
from ._options import add_dataset_options, add_model_options, model_kwargs, resolve_batch_size, write_json
from ._scoring import add_scoring_options, build_scorer, settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="score circuits on several models; overlap between circuits")
    p.add_argument("--models", required=True, help="comma-separated registry names or paths (same shape)")
    p.add_argument("--circuits", required=True, help="comma-separated circuit JSON files")
    p.add_argument("--labels", default=None, help="comma-separated circuit labels (default: file stems)")
    p.add_argument("--n-random", type=int, default=0, help="random circuits per cell (baseline; costs passes)")
    p.add_argument("--out", default="results/compare", help="output directory")
    add_dataset_options(p, n=100)
    add_scoring_options(p)
    add_model_options(p)
    p.set_defaults(func=main)


def load_circuits(paths: list[str], labels: list[str] | None, shape: ModelShape | None = None) -> dict[str, Circuit]:
    """Circuits by label, checking the labels are unique and (given ``shape``) that every head exists."""
    labels = labels or [Path(p).stem for p in paths]
    if len(labels) != len(paths) or len(set(labels)) != len(labels):
        raise ValueError(f"need one unique label per circuit; got {labels} for {paths} (use --labels)")
    n_layers, n_heads = (shape.n_layers, shape.n_heads) if shape else (None, None)
    return {label: load_circuit_file(path, n_layers, n_heads) for label, path in zip(labels, paths)}


def overlap_rows(circuits: dict[str, Circuit], n_layers: int, n_heads: int) -> list[dict]:
    """The overlap table of every pair of circuits, with columns naming the two circuits."""
    rows = []
    for a, b in combinations(circuits, 2):
        rows += [{"first": a, "second": b, **r} for r in overlap_table(circuits[a], circuits[b], n_layers, n_heads)]
    return rows


def main(args: argparse.Namespace) -> int:
    out = check_writable(args.out)
    models = ModelSet(args.models.split(","), **model_kwargs(args))  # configs only: no weights yet
    shape = models.shape
    circuits = load_circuits(args.circuits.split(","), args.labels.split(",") if args.labels else None, shape)
    rows, fingerprints = [], {}
    for lm in models:
        resolve_batch_size(args, lm)
        scorer = build_scorer(lm, args)
        rows += matrix_rows(lm.name, circuits, scorer, n_random=args.n_random, seed=args.seed)
        fingerprints[lm.name] = lm.fingerprint
    write_table(rows, out / "matrix", caption="Circuits x models: accuracy with only the circuit, faithfulness")
    print(to_markdown(rows))
    result = {"settings": settings(args), "fingerprints": fingerprints, "matrix": rows}
    if len(circuits) > 1:
        result["overlap"] = overlap_rows(circuits, shape.n_layers, shape.n_heads)
        write_table(result["overlap"], out / "overlap", caption="Per-group overlap of circuits (hypergeometric p)")
        print()
        print(to_markdown(result["overlap"]))
    membership_heatmap(circuits, shape.n_layers, shape.n_heads, out / "membership.png", title="Circuit membership")
    write_json(out / "compare.json", result)
    print(f"\nwrote {out}/matrix.*, {'overlap.*, ' if len(circuits) > 1 else ''}membership.png, compare.json")
    return 0
