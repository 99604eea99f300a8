"""``mechdiff headmap``: HeadMap locating (``locate``), fine-tuning (``finetune``) and the study (``compare``).

``compare`` writes ``OUT/report.md`` with its tables and figures; every part (each locating and each
training run) is stored in ``OUT/stages/<name>.json`` and reused on a rerun with the same options.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Callable

from ..io import check_writable, read_record
from ._options import add_model_options, load_from_args, write_json

log = logging.getLogger(__name__)
RUNS = ("base", "located", "random", "lora-large", "lora-small", "outside", "headmap+lora", "transfer", "lora-zoo")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="registry name or path of the model")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    add_model_options(p)


def _locate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=64, help="lowest-loss samples used for locating")
    p.add_argument("--pool", type=int, default=256, help="prompts the samples are selected from")
    p.add_argument("--k", type=int, default=8, help="heads kept per layer")
    p.add_argument("--batch-size", type=int, default=64, help="rows per forward pass")
    p.add_argument("--seed", type=int, default=0, help="pool seed")


def _train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate")
    p.add_argument("--headmap-lr", type=float, default=5e-3, help="HeadMap maps' learning rate")
    p.add_argument("--rank", type=int, default=4, help="HeadMap map rank r")
    p.add_argument("--eval-n", type=int, default=200, help="held-out evaluation prompts")
    p.add_argument("--train-seed", type=int, default=0, help="initialisation seed")
    p.add_argument("--data-seed", type=int, default=0)


def register(sub: argparse._SubParsersAction) -> None:
    from ..tasks.base import trainable_tasks

    p = sub.add_parser("headmap", help="HeadMap: layer-conditioned locating of task heads and HeadMap fine-tuning")
    hs = p.add_subparsers(dest="headmap_command", required=True, metavar="ACTION")

    loc = hs.add_parser("locate", help="select the lowest-loss samples and locate k heads per layer")
    _common(loc)
    loc.add_argument("--task", default="entity-tracking", choices=trainable_tasks())
    loc.add_argument("--out", required=True, help="directory: circuit.json, locate.json, figures")
    _locate_options(loc)
    loc.set_defaults(func=main_locate)

    ft = hs.add_parser("finetune", help="train HeadMap maps on located heads (optionally with a LoRA)")
    _common(ft)
    ft.add_argument("--task", default="entity-tracking", choices=trainable_tasks())
    ft.add_argument("--circuit", required=True, help="circuit.json from `mechdiff headmap locate`")
    ft.add_argument("--lora-rank", type=int, default=0, help="also train a LoRA of this rank (HeadMap+LoRA)")
    ft.add_argument("--out", required=True, help="directory: result.json")
    _train_options(ft)
    ft.set_defaults(func=main_finetune)

    cmp_ = hs.add_parser("compare", help="the study: locate on two tasks, HeadMap vs LoRA and ablations, report.md")
    _common(cmp_)
    cmp_.add_argument("--out", default="results/headmap-smollm2")
    cmp_.add_argument("--transfer-task", default="arithmetic-mc", choices=trainable_tasks(),
                      help="task whose located circuit is transferred to entity tracking")
    cmp_.add_argument("--path-patching", default="results/entity-tracking-smollm2/circuits/smollm2-et-early.json",
                      help="comma-separated path-patching circuit files to compare the located heads with")
    cmp_.add_argument("--lora-small", type=int, default=1, help="rank of the LoRA near HeadMap's parameter count")
    cmp_.add_argument("--lora-large", type=int, default=8, help="rank of the larger LoRA")
    cmp_.add_argument("--transfer-n", type=int, default=None, help="samples for locating on the transfer task")
    cmp_.add_argument("--lora-zoo", default="smollm2-et-early",
                      help="a saved LoRA of the same recipe to evaluate instead of training one (run lora-zoo)")
    cmp_.add_argument("--train-only", action="store_true", help="stop after the training runs (no report)")
    cmp_.add_argument("--runs", default=",".join(RUNS), help=f"training runs, in order (of {','.join(RUNS)})")
    _locate_options(cmp_)
    _train_options(cmp_)
    cmp_.set_defaults(func=main_compare)


def _setup(args: argparse.Namespace) -> None:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------


def curve_figure(curves: dict[str, dict], path: Path) -> Path:
    """Loss of the selected samples with the heads of layers < l masked, against the pool's mean loss."""
    import matplotlib.pyplot as plt

    from ..io import save_figure

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (name, meta) in enumerate(curves.items()):
        color = plt.get_cmap("tab10")(i)
        ax.plot(range(len(meta["curve"])), meta["curve"], marker=".", color=color, label=f"{name}: selected samples")
        ax.axhline(meta["pool_loss"], color=color, linestyle="--", linewidth=1, label=f"{name}: mean of all samples")
    ax.set_xlabel("layers masked (heads selected in layers 0..l-1 zeroed)")
    ax.set_ylabel("answer loss (nats)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Layer-conditioned locating: loss curve per layer", fontsize=9)
    return save_figure(fig, path)


