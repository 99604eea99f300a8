"""``mechdiff dcm``: what each circuit group encodes (DCM masks per desideratum), and semantic patching."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..circuits.circuit import load_circuit_file
from ..io import check_writable
from ..dcm import (LAM_SCALES, PARAMETERISATIONS, DCMConfig, DCMResult, desideratum_pairs, dcm_circuit,
                   semantic_patching, split_pairs)
from ..models.modelset import ModelSet
from ..report.bars import grouped_bars
from ..report.tables import estimate_columns, to_markdown, write_table
from ..stats import Estimate
from ..tasks.base import PairRecord
from ..tasks.entity_tracking import CounterfactualPair, read_jsonl
from ._options import add_model_options, add_task_option, model_kwargs, task_from_args, write_json

DEFAULTS = DCMConfig()  # every training default is DCMConfig's


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dcm", help="desiderata-based component masking of a circuit's groups (+ semantic patching)")
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--circuit", required=True, help="circuit JSON file")
    add_task_option(p)
    p.add_argument("--desiderata", default=None,
                   help="comma-separated names of the task's desiderata (entity tracking: positional, object, "
                        "label; an imported task: counterfactual) or .jsonl files of entity-tracking pairs "
                        "(default: every desideratum of the task)")
    p.add_argument("--groups", default=None, help="comma-separated groups (default: all)")
    p.add_argument("--n", type=int, default=200, help="pairs per built-in desideratum (split train/val/test)")
    p.add_argument("--n-boxes", type=int, default=7, help="boxes per prompt (2-10)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="dataset, split and training seed")
    p.add_argument("--parameterisation", default=DEFAULTS.parameterisation, choices=list(PARAMETERISATIONS))
    p.add_argument("--lam", type=float, default=DEFAULTS.lam, help="sparsity weight (penalises patched heads)")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr)
    p.add_argument("--epochs", type=int, default=DEFAULTS.epochs)
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="pairs per optimiser step")
    p.add_argument("--micro-batch", type=int, default=DEFAULTS.micro_batch,
                   help="pairs per forward/backward pass (memory)")
    p.add_argument("--eval-batch", type=int, default=DEFAULTS.eval_batch,
                   help="pairs per forward pass when evaluating")
    p.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every,
                   help="optimiser steps between validation passes")
    p.add_argument("--lam-scale", default=DEFAULTS.lam_scale, choices=list(LAM_SCALES),
                   help="loss: lam times the unpatched mean |logit(target)| (mechdiff's); absolute: lam as is (the paper's)")
    p.add_argument("--preset", default="", choices=["", "paper"],
                   help="paper: the paper's training (absolute lam 0.01, lr 0.1, 32 pairs per step, 2 epochs in order, "
                        "validation after batches 0, 4, 8... of each epoch, split 50/25/25); the training options "
                        "above must then stay at their defaults")
    p.add_argument("--n-random", type=int, default=DEFAULTS.n_random, help="random head sets for the baseline")
    p.add_argument("--random-pool", default=DEFAULTS.random_pool, choices=["group", "all"],
                   help="random baseline heads from all heads of the model (default) or only the group's "
                        "(degenerate when DCM selects the whole group)")
    p.add_argument("--semantic", default=None,
                   help="comma-separated models to semantic-patch the selected heads into (the DCM model is included)")
    p.add_argument("--out", default="results/dcm", help="output directory")
    add_model_options(p)
    p.set_defaults(func=main)


def load_desiderata(spec: str, tokenizer, n: int, n_boxes: int, seed: int,
                    task: str = "entity-tracking") -> dict[str, list[PairRecord]]:
    """The task's desiderata by name generate pairs; ``.jsonl`` paths are user-defined entity-tracking
    desiderata (named by file stem)."""
    out: dict[str, list[PairRecord]] = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item.endswith(".jsonl"):
            records = read_jsonl(item)
            if not records or not all(isinstance(r, CounterfactualPair) for r in records):
                raise ValueError(f"{item} must hold counterfactual pairs (write them with write_jsonl)")
            out[Path(item).stem] = records  # type: ignore[assignment]
        else:
            out[item] = desideratum_pairs(item, tokenizer, n, n_boxes=n_boxes, seed=seed, task=task)
    if not out:
        raise ValueError("no desiderata given; e.g. --desiderata positional,object,label")
    return out


def dcm_rows(results: list[DCMResult]) -> list[dict]:
    rows = []
    for r in results:
        row = {"group": r.group, "position": r.position, "desideratum": r.desideratum, "n_heads": len(r.heads),
               "n_selected": len(r.selected), "selected": " ".join(h.name for h in r.selected) or "-"}
        row.update(estimate_columns("test_accuracy", r.test_accuracy))
        row.update(estimate_columns("floor", r.floor))
        row.update(estimate_columns("full_group", r.full_group))
        row.update(estimate_columns("random", r.random) if r.random else {"random": None})
        rows.append(row)
    return rows


TRAINING = ("parameterisation", "lam", "lam_scale", "lr", "epochs", "batch_size", "eval_every")


def config_from_args(args: argparse.Namespace) -> DCMConfig:
    """The training settings the command line chose (every default is :data:`DEFAULTS`; ``--preset paper``:
    :meth:`DCMConfig.paper`, refused beside a changed training option)."""
    bookkeeping = {"micro_batch": args.micro_batch, "eval_batch": args.eval_batch, "n_random": args.n_random,
                   "random_pool": args.random_pool, "seed": args.seed}
    if getattr(args, "preset", "") == "paper":
        changed = [f"--{k.replace('_', '-')}" for k in TRAINING if getattr(args, k) != getattr(DEFAULTS, k)]
        if changed:
            raise SystemExit(f"--preset paper fixes the training settings; drop {', '.join(changed)} "
                             "(or drop --preset to set them yourself)")
        return DCMConfig.paper(**bookkeeping)
    return DCMConfig(**{k: getattr(args, k) for k in TRAINING}, **bookkeeping)


def main(args: argparse.Namespace) -> int:
    if args.remote:
        raise SystemExit("DCM trains masks through backward passes on this machine; it does not run on NDIF yet "
                         "(--remote). Run it with --device cuda / --device-map auto.")
    task = task_from_args(args)
    others = [m for m in (args.semantic or "").split(",") if m and m != args.model]
    check_writable(args.out)
    models = ModelSet([args.model, *others], **model_kwargs(args))  # configs only: no weights yet
    circuit = load_circuit_file(args.circuit, models.shape.n_layers, models.shape.n_heads)
    model = models[models.names[0]]
    config = config_from_args(args)
    spec = args.desiderata or ",".join(task.desiderata)
    desiderata = load_desiderata(spec, model.tokenizer, args.n, args.n_boxes, args.seed, args.task)
    groups = args.groups.split(",") if args.groups else None
    results = dcm_circuit(model, circuit, desiderata, config, groups)
    out = Path(args.out)
    rows = dcm_rows(results)
    caption = (f"DCM on {model.name} ({config.parameterisation} masks, lambda={config.lam}): heads whose z at the "
               "group's position, patched from the source, makes the desideratum's target win; test accuracy vs the "
               "no-intervention floor, the whole group, and random head sets of the selected size.")
    write_table(rows, out / "dcm", caption=caption)
    print(to_markdown(rows))
    grouped_bars(out / "dcm.png", [f"{r.group}/{r.desideratum}" for r in results],
                 {"selected heads": [r.test_accuracy for r in results], "floor (m=1)": [r.floor for r in results],
                  "whole group": [r.full_group for r in results], "random": [r.random for r in results]},
                 title=f"DCM on {model.name}", ylabel="target accuracy (test)")
    summary = {"model": model.name, "task": task.name, "fingerprint": model.fingerprint, "circuit": args.circuit,
               "n_boxes": args.n_boxes, "results": [r.to_dict() for r in results]}
    if others:
        summary["semantic"] = _semantic(models, results, desiderata, config, args.eval_batch, out)
    write_json(out / "dcm.json", summary)
    return 0


def _semantic(models: ModelSet, results: list[DCMResult], desiderata: dict, config: DCMConfig, batch_size: int,
              out: Path) -> list[dict]:
    """Patch each selection into every model of the set, on that desideratum's test pairs."""
    rows, records = [], []
    for r in results:
        if not r.selected:
            continue
        test = split_pairs(list(desiderata[r.desideratum]), config.split, config.seed)[2]
        for sem in semantic_patching((models[n] for n in models.names), r.selected, r.position, test, batch_size):
            rows.append({"group": r.group, "desideratum": r.desideratum, "model": sem.model,
                         "heads": " ".join(h.name for h in r.selected),
                         **estimate_columns("accuracy", sem.accuracy), **estimate_columns("floor", sem.floor)})
            records.append({"group": r.group, "desideratum": r.desideratum, **sem.to_dict()})
    if not rows:
        print("semantic patching skipped: no DCM mask selected any head")
        return records
    write_table(rows, out / "semantic", caption="Semantic patching: the DCM-selected heads patched source -> base "
                "within each model; target accuracy per model (with the unpatched floor).")
    print()
    print(to_markdown(rows))
    cats = list(dict.fromkeys(f"{r['group']}/{r['desideratum']}" for r in rows))
    series = {}
    for name in models.names:
        by_cat = {f"{x['group']}/{x['desideratum']}": x for x in records if x["model"] == name}
        series[name] = [_est(by_cat[c]["accuracy"]) if c in by_cat else None for c in cats]
    grouped_bars(out / "semantic.png", cats, series, title="Semantic patching of DCM heads across models",
                 ylabel="target accuracy")
    return records


def _est(d: dict) -> Estimate:
    return Estimate(d["value"], d["low"], d["high"], d["n"])
