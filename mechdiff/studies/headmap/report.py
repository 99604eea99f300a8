"""The HeadMap study's report: ``report.md``'s text and the study's figures, tables and report written from its
records (`write_report`); the figures are `figures`'s, the tables `tables`'s.

``st`` below is the study's settings (`mechdiff.studies.headmap.settings.HeadMapSettings`, a task file's
``[headmap]``); a record is one training or evaluation run (its ``correct`` outcomes keyed by `TASK` and
`VAL`).
"""

from __future__ import annotations

import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

from ...circuits.circuit import Circuit
from ...common.io import write_text
from ...methods.headmap import HeadMap, heads_by_layer, lora_params
from ...report.bars import grouped_bars
from ...report.tables import to_markdown, write_table
from .figures import curve_figure, heatmap_figure, loss_figure
from .settings import TASK
from .tables import (
    edge_notes,
    locating_rows,
    method_rows,
    overlap_rows,
    paired_rows,
    seed_rows,
    settings_rows,
    sweep_rows,
    verdict,
)


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


#: The two runs the report's main question compares, by their table names.
MAIN_PAIR = {"located": "HeadMap (located)", "random": "HeadMap, random heads per layer"}


def _pick(rows: list[dict], keys: list[str]) -> list[dict]:
    """Each row's ``keys`` (those it has), in that order."""
    return [{k: r[k] for k in keys if k in r} for r in rows]


def _header(st: Any, out: str, seconds: float, cold_seconds: float) -> list[str]:
    """The title, the command that makes the study, the time it took and the study's notes."""
    return [
        f"# HeadMap on {st.model}",
        "",
        f"Made by `{command_line(st, out)}` (the settings of `tasks/headmap.toml`: `mechdiff run "
        f"tasks/headmap.toml`). This invocation took {seconds:.0f} s; computing every stage it read "
        f"took {cold_seconds / 60:.1f} min in all (the sum of the stages' own seconds, each measured by the run that "
        "computed it, on 2 shared CPU cores; stages cached under `stages/`).",
        "",
        *([st.notes, ""] if st.notes else []),
    ]


def _locating(st: Any, located: dict[str, Circuit], loc_rows: list[dict]) -> list[str]:
    """How the heads were located, their cost and figures, and the heads both tasks share."""
    et_c = located[TASK]
    tr_c = located.get(st.transfer_task)
    shared = sorted(set(et_c.heads()) & set(tr_c.heads())) if tr_c else []
    return [
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
    ]


def _training(st: Any, shape: Any, located: dict[str, Circuit]) -> list[str]:
    """How every run trains and is evaluated, and the parameter counts."""
    lora_ref = lora_params(shape, st.lora_large)
    hm_formula = HeadMap.n_params_for(heads_by_layer(located[TASK].heads()), shape.d_head, shape.d_model, st.rank)
    return [
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
    ]


def _rates(st: Any, sweep_table: list[dict], lora_lr: float, headmap_lr: float) -> list[str]:
    """The learning-rate sweep and the rates chosen (or the settings' rates without a sweep)."""
    lines = ["### Learning rates", ""]
    if not sweep_table:
        return lines + [f"No sweep: LoRA at {lora_lr:g}, HeadMap at {headmap_lr:g}.", ""]
    return lines + [
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


#: The columns of the report's accuracy table (``ratio_to_lora_r<rank>`` third).
ACCURACY_COLUMNS = [
    "method",
    "trainable_params",
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
]


def _accuracy(st: Any, rows: list[dict], seed_table: list[dict]) -> list[str]:
    """Accuracy per method (seeds pooled) and per seed, with the figures."""
    columns = [*ACCURACY_COLUMNS[:2], f"ratio_to_lora_r{st.lora_large}", *ACCURACY_COLUMNS[2:]]
    return [
        "### Accuracy (seeds pooled)",
        "",
        "accuracy: mean over seeds and prompts; per_seed: each seed's accuracy in seed order; sd, min, max: over "
        "the seeds; ci: 95% two-stage bootstrap (seeds, then prompts, resampled), an interval for the mean. "
        "`base` and the zoo's LoRA are fixed models, evaluated once.",
        "",
        to_markdown(_pick(rows, columns)),
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
            _pick(seed_table, ["method", "seed", "accuracy", "ci_low", "ci_high", "val_accuracy", "lr", "headmap_lr"])
        ),
        "",
    ]


def _paired(paired: list[dict], main: str) -> list[str]:
    """The paired differences and the answer to the main question (none without paired runs)."""
    if not paired:
        return []
    return [
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


def _paper(st: Any, located: dict[str, Circuit], main: str) -> list[str]:
    """What the paper states qualitatively beside what is measured here, and its settings beside these."""
    et_c = located[TASK]
    et_meta = et_c.meta
    return [
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


#: The columns of the report's overlap table.
OVERLAP_COLUMNS = [
    "path_patching",
    "located_on",
    "group",
    "name",
    "size_first",
    "size_second",
    "intersection",
    "frac_first",
    "p_value",
]


def _overlap(shape: Any, overlaps: list[dict]) -> list[str]:
    """The located heads against the path-patching circuits (none without such circuits)."""
    if not overlaps:
        return []
    return [
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
        to_markdown(_pick(overlaps, OVERLAP_COLUMNS)),
        "",
    ]


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
    """``report.md``'s text, section by section, from the tables `write_report` wrote."""
    lora_lr, headmap_lr = lrs if lrs else (st.lr, st.headmap_lr)
    main = verdict(paired, f"{MAIN_PAIR['located']} - {MAIN_PAIR['random']}")
    lines = [
        *_header(st, out, seconds, cold_seconds),
        *_locating(st, located, loc_rows),
        *_training(st, shape, located),
        *_rates(st, sweep_table, lora_lr, headmap_lr),
        *_accuracy(st, rows, seed_table),
        *_paired(paired, main),
        *_paper(st, located, main),
        *_overlap(shape, overlap_rows),
    ]
    return "\n".join(lines) + "\n"


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