def heatmap_figure(meta_scores: dict[str, float], heads: list, shape: Any, path: Path, title: str,
                   curve: Any = None) -> Path:
    """Per head: the loss with it masked (and earlier selections) minus the layer's loss with only the earlier
    selections masked (``curve[layer]``), so every layer's candidates are comparable; selected heads boxed."""
    from ..components import parse_heads
    from ..report.figures import head_heatmap

    scores = {h: v - (curve[h.layer] if curve else 0.0)
              for h, v in zip(parse_heads(list(meta_scores)), meta_scores.values())}
    return head_heatmap(scores, shape.n_layers, shape.n_heads, path, title=title, selected=heads,
                        label="loss increase from masking the head (given earlier selections)")


# --------------------------------------------------------------------------------------
# locate / finetune
# --------------------------------------------------------------------------------------


def _locate_and_write(model: Any, task: str, args: argparse.Namespace, out: Path, n: int) -> dict:
    from ..headmap import locate_task

    res = locate_task(model, task, n=n, pool=args.pool, k=args.k, batch_size=args.batch_size, seed=args.seed)
    circuit = res.circuit(model.name, task)
    circuit.save(out / "circuit.json")
    heatmap_figure(circuit.scores["headmap"], circuit.heads(), model.shape, out / "heads.png",
                   f"{model.name} on {task}: k={args.k} per layer, n={n}", circuit.meta["curve"])
    curve_figure({task: circuit.meta}, out / "curve.png")
    print(f"located {len(res.heads)} heads in {res.seconds:.0f} s, {res.forward_passes} forward passes "
          f"({res.rows} prompt rows); loss {res.base_loss:.3f} -> {res.curve[-1]:.3f} "
          f"(pool mean {res.pool_loss:.3f})")
    return circuit.to_dict()


def main_locate(args: argparse.Namespace) -> int:
    _setup(args)
    check_writable(args.out)
    model = load_from_args(args.model, args)
    _locate_and_write(model, args.task, args, Path(args.out), args.n)
    return 0


def _train_config(args: argparse.Namespace, task: str, lora_rank: int = 0):
    from ..headmap import TrainConfig

    return TrainConfig(task=task, steps=args.steps, batch_size=args.batch, lr=args.lr,
                       headmap_lr=args.headmap_lr, seed=args.train_seed,
                       data_seed=args.data_seed, rank=args.rank, lora_rank=lora_rank, eval_n=args.eval_n)


def main_finetune(args: argparse.Namespace) -> int:
    from ..headmap import get_task, heads_by_layer, train
    from ._scoring import load_circuit, model_shape
    from ..stats import bootstrap

    _setup(args)
    check_writable(args.out)
    circuit = load_circuit(args.circuit, model_shape(args.model, args))  # checked before the weights load
    model = load_from_args(args.model, args)
    cfg = _train_config(args, args.task, args.lora_rank)
    ev = get_task(args.task).eval_batch(model.tokenizer, cfg.eval_n, cfg.eval_seed)
    res = train(model, cfg, heads_by_layer(circuit.heads()), {args.task: ev})
    est = bootstrap(res["correct"][args.task])
    print(f"trainable parameters {res['trainable']}; {args.task} accuracy {est}")
    write_json(Path(args.out) / "result.json", res | {"accuracy": est.to_dict()})
    return 0


# --------------------------------------------------------------------------------------
# compare: the study
# --------------------------------------------------------------------------------------


def _stage(out: Path, name: str, key: dict, fn: Callable[[], dict]) -> dict:
    """Reuse ``out/stages/name.json`` if it was made with the same ``key``."""
    path = out / "stages" / f"{name}.json"
    data = read_record(path, f"HeadMap stage record {name}", ("key", "value"))
    if data is not None and data["key"] == key:
        log.info("stage %s: reused %s", name, path)
        return data["value"]
    t0 = time.time()
    value = fn()
    write_json(path, {"key": key, "value": value, "seconds": round(time.time() - t0, 1)})
    return value


