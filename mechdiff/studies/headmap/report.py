"""The HeadMap study's report: its figures, tables and ``report.md`` text, made from the study's records.

``st`` below is the study's settings (`mechdiff.studies.headmap.study.HeadMapSettings`, a task file's
``[headmap]``); a record is one training or evaluation run (its ``correct`` outcomes keyed by `TASK` and
`VAL`).
"""

from __future__ import annotations

import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...circuits.circuit import Circuit
from ...circuits.overlap import overlap_row
from ...common.io import save_figure, write_text
from ...common.stats import bootstrap, paired_difference, pooled_mean, pooled_proportion
from ...methods.headmap import HeadMap, heads_by_layer, lora_params
from ...report.bars import grouped_bars
from ...report.tables import to_markdown, write_table

TASK = "entity-tracking"  # the task HeadMap and LoRA train on
UNSEEDED = ("base", "lora-zoo")  # evaluations of fixed models: one record, not one per seed
VAL = "validation"  # key of the validation prompts' outcomes in a training record
#: Paired comparisons of the report (first minus second), where both runs are chosen.
COMPARISONS = (
    ("located", "random"),
    ("located", "outside"),
    ("located", "transfer"),
    ("located", "lora-small"),
    ("headmap+lora", "lora-small"),
)


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------


def curve_figure(curves: dict[str, dict], path: Path) -> Path:
    """Loss of the selected samples with the heads of layers < l masked, against the pool's mean loss."""
    import matplotlib.pyplot as plt

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


def heatmap_figure(
    meta_scores: dict[str, float], heads: list, shape: Any, path: Path, title: str, curve: Any = None
) -> Path:
    """Per head: the loss with it masked (and earlier selections) minus the layer's loss with only the earlier
    selections masked (``curve[layer]``), so every layer's candidates are comparable; selected heads boxed."""
    from ...common.components import parse_heads
    from ...report.figures import head_heatmap

    scores = {
        h: v - (curve[h.layer] if curve else 0.0) for h, v in zip(parse_heads(list(meta_scores)), meta_scores.values())
    }
    return head_heatmap(
        scores,
        shape.n_layers,
        shape.n_heads,
        path,
        title=title,
        selected=heads,
        label="loss increase from masking the head (given earlier selections)",
    )


