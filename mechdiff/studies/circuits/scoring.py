"""Circuits scored by mean ablation on one model's prompts, as ``mechdiff score``, ``prune``, ``compare``,
``curve`` and ``positions`` run them: the prompt sets (drawn by name, `mechdiff.runs.seeds.prompt_seed`:
``command-scoring``, ``command-reference``, ``command-ranking``), the computation, and the tables, figures and
JSON each writes. Each run returns the text the command prints (its tables in markdown), but for the long ones
(`score_circuit`, `scan_positions`), which hand each table to ``echo`` as soon as it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from ...circuits.circuit import Circuit
from ...circuits.curve import ablation_attribution, faithfulness_curve, ranking
from ...circuits.measures import completeness, faithfulness, matrix_rows
from ...circuits.overlap import overlap_table
from ...circuits.positions import leave_one_out, position_scan, task_classes
from ...circuits.pruning import minimality, pair_name, pairwise_minimality, prune
from ...circuits.scoring import Metric, Scorer, continuous_key
from ...common.io import write_json
from ...common.metrics import metric_label, scored_metric
from ...models.loading import LoadedModel
from ...models.modelset import ModelSet
from ...report.membership import membership_heatmap
from ...report.positions import curve_figure, position_scan_figure
from ...report.rows import circuit_x_model_rows, completeness_rows, curve_caption, curve_rows, scan_rows
from ...report.tables import estimate_columns, to_markdown, write_table
from ...runs.seeds import prompt_seed
from ...tasks.base import Task

#: ``mechdiff compare`` and `mechdiff.api.compare.compare`: prompts scored per model, and where the tables go.
COMPARE_N, COMPARE_OUT = 100, "results/compare"
#: Where the means that replace an ablated head come from: ``path_patching``, the task's reference prompts
#: (entity tracking: the path-patching sources); ``fresh``, new prompts of the task. The first is the default.
REFERENCES = ("path_patching", "fresh")


@dataclass(frozen=True)
class ScoringPrompts:
    """The prompts a scoring run draws: ``n`` prompts of ``task`` (set ``command-scoring`` of ``seed``) and the
    mean-ablation reference set (``n_reference``, default ``n``; set ``command-reference`` of ``seed`` unless
    ``reference_seed`` is given); ``options``: the task's generator options (entity tracking: ``n_boxes``)."""

    task: Task
    n: int
    seed: int = 0
    reference: str = REFERENCES[0]
    n_reference: Optional[int] = None
    reference_seed: Optional[int] = None
    batch_size: int = 32
    progress: bool = True
    store: Optional[str] = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ValueError(f"unknown reference {self.reference!r}: choose one of {', '.join(REFERENCES)}")

    def records(self, tokenizer: Any, n: int, prompts: str, **record_options: Any) -> list:
        """``n`` prompts of the set named ``prompts`` (`mechdiff.runs.seeds.PROMPT_OFFSETS`)."""
        return self.task.records(tokenizer, n, prompt_seed(self.seed, prompts), **self.options, **record_options)

    def scorer(self, model: LoadedModel, **record_options: Any) -> Scorer:
        """The scorer of ``model`` on the scored prompts, ablating with the reference set's means;
        ``record_options`` go to the scored prompts only (e.g. held-out objects)."""
        records = self.records(model.tokenizer, self.n, "command-scoring", **record_options)
        ref_seed = prompt_seed(self.seed, "command-reference") if self.reference_seed is None else self.reference_seed
        n_ref = self.n_reference or self.n
        reference = (
            self.task.reference_records(model.tokenizer, n_ref, ref_seed, **self.options)
            if self.reference == "path_patching"
            else self.task.records(model.tokenizer, n_ref, ref_seed, **self.options)
        )
        return Scorer.build(
            model, records, reference, self.batch_size, self.progress, self.store, metric=self.task.metric
        )


def faithfulness_rows(res: dict) -> list[dict]:
    """Rows ``full``, ``circuit`` (and ``random``) with accuracy, answer probability and faithfulness (accuracy and
    the task's continuous metric)."""
    rows = []
    for what in ("full", "circuit", "random"):
        if what in res:
            row = {"run": what}
            for metric in ("accuracy", "answer_prob", "faithfulness", continuous_key(res[what])):
                row.update(estimate_columns(metric, res[what][metric]))
            rows.append(row)
    return rows