def main_compare(args: argparse.Namespace) -> int:
    import numpy as np

    from ..circuits.circuit import Circuit
    from ..circuits.overlap import overlap_row
    from ..components import Head
    from ..headmap import HeadMap, get_task, heads_by_layer, lora_params, random_heads, train
    from ..report.bars import grouped_bars
    from ..report.tables import to_markdown, write_table
    from ..stats import bootstrap
    from ..io import write_text

    _setup(args)
    t_start = time.time()
    out = check_writable(args.out)
    for path in filter(None, args.path_patching.split(",")):  # read now, not after hours of training
        Circuit.load(path)
    model = load_from_args(args.model, args)
    s = model.shape
    loc_key = {"model": args.model, "pool": args.pool, "k": args.k, "batch_size": args.batch_size, "seed": args.seed}

    # 1. locating on entity tracking (the transfer task's circuit is located when its run comes)
    located = {}

    def locate_on(task: str, n: int) -> Circuit:
        if task not in located:
            sub = out / "circuits" / task
            located[task] = Circuit.from_dict(_stage(out, f"locate-{task}", loc_key | {"task": task, "n": n},
                                                     lambda: _locate_and_write(model, task, args, sub, n)))
        return located[task]

    n_total = s.n_layers * s.n_heads
    et_circuit = lambda: locate_on("entity-tracking", args.n)  # noqa: E731
    et_heads = lambda: heads_by_layer(et_circuit().heads())  # noqa: E731

    # 2. training runs on entity tracking (layer-conditioned locating keeps k heads in every layer)
    per_layer = {layer: args.k for layer in range(s.n_layers)}
    runs: dict[str, tuple[str, Callable[[], Any], int]] = {
        "base": ("base (no training)", lambda: None, 0),
        "located": ("HeadMap (located)", et_heads, 0),
        "random": ("HeadMap, random heads per layer", lambda: random_heads(s, per_layer, seed=1), 0),
        "lora-large": (f"LoRA r={args.lora_large} (q,k,v,o)", lambda: None, args.lora_large),
        "lora-small": (f"LoRA r={args.lora_small} (q,k,v,o)", lambda: None, args.lora_small),
        "outside": ("HeadMap, heads outside the located set",
                    lambda: random_heads(s, per_layer, seed=2, exclude=et_circuit().heads()), 0),
        "headmap+lora": (f"HeadMap + LoRA r={args.lora_small}", et_heads, args.lora_small),
        "lora-zoo": (f"LoRA r={args.lora_large} (q,k,v,o), 15 steps: zoo {args.lora_zoo}", lambda: None, 0),
        "transfer": (f"HeadMap, circuit located on {args.transfer_task}",
                     lambda: heads_by_layer(locate_on(args.transfer_task, args.transfer_n or args.n).heads()), 0),
    }
    chosen = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = set(chosen) - set(runs)
    if unknown:
        raise ValueError(f"unknown runs {sorted(unknown)}; choose from {', '.join(RUNS)}")
    task = get_task("entity-tracking")
    cfg0 = _train_config(args, "entity-tracking")
    ev = {"entity-tracking": task.eval_batch(model.tokenizer, cfg0.eval_n, cfg0.eval_seed)}
    results = {}
    for run_id in chosen:
        name, heads_fn, lora_rank = runs[run_id]
        heads = heads_fn()
        cfg = _train_config(args, "entity-tracking", lora_rank)
        key = {"model": args.model, "config": vars(cfg) | {"lora_targets": list(cfg.lora_targets)},
               "heads": {str(k): v for k, v in (heads or {}).items()}}
        if heads is None and not lora_rank:
            def fn():
                from ..headmap import correct
                return {"trainable": 0, "correct": {"entity-tracking": correct(model.model, ev["entity-tracking"]).tolist()},
                        "losses": [], "train_seconds": 0.0, "heads": {}}
        else:
            def fn(heads=heads, cfg=cfg):
                return train(model, cfg, heads, ev)
        if run_id == "base":
            key = {"model": args.model, "eval_n": cfg.eval_n, "eval_seed": cfg.eval_seed}
        if run_id == "lora-zoo":
            key = {"model": args.lora_zoo, "eval_n": cfg.eval_n, "eval_seed": cfg.eval_seed}

            def fn():
                from ..headmap import correct
                zoo = load_from_args(args.lora_zoo, args)
                recipe = zoo.provenance
                return {"trainable": lora_params(s, args.lora_large), "losses": [], "train_seconds": float("nan"),
                        "heads": {}, "provenance": recipe,
                        "correct": {"entity-tracking": correct(zoo.model, ev["entity-tracking"]).tolist()}}
        results[name] = _stage(out, f"train-{run_id}", key, fn)

    if args.train_only:
        return 0
    et_c = et_circuit()
    et_heads = heads_by_layer(et_c.heads())

    # 3. figures of the located circuits, overlap with path-patching circuits
    curve_figure({t: c.meta for t, c in located.items()}, out / "figures" / "loss_curve.png")
    for t, c in located.items():
        heatmap_figure(c.scores["headmap"], c.heads(), s, out / "figures" / f"heads_{t}.png",
                       f"{args.model} on {t}: k={args.k} per layer, n={c.meta['n_samples']}", c.meta["curve"])
    overlap_rows = []
    for path in filter(None, args.path_patching.split(",")):
        pp = Circuit.load(path)
        for name, c in located.items():
            for g, heads in [*pp.groups.items(), ("all", pp.heads())]:
                if not heads:
                    continue
                row = overlap_row(g, heads, c.heads(), n_total, pp.names.get(g, "all heads"))
                overlap_rows.append({"path_patching": f"{pp.model} ({Path(path).name})", "located_on": name, **row})

    lora_ref = lora_params(s, args.lora_large)
    hm_formula = HeadMap.n_params_for(et_heads, s.d_head, s.d_model, args.rank)
    rows, estimates = [], {}
    for name, r in results.items():
        est = bootstrap(r["correct"]["entity-tracking"])
        estimates[name] = est
        rows.append({"method": name, "trainable_params": r["trainable"],
                     f"ratio_to_lora_r{args.lora_large}": r["trainable"] / lora_ref,
                     "accuracy": est.value, "ci_low": est.low, "ci_high": est.high,
                     "final_train_loss": float(np.mean(r["losses"][-5:])) if r["losses"] else float("nan"),
                     "train_seconds": r["train_seconds"]})
    write_table(rows, out / "tables" / "methods", caption="HeadMap vs LoRA on entity tracking")
    if overlap_rows:
        write_table(overlap_rows, out / "tables" / "overlap", caption="Located heads vs path-patching circuits")
    loc_rows = [{"task": t, "n_samples": c.meta["n_samples"], "pool": c.meta["pool"], "k": c.meta["k"],
                 "heads": len(c.heads()), "forward_passes": c.meta["forward_passes"], "rows": c.meta["rows"],
                 "seconds": c.meta["seconds"], "selection_seconds": c.meta["selection_seconds"],
                 "pool_loss": c.meta["pool_loss"], "selected_loss": c.meta["base_loss"],
                 "loss_all_masked": c.meta["curve"][-1]} for t, c in located.items()]
    write_table(loc_rows, out / "tables" / "locating", caption="Locating cost and losses")
    grouped_bars(out / "figures" / "accuracy.png", ["entity tracking (held-out objects)"],
                 {name: [est] for name, est in estimates.items()},
                 title=f"{args.model}: {args.steps} steps of batch {args.batch}, lr {args.lr}")
    _loss_figure(results, out / "figures" / "train_loss.png")

    # 4. report
    tr_c = located.get(args.transfer_task)
    shared = sorted(set(et_c.heads()) & set(tr_c.heads())) if tr_c else []
    text = _report(args, model, located, rows, overlap_rows, loc_rows, estimates, lora_ref, hm_formula, shared,
                   to_markdown, time.time() - t_start)
    write_text(out / "report.md", text)
    write_json(out / "run.json", {"args": {k: v for k, v in vars(args).items() if k != "func"},
                                  "seconds": round(time.time() - t_start, 1)})
    print(text)
    return 0