def loss_figure(results: dict[str, list[dict]], path: Path) -> Path:
    """Training loss per step of every run that trained (mean over its seeds)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, records in results.items():
        losses = [r["losses"] for r in records if r["losses"]]
        if losses:
            ax.plot(
                range(1, len(losses[0]) + 1),
                np.mean(losses, axis=0),
                linewidth=1,
                label=f"{name} (mean of {len(losses)} seeds)",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("training answer loss")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def validation_accuracy(records: dict[float, dict]) -> dict[float, float]:
    """Learning rate -> accuracy on the validation prompts (the only outcomes a rate is chosen on)."""
    return {lr: float(np.mean(r["correct"][VAL])) for lr, r in records.items()}


def _accuracies(records: list[dict]) -> np.ndarray:
    """``"seed prompt"`` 0/1 outcomes on the held-out prompts."""
    return np.asarray([r["correct"][TASK] for r in records], dtype=float)


def method_rows(
    results: dict[str, list[dict]], names: dict[str, str], lora_ref: int, lora_large: int
) -> tuple[list[dict], dict]:
    """One row per run: parameters (and their ratio to the large LoRA's), every seed's accuracy, their mean,
    standard deviation and range, the mean's interval (two-stage bootstrap over seeds and prompts), the mean
    final training loss and seconds. Runs without records (an interrupted study) are left out."""
    rows, estimates = [], {}
    for run_id, records in results.items():
        if not records:
            continue
        acc = _accuracies(records)
        per_seed = acc.mean(axis=1)
        est = pooled_proportion(acc)
        estimates[run_id] = est
        losses = [float(np.mean(r["losses"][-5:])) for r in records if r["losses"]]
        rows.append(
            {
                "method": names[run_id],
                "trainable_params": records[0]["trainable"],
                f"ratio_to_lora_r{lora_large}": records[0]["trainable"] / lora_ref,
                "seeds": len(records),
                "per_seed": " / ".join(f"{a:.3f}" for a in per_seed),
                "accuracy": est.value,
                "sd": float(np.std(per_seed, ddof=1)) if len(records) > 1 else float("nan"),
                "min": float(per_seed.min()),
                "max": float(per_seed.max()),
                "ci_low": est.low,
                "ci_high": est.high,
                "final_train_loss": float(np.mean(losses)) if losses else float("nan"),
                "train_seconds": float(np.mean([r["train_seconds"] for r in records])),
            }
        )
    return rows, estimates


def seed_rows(results: dict[str, list[dict]], names: dict[str, str], seeds: tuple) -> list[dict]:
    """One row per run and seed: held-out accuracy with its bootstrap interval over prompts, validation accuracy."""
    rows = []
    for run_id, records in results.items():
        for seed, r in zip(seeds if run_id not in UNSEEDED else ("-",), records):
            est = bootstrap(r["correct"][TASK])
            val, cfg = r["correct"].get(VAL), r.get("config", {})
            rows.append(
                {
                    "method": names[run_id],
                    "seed": seed,
                    "accuracy": est.value,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "val_accuracy": float(np.mean(val)) if val else float("nan"),
                    "lr": cfg["lr"] if cfg.get("lora_rank") else float("nan"),
                    "headmap_lr": cfg["headmap_lr"] if r.get("heads") else float("nan"),
                }
            )
    return rows


def paired_rows(results: dict[str, list[dict]], names: dict[str, str], seeds: tuple) -> list[dict]:
    """For each comparison of `COMPARISONS` with both runs present: the accuracy difference on the same
    held-out prompts seed by seed (paired bootstrap over prompts) and pooled over seeds x prompts (two-stage
    bootstrap of the per-prompt differences, resampling seeds then prompts)."""
    rows = []
    for a, b in COMPARISONS:
        if not results.get(a) or not results.get(b):
            continue
        m = min(len(results[a]), len(results[b]))  # seeds both runs finished
        x, y = _accuracies(results[a][:m]), _accuracies(results[b][:m])
        label = f"{names[a]} - {names[b]}"
        for seed, xs, ys in zip(seeds, x, y):
            d = paired_difference(xs, ys)
            rows.append(
                {"comparison": label, "seed": str(seed), "difference": d.value, "ci_low": d.low, "ci_high": d.high}
            )
        d = pooled_mean(x - y)
        rows.append(
            {
                "comparison": label,
                "seed": f"pooled ({m} seeds x {x.shape[1]} prompts)",
                "difference": d.value,
                "ci_low": d.low,
                "ci_high": d.high,
            }
        )
    return rows


def sweep_rows(sweep: dict[str, dict[float, dict]], names: dict[str, str], chosen: tuple[float, float]) -> list[dict]:
    """One row per method and learning rate: validation accuracy (bootstrap interval over the prompts), the
    final training loss, and which rate was chosen."""
    label = {"headmap": names["located"], "lora": names["lora-small"]}
    pick = {"lora": chosen[0], "headmap": chosen[1]}
    rows = []
    for method, records in sweep.items():
        for lr, r in records.items():
            est = bootstrap(r["correct"][VAL])
            rows.append(
                {
                    "method": label[method],
                    "lr": lr,
                    "val_accuracy": est.value,
                    "ci_low": est.low,
                    "ci_high": est.high,
                    "final_train_loss": float(np.mean(r["losses"][-5:])),
                    "chosen": "yes" if lr == pick[method] else "",
                }
            )
    return rows


def verdict(rows: list[dict], label: str) -> str:
    """What the pooled interval of comparison ``label`` carries, in one sentence."""
    pooled = [r for r in rows if r["comparison"] == label and r["seed"].startswith("pooled")]
    if not pooled:
        return ""
    r = pooled[0]
    interval = f"{r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
    if r["ci_low"] > 0:
        return f"{label}: {interval}; the interval lies above 0, so the first beats the second here."
    if r["ci_high"] < 0:
        return f"{label}: {interval}; the interval lies below 0, so the second beats the first here."
    return (
        f"{label}: {interval}; the interval includes 0, so this study cannot tell the two apart "
        "(it does not show that the first beats the second)."
    )


def locating_rows(located: dict[str, Circuit]) -> list[dict]:
    return [
        {
            "task": t,
            "n_samples": c.meta["n_samples"],
            "pool": c.meta["pool"],
            "k": c.meta["k"],
            "heads": len(c.heads()),
            "forward_passes": c.meta["forward_passes"],
            "rows": c.meta["rows"],
            "seconds": c.meta["seconds"],
            "selection_seconds": c.meta["selection_seconds"],
            "pool_loss": c.meta["pool_loss"],
            "selected_loss": c.meta["base_loss"],
            "loss_all_masked": c.meta["curve"][-1],
        }
        for t, c in located.items()
    ]


def command_line(st: Any, out: str) -> str:
    """The ``mechdiff headmap compare`` call that makes this study (every setting that differs from the default)."""
    default = type(st)()
    flags = []
    for f in fields(st):
        value = getattr(st, f.name)
        if f.name != "notes" and value != getattr(default, f.name):
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            flags.append(f"--{f.name.replace('_', '-')} {shlex.quote(text)}")
    return " ".join(["mechdiff headmap compare", f"--out {out}", *flags])


def settings_rows(st: Any) -> list[dict]:
    """The paper's setting beside this study's, one row per setting (where they differ, the row says so)."""
    lrs = (
        f"swept over {', '.join(f'{x:g}' for x in st.lrs)} for each method"
        if st.lrs
        else f"{st.lr:g} (LoRA), {st.headmap_lr:g} (HeadMap)"
    )
    return [
        {
            "setting": "locating samples",
            "paper": "the 64 lowest-loss samples of the task",
            "here": f"the {st.n} lowest-loss of a pool of {st.pool}",
            "same": "yes" if st.n == 64 else "no",
        },
        {"setting": "models", "paper": "LLaMA-family 7-8B models (e.g. Llama3-8B)", "here": st.model, "same": "no"},
        {
            "setting": "tasks",
            "paper": "commonsense reasoning datasets (e.g. SIQA, HellaSwag)",
            "here": f"{TASK} (7-box prompts; transfer from {st.transfer_task})",
            "same": "no",
        },
        {"setting": "heads kept per layer", "paper": "not known here", "here": str(st.k), "same": "?"},
        {"setting": "map rank", "paper": "not known here", "here": str(st.rank), "same": "?"},
        {"setting": "learning rate", "paper": "not known here", "here": lrs, "same": "?"},
        {
            "setting": "training",
            "paper": "not known here",
            "here": f"{st.steps} steps of {st.batch} prompts, {len(st.seeds)} seeds",
            "same": "?",
        },
        {
            "setting": "baselines",
            "paper": "LoRA; random head selection; other locating strategies",
            "here": "LoRA r=1 and the zoo's r=8; random heads; heads outside the located set; a transferred circuit",
            "same": "partly",
        },
    ]


def edge_notes(lrs: tuple, chosen: dict[str, float]) -> list[str]:
    """A warning line (and a blank) for each method whose chosen rate lies at an end of the swept grid."""
    out = []
    for method, lr in chosen.items():
        if lrs and lr in (min(lrs), max(lrs)) and len(lrs) > 1:
            side = "largest" if lr == max(lrs) else "smallest"
            out += [
                f"{method}'s chosen rate {lr:g} is the {side} swept: rates beyond it were not tried, so "
                f"{method} may be under-tuned.",
                "",
            ]
    return out


def report_text(
    st: Any,
    out: str,
    shape: Any,
    located: dict[str, Circuit],
    rows: list[dict],
    overlap_rows: list[dict],
    loc_rows: list[dict],
    seconds: float,
    seed_table: list[dict],
    paired: list[dict],
    sweep_table: list[dict],
    lrs: Optional[tuple[float, float]],
    cold_seconds: float,
) -> str:
    names = {"located": "HeadMap (located)", "random": "HeadMap, random heads per layer"}
    et_c = located[TASK]
    tr_c = located.get(st.transfer_task)
    shared = sorted(set(et_c.heads()) & set(tr_c.heads())) if tr_c else []
    lora_ref = lora_params(shape, st.lora_large)
    hm_formula = HeadMap.n_params_for(heads_by_layer(et_c.heads()), shape.d_head, shape.d_model, st.rank)
    pick = lambda rs, keys: [{k: r[k] for k in keys if k in r} for r in rs]  # noqa: E731
    ratio_col = f"ratio_to_lora_r{st.lora_large}"
    lora_lr, headmap_lr = lrs if lrs else (st.lr, st.headmap_lr)
    main = verdict(paired, f"{names['located']} - {names['random']}")
    et_meta = et_c.meta
    lines = [
        f"# HeadMap on {st.model}",
        "",
        f"Made by `{command_line(st, out)}` (the settings of `tasks/headmap.toml`: `mechdiff run "
        f"tasks/headmap.toml`). This invocation took {seconds:.0f} s; computing every stage it read "
        f"took {cold_seconds / 60:.1f} min in all (the sum of the stages' own seconds, each measured by the run that "
        "computed it, on 2 shared CPU cores; stages cached under `stages/`).",
        "",
        *([st.notes, ""] if st.notes else []),
        "## Locating (layer-conditioned, zero masks)",
        "",
        f"Samples: the {st.n} lowest-loss prompts of a pool of {st.pool}; k = {st.k} heads kept per layer. "
        f"One layer is one batch of (n_heads + 1) x n rows, the extra block masking only earlier selections "
        f"(it gives the loss curve).",
        "",
        to_markdown(loc_rows),
        "",
        "![loss curve](figures/loss_curve.png)",
        "",
        "![entity-tracking heads](figures/heads_entity-tracking.png)",
        "",
        (
            f"Heads located on both tasks: {len(shared)} of {len(et_c.heads())} "
            f"({', '.join(h.name for h in shared) or 'none'})."
            if len(located) > 1
            else ""
        ),
        "",
        "## HeadMap vs LoRA on entity tracking",
        "",
        f"Training: {st.steps} steps of {st.batch} prompts (2-7 boxes, training objects), AdamW; "
        f"{len(st.seeds)} seeds ({', '.join(map(str, st.seeds))}): seed s initialises the maps / LoRA from s, "
        f"trains on the batches of data seed {st.data_seed} + s, and draws the random and outside head sets from "
        '`derive(s, "random-heads")` and `derive(s, "outside-heads")`. '
        f"Evaluation: {st.eval_n} held-out 7-box prompts (objects never seen in training), the same prompts for "
        "every run and seed. "
        f"HeadMap rank r = {st.rank}; its parameter count by the formula sum_l r (k_l d_head + d_model) = "
        f"{hm_formula}. LoRA: alpha = 2r on q, k, v, o; LoRA r={st.lora_large} has {lora_ref} parameters.",
        "",
        "### Learning rates",
        "",
    ]
    if sweep_table:
        lines += [
            f"Both methods are swept over the same rates ({', '.join(f'{x:g}' for x in st.lrs)}) on seed "
            f"{st.seeds[0]}: HeadMap on the located heads, LoRA at r={st.lora_small}. Each rate is scored on "
            f"{st.val_n} validation prompts of *training* objects (7 boxes, seed {st.val_seed}; never the held-out "
            "evaluation prompts), and each method then trains at its own best rate (ties: the smaller rate): "
            f"LoRA at {lora_lr:g}, HeadMap at {headmap_lr:g}; the random, outside and transferred head sets train "
            "at HeadMap's rate (chosen on the located heads, which can only favour the located row), "
            "HeadMap + LoRA at both.",
            "",
            to_markdown(sweep_table),
            "",
            *edge_notes(st.lrs, {"LoRA": lora_lr, "HeadMap": headmap_lr}),
        ]
    else:
        lines += [f"No sweep: LoRA at {lora_lr:g}, HeadMap at {headmap_lr:g}.", ""]
    lines += [
        "### Accuracy (seeds pooled)",
        "",
        "accuracy: mean over seeds and prompts; per_seed: each seed's accuracy in seed order; sd, min, max: over "
        "the seeds; ci: 95% two-stage bootstrap (seeds, then prompts, resampled), an interval for the mean. "
        "`base` and the zoo's LoRA are fixed models, evaluated once.",
        "",
        to_markdown(
            pick(
                rows,
                [
                    "method",
                    "trainable_params",
                    ratio_col,
                    "seeds",
                    "per_seed",
                    "accuracy",
                    "sd",
                    "min",
                    "max",
                    "ci_low",
                    "ci_high",
                    "final_train_loss",
                    "train_seconds",
                ],
            )
        ),
        "",
        (
            f"The `lora-zoo` row is not retrained here: `{st.lora_zoo}` is step 15 of the zoo's LoRA run (r=8, "
            "alpha 16, q/k/v/o, lr 1e-3, batch 16, data seed 0; `mechdiff/zoo/smollm2-et/recipe.json`), evaluated on "
            "the same held-out prompts; its rate was not swept and it has one seed. That run's own validation "
            "accuracy (100 prompts of training objects) was 0.63 at step 15 and 0.75 at step 20."
            if "lora-zoo" in st.runs
            else ""
        ),
        "",
        "![accuracy](figures/accuracy.png)",
        "",
        "![training loss](figures/train_loss.png)",
        "",
        "Every run seed by seed (held-out accuracy with its 95% bootstrap interval over prompts, validation "
        "accuracy, the rates it trained at):",
        "",
        to_markdown(
            pick(seed_table, ["method", "seed", "accuracy", "ci_low", "ci_high", "val_accuracy", "lr", "headmap_lr"])
        ),
        "",
    ]
    if paired:
        lines += [
            "### Paired comparisons",
            "",
            "Accuracy difference (first minus second) on the same held-out prompts: per seed a paired bootstrap "
            "over prompts; pooled, a two-stage bootstrap of the per-prompt differences (seeds, then prompts). "
            "Seed s of both runs shares its training batches.",
            "",
            to_markdown(paired),
            "",
            f"**Do located heads beat random ones here?** {main or 'not measured (no located and random runs).'}",
            "",
        ]
    lines += [
        "## Beside the paper (Wang et al., HeadMap, ICLR 2025)",
        "",
        "No paper figure is set beside a measured one: the references this study could read hold the paper's "
        "abstract, its repository's README and its OpenReview reviews, not its tables; and its models and tasks "
        "differ from these, so its accuracies would not be comparable anyway. What the paper states "
        "qualitatively, beside what is measured here:",
        "",
        f"- Masking a small portion of the located heads significantly reduces correct predictions (abstract). "
        f"Here: with all {len(et_c.heads())} located heads zero-masked, the selected samples' answer loss rises "
        f"from {et_meta['base_loss']:.2f} to {et_meta['curve'][-1]:.2f} nats (pool mean unmasked "
        f"{et_meta['pool_loss']:.2f}).",
        "- HeadMap on located heads outperforms random head selection (the paper's ablation, as its reviewers "
        f"summarise it). Here: {main or 'not measured.'}",
        "",
        to_markdown(settings_rows(st)),
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
            f"heads with the path-patching group ({shape.n_layers * shape.n_heads} heads in all).",
            "",
            to_markdown(
                pick(
                    overlap_rows,
                    [
                        "path_patching",
                        "located_on",
                        "group",
                        "name",
                        "size_first",
                        "size_second",
                        "intersection",
                        "frac_first",
                        "p_value",
                    ],
                )
            ),
            "",
        ]
    return "\n".join(lines) + "\n"


def overlap_rows(located: dict[str, Circuit], path_patching: Sequence[str | Path], shape: Any) -> list[dict]:
    """Each located circuit against each group (and all heads) of each path-patching circuit file: the overlap
    row of `mechdiff.circuits.overlap.overlap_row` (hypergeometric p over every head of ``shape``)."""
    rows = []
    for path in path_patching:
        pp = Circuit.load(path)
        for name, c in located.items():
            for g, heads in [*pp.groups.items(), ("all", pp.heads())]:
                if heads:
                    row = overlap_row(g, heads, c.heads(), shape.n_layers * shape.n_heads, pp.names.get(g, "all heads"))
                    rows.append({"path_patching": f"{pp.model} ({Path(path).name})", "located_on": name, **row})
    return rows


def write_report(
    out: Path,
    st: Any,
    shape: Any,
    located: dict[str, Circuit],
    names: dict[str, str],
    results: dict[str, list[dict]],
    sweep: dict[str, dict[float, dict]],
    lrs: Optional[tuple[float, float]],
    seconds: float,
    cold_seconds: float,
) -> Path:
    """The HeadMap study's figures, tables and ``report.md`` under ``out`` from its records: ``results`` (run ->
    records), ``sweep`` (method -> learning rate -> record), the chosen rates ``lrs``, this invocation's
    ``seconds`` and the stages' own ``cold_seconds``."""
    curve_figure({t: c.meta for t, c in located.items()}, out / "figures" / "loss_curve.png")
    for t, c in located.items():
        heatmap_figure(
            c.scores["headmap"],
            c.heads(),
            shape,
            out / "figures" / f"heads_{t}.png",
            f"{st.model} on {t}: k={st.k} per layer, n={c.meta['n_samples']}",
            c.meta["curve"],
        )
    overlaps = overlap_rows(located, st.path_patching, shape)
    rows, estimates = method_rows(results, names, lora_params(shape, st.lora_large), st.lora_large)
    write_table(rows, out / "tables" / "methods", caption="HeadMap vs LoRA on entity tracking (seeds pooled)")
    seed_table = seed_rows(results, names, st.seeds)
    write_table(seed_table, out / "tables" / "seeds", caption="Every run, seed by seed")
    paired = paired_rows(results, names, st.seeds)
    if paired:
        write_table(paired, out / "tables" / "paired", caption="Paired differences on the same held-out prompts")
    sweep_table = sweep_rows(sweep, names, lrs) if sweep else []
    if sweep_table:
        write_table(sweep_table, out / "tables" / "lr_sweep", caption="Learning-rate sweep (validation prompts)")
    if overlaps:
        write_table(overlaps, out / "tables" / "overlap", caption="Located heads vs path-patching circuits")
    loc_rows = locating_rows(located)
    write_table(loc_rows, out / "tables" / "locating", caption="Locating cost and losses")
    grouped_bars(
        out / "figures" / "accuracy.png",
        ["entity tracking (held-out objects)"],
        {names[r]: [est] for r, est in estimates.items()},
        title=f"{st.model}: {st.steps} steps of batch {st.batch}, {len(st.seeds)} seeds pooled",
    )
    loss_figure({names[r]: recs for r, recs in results.items()}, out / "figures" / "train_loss.png")
    text = report_text(
        st,
        str(out),
        shape,
        located,
        rows,
        overlaps,
        loc_rows,
        seconds,
        seed_table,
        paired,
        sweep_table,
        lrs,
        cold_seconds,
    )
    return write_text(out / "report.md", text)