def score_circuit(
    model: LoadedModel,
    circuit: Circuit,
    circuit_path: str,
    prompts: ScoringPrompts,
    out: Path,
    n_random: int,
    completeness_draws: int,
    metric: Metric,
    with_completeness: bool,
    settings: dict,
    echo: Callable[[str], None] = print,
) -> None:
    """Faithfulness (with ``n_random`` random circuits) and, ``with_completeness``, completeness of ``circuit``:
    ``out/faithfulness.*``, ``out/completeness.*`` and ``out/score.json``. Each table goes to ``echo`` (in
    markdown) once written, the faithfulness table before completeness runs; the second begins with a blank line."""
    scorer = prompts.scorer(model)
    result = {
        "model": model.name,
        "fingerprint": model.fingerprint,
        "circuit": circuit_path,
        "settings": settings,
        "faithfulness": faithfulness(scorer, circuit, n_random=n_random, seed=prompts.seed),
    }
    rows = faithfulness_rows(result["faithfulness"])
    write_table(rows, out / "faithfulness", caption=f"Mean-ablation faithfulness of {circuit_path} on {model.name}")
    echo(to_markdown(rows))
    if with_completeness:
        metric = scored_metric(metric, scorer.metric)  # prob: the task's continuous metric
        result["completeness"] = completeness(
            scorer, circuit, n_draws=completeness_draws, seed=prompts.seed, metric=metric
        )
        rows = completeness_rows({model.name: result["completeness"]})
        caption = f"Completeness ({metric_label(metric)}) of {circuit_path} on {model.name}"
        write_table(rows, out / "completeness", caption=caption)
        echo("\n" + to_markdown(rows))
    write_json(out / "score.json", result)


def prune_circuit(
    model: LoadedModel,
    circuit: Circuit,
    circuit_path: str,
    prompts: ScoringPrompts,
    out: Path,
    rule: str,
    threshold: float,
    share: float,
    max_steps: int,
    n_candidates: Optional[int],
    metric: Metric,
    settings: dict,
) -> str:
    """Minimality of each pair of ``circuit`` by ``rule`` (``paper``: `pairwise_minimality`, else greedy
    `minimality`) and the circuit pruned at ``threshold``: written to ``out`` (a file), the minimality
    table beside it (``<stem>.minimality.*``)."""
    scorer = prompts.scorer(model)
    metric = scored_metric(metric, scorer.metric)  # prob: the task's continuous metric
    if rule == "paper":
        result = pairwise_minimality(scorer, circuit, metric=metric, share=share, threshold=threshold)
    else:
        result = minimality(
            scorer, circuit, max_steps=max_steps, n_candidates=n_candidates, seed=prompts.seed, metric=metric
        )
    pruned = prune(circuit, result, threshold=threshold)
    pruned.meta["pruned"].update(
        model=model.name, fingerprint=model.fingerprint, source=circuit_path, settings=settings
    )
    pruned.save(out)
    kept = {n for g in pruned.groups for n in (pair_name((h, pruned.positions[g])) for h in pruned.groups[g])}
    rows = [
        {
            "pair": name,
            **(
                {"F(C\\K)": r["before"], "F(C\\(K+v))": r["after"], "score": r["score"]}
                if rule == "paper"
                else {"contribution": r["contribution"], "relative": r["relative"]}
            ),
            "kept": name in kept,
            "K": " ".join(r["K"]),
        }
        for name, r in result["pairs"].items()
    ]
    write_table(
        rows,
        out.with_name(out.stem + ".minimality"),
        caption=f"Minimality ({rule} rule, {metric_label(metric)}, threshold {threshold}) on {model.name}",
    )
    return (
        f"{to_markdown(rows)}\n\nkept {len(pruned.pairs())} of {len(circuit.pairs())} pairs; sizes "
        f"{circuit.sizes()} -> {pruned.sizes()}\nwrote {out}"
    )


def overlap_rows(circuits: Mapping[str, Circuit], n_layers: int, n_heads: int) -> list[dict]:
    """The overlap table of every pair of circuits, with columns naming the two circuits."""
    rows = []
    for a, b in combinations(circuits, 2):
        rows += [{"first": a, "second": b, **r} for r in overlap_table(circuits[a], circuits[b], n_layers, n_heads)]
    return rows


def compare_circuits(
    models: ModelSet, circuits: Mapping[str, Circuit], prompts: ScoringPrompts, out: Path, n_random: int, settings: dict
) -> str:
    """Every circuit scored on every model (``out/matrix.*``), the overlap of every pair of circuits
    (``out/overlap.*``), the membership heatmap and ``out/compare.json``."""
    shape = models.shape
    rows, fingerprints = [], {}
    for lm in models:
        rows += matrix_rows(lm.name, dict(circuits), prompts.scorer(lm), n_random=n_random, seed=prompts.seed)
        fingerprints[lm.name] = lm.fingerprint
    shown = circuit_x_model_rows(rows)
    write_table(shown, out / "matrix", caption="Circuits x models: accuracy with only the circuit, faithfulness")
    text = [to_markdown(shown)]
    result = {"settings": settings, "fingerprints": fingerprints, "matrix": rows}
    if len(circuits) > 1:
        result["overlap"] = overlap_rows(circuits, shape.n_layers, shape.n_heads)
        write_table(result["overlap"], out / "overlap", caption="Per-group overlap of circuits (hypergeometric p)")
        text.append(to_markdown(result["overlap"]))
    membership_heatmap(circuits, shape.n_layers, shape.n_heads, out / "membership.png", title="Circuit membership")
    write_json(out / "compare.json", result)
    text.append(f"wrote {out}/matrix.*, {'overlap.*, ' if len(circuits) > 1 else ''}membership.png, compare.json")
    return "\n\n".join(text)