def _loss_figure(results: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from ..io import save_figure

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in results.items():
        if r["losses"]:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training answer loss")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    return save_figure(fig, path)


def _report(args, model, located, rows, overlap_rows, loc_rows, estimates, lora_ref, hm_formula, shared,
            to_markdown, seconds) -> str:
    et_c = located["entity-tracking"]
    pick = lambda rs, keys: [{k: r[k] for k in keys if k in r} for r in rs]  # noqa: E731
    ratio_col = f"ratio_to_lora_r{args.lora_large}"
    lines = [
        f"# HeadMap on {args.model}",
        "",
        f"Made by `mechdiff headmap compare --model {args.model} --out {args.out} --n {args.n} --pool {args.pool} "
        f"--k {args.k} --batch-size {args.batch_size} --rank {args.rank} --steps {args.steps} --batch {args.batch} "
        f"--lr {args.lr} --headmap-lr {args.headmap_lr} "
        f"--eval-n {args.eval_n} --lora-small {args.lora_small} --lora-large {args.lora_large} "
        f"--transfer-task {args.transfer_task} --runs {args.runs}` in {seconds / 60:.1f} min "
        "(stages cached under `stages/`; each stage's seconds are those of the run that computed it).",
        "",
        "## Locating (layer-conditioned, zero masks)",
        "",
        f"Samples: the {args.n} lowest-loss prompts of a pool of {args.pool}; k = {args.k} heads kept per layer. "
        f"One layer is one batch of (n_heads + 1) x n rows, the extra block masking only earlier selections "
        f"(it gives the loss curve).",
        "",
        to_markdown(loc_rows),
        "",
        "![loss curve](figures/loss_curve.png)",
        "",
        f"![entity-tracking heads](figures/heads_entity-tracking.png)",
        "",
        (f"Heads located on both tasks: {len(shared)} of {len(et_c.heads())} "
         f"({', '.join(h.name for h in shared) or 'none'})." if len(located) > 1 else ""),
        "",
        "## HeadMap vs LoRA on entity tracking",
        "",
        f"Training: {args.steps} steps of {args.batch} prompts (2-7 boxes, training objects), AdamW, lr {args.lr} "
        f"for LoRA and {args.headmap_lr} for the HeadMap maps; "
        f"evaluation: {args.eval_n} held-out 7-box prompts (objects never seen in training), 95% bootstrap CI. "
        f"HeadMap rank r = {args.rank}; its parameter count by the formula sum_l r (k_l d_head + d_model) = "
        f"{hm_formula}. LoRA: alpha = 2r on q, k, v, o; LoRA r={args.lora_large} has {lora_ref} parameters.",
        "",
        to_markdown(pick(rows, ["method", "trainable_params", ratio_col, "accuracy", "ci_low", "ci_high",
                                "final_train_loss", "train_seconds"])),
        "",
        (f"The `lora-zoo` row is not retrained here: `{args.lora_zoo}` is step 15 of the zoo's LoRA run with exactly "
         "this LoRA recipe and these training batches (r=8, alpha 16, q/k/v/o, lr 1e-3, batch 16, data seed 0; "
         "`mechdiff/zoo/smollm2-et/recipe.json`), evaluated on the same held-out prompts. That run's own validation "
         "accuracy (100 prompts of training objects) was 0.63 at step 15 and 0.75 at step 20, so at HeadMap's 20 "
         "steps the large LoRA would stand somewhat higher than this row." if any("zoo" in r["method"] for r in rows)
         else ""),
        "",
        "![accuracy](figures/accuracy.png)",
        "",
        "![training loss](figures/train_loss.png)",
        "",
    ]
    if overlap_rows:
        lines += [
            "## Located heads vs the path-patching circuit",
            "",
            "The path-patching circuits are those of `smollm2-et-early` (SmolLM2-135M after 15 LoRA steps on entity "
            "tracking, the base of the committed study `results/entity-tracking-smollm2`): the repository has no "
            "path-patching circuit of the raw `smollm2-135m`, which solves 7-box entity tracking too rarely "
            "(0.09-0.16) for path patching to find a mechanism. The located heads are those of `smollm2-135m`, "
            "whose weights `smollm2-et-early` shares but for a small LoRA.",
            "",
            "p: hypergeometric probability that a random head set of the located size shares at least this many "
            f"heads with the path-patching group ({model.shape.n_layers * model.shape.n_heads} heads in all).",
            "",
            to_markdown(pick(overlap_rows, ["path_patching", "located_on", "group", "name", "size_first",
                                            "size_second", "intersection", "frac_first", "p_value"])),
            "",
        ]
    return "\n".join(lines) + "\n"