def size_curve(
    model: LoadedModel,
    prompts: ScoringPrompts,
    out: Path,
    sizes: Sequence[float],
    target: float,
    rank_n: int,
    settings: dict,
    record_options: Optional[Mapping[str, Any]] = None,
) -> str:
    """Rank every (head, position class) pair by mean-ablation attribution on ``rank_n`` other prompts (set
    ``command-ranking``), score the nested circuits of the top ``sizes`` on the scored prompts, and write
    ``out/curve.*``, ``out/curve.png`` and ``out/curve.json`` (with the smallest circuit reaching ``target``).
    ``record_options`` go to the scored and ranking prompts (e.g. held-out objects)."""
    record_options = dict(record_options or {})
    scorer = prompts.scorer(model, **record_options)
    classes = task_classes(scorer)
    # rank on other prompts than those scored, so the curve measures the circuits on fresh prompts
    ranking_records = prompts.records(model.tokenizer, rank_n, "command-ranking", **record_options)
    scores = ablation_attribution(
        Scorer(model, ranking_records, scorer.means, scorer.batch_size, scorer.progress, scorer.metric), classes
    )
    ranked = ranking(scores)
    curve = faithfulness_curve(scorer, ranked, sizes, target)
    rows = curve_rows(curve)
    write_table(rows, out / "curve", caption=curve_caption(model.name, curve))
    chosen = curve["chosen"]
    n = chosen["n_pairs"] if chosen else 0
    curve_figure(curve, out / "curve.png", title=f"{model.name}: faithfulness vs circuit size")
    write_json(
        out / "curve.json",
        {
            "model": model.name,
            "fingerprint": model.fingerprint,
            "settings": settings,
            "curve": curve,
            "classes": list(classes),
            "ranking": [[pair_name(p), scores[p]] for p in ranked],
            "circuit": [pair_name(p) for p in ranked[:n]],
        },
    )
    return f"{to_markdown(rows)}\n\nsmallest circuit reaching faithfulness {target}: " + (
        f"{n} pairs ({chosen['fraction']:.0%} of {len(ranked)})" if chosen else "none of the sizes scored"
    )


def scan_positions(
    model: LoadedModel,
    prompts: ScoringPrompts,
    out: Path,
    metric: Metric,
    stop_at: Optional[float],
    max_steps: Optional[int],
    with_leave_one_out: bool,
    settings: dict,
    echo: Callable[[str], None] = print,
) -> None:
    """The greedy scan of the position classes ``model`` needs (every head kept there) and, with
    ``with_leave_one_out``, every class kept but one: ``out/position_scan.*`` (+ figure),
    ``out/leave_one_out.*`` and ``out/positions.json``. Each table goes to ``echo`` (in markdown) once written, the
    scan's before leave-one-out runs; the second begins with a blank line."""
    scorer = prompts.scorer(model)
    classes = task_classes(scorer)
    metric = scored_metric(metric, scorer.metric)  # prob: the task's continuous metric
    scan = position_scan(scorer, classes, metric, stop_at=stop_at, max_steps=max_steps)
    result = {"model": model.name, "fingerprint": model.fingerprint, "settings": settings, "scan": scan}
    rows = scan_rows(scan)
    write_table(
        rows,
        out / "position_scan",
        caption=f"Greedy position scan on {model.name} "
        f"(every head kept at the classes so far, every other (head, position) mean-ablated)",
    )
    echo(to_markdown(rows))
    if with_leave_one_out:
        result["leave_one_out"] = leave_one_out(scorer, classes, metric)
        loo = [
            {
                "left out": c,
                **estimate_columns("accuracy", r["accuracy"]),
                **estimate_columns("faithfulness", r["faithfulness"]),
            }
            for c, r in result["leave_one_out"]["classes"].items()
        ]
        write_table(loo, out / "leave_one_out", caption=f"Every class kept but one, on {model.name}")
        echo("\n" + to_markdown(loo))
    position_scan_figure(scan, out / "position_scan.png", title=f"{model.name}: where the task is computed")
    write_json(out / "positions.json", result)
