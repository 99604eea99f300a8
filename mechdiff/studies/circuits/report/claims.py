"""The circuits report's findings and families of claims: the sentences read off the tables, the paired
differences and every test by family (Holm)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ....report.claims import CONTROLS, cmap_family, family_rows
from ....report.paired import difference_sentence, paired_family_rows
from ....report.rows import (
    cmap_has_gap,
)
from ....runs.stages import StageRecord
from .dcm import dcm_test_items
from .kit import Study, _fmt, _interval, study_table


def target_measure(study: "Study", row: dict) -> tuple[str, str]:
    """The faithfulness a circuit's target is read on, and its name: the normalised form (the empty circuit
    subtracted) in the task's metric (the logit difference on a ``logit_diff`` task, else accuracy); the paper's
    ratio only for records made before the empty circuit was scored."""
    if (
        getattr(getattr(study, "task", None), "metric", "prob") == "logit_diff"
        and "faithfulness_normalised_logit_diff" in row
    ):
        return "faithfulness_normalised_logit_diff", "normalised faithfulness in the logit difference"
    if "faithfulness_normalised" in row:
        return "faithfulness_normalised", "normalised faithfulness in accuracy"
    return "faithfulness", "the paper's ratio (records without the empty circuit)"


def circuit_findings(study: "Study", positions: dict, matrix_rows: list[dict], controls: Optional[dict] = None) -> str:
    """Per model: where the computation sits (position scan), and what its own circuit keeps on fresh prompts."""
    target = study.spec.discovery.target
    lines = []
    for name in study.spec.model_names:
        rec = positions.get(name)
        if rec is not None and rec.result["scan"]["steps"]:
            last = rec.result["scan"]["steps"][-1]
            lines.append(
                f"- **{name}**: every head kept at {', '.join(f'`{c}`' for c in last['classes'])} (every "
                f"other position mean-ablated) keeps faithfulness {_fmt(last['faithfulness'])} "
                f"({rec.result['scan']['n_prompts']} prompts)."
            )
        own = next((r for r in matrix_rows if r["model"] == name and r["circuit"] == name), None)
        if own is None:
            continue
        scanned = bool(lines) and lines[-1].startswith(f"- **{name}**")
        key, what = target_measure(study, own)
        met = own[key] >= target and own[f"{key}_low"] >= target - 0.1
        sentence = (
            ("  Its" if scanned else f"- **{name}**: its")
            + f" own circuit ({own['n_pairs']} (head, position) pairs) keeps faithfulness "
            f"{_interval(own, 'faithfulness')} (accuracy {_interval(own, 'accuracy')}) on {own['n_prompts']} "
            + (
                "prompts that include those it was found on ([sets] nested)"
                if study.spec.sets.nested
                else "fresh prompts"
            )
            + (f", {what} {_interval(own, key)}" if key != "faithfulness" else "")
            + f": the target (at least {target}, lower bound at least {target - 0.1:.1f}, on {what}) is "
            + ("met." if met else "not met.")
        )
        if key != "faithfulness" and np.isnan(own[key]):
            sentence += " The model does not beat its empty circuit on these prompts: it has no circuit to find."
        if own.get("empty_accuracy") is not None and own.get("full_accuracy"):
            share = own["empty_accuracy"] / own["full_accuracy"]
            if share >= 0.5:
                sentence += (
                    f" With every head ablated the model keeps {share:.2f} of its accuracy (empty circuit "
                    f"{own['empty_accuracy']:.2f}): the paper's ratio is near 1 for any circuit here, so only "
                    "the normalised faithfulness says what the circuit adds."
                )
        control = (controls or {}).get((name, name))
        if control is not None and own.get("random_draws"):
            draws = own["random_draws"]
            beats = "above" if control.rejects else "not shown above"
            sentence += (
                f" Against {len(draws)} random layer- and position-matched circuits of its size (faithfulness "
                f"{_interval(own, 'random_faithfulness')}; draws' accuracy {min(draws):.2f}-{max(draws):.2f}): "
                f'{beats} them{_rank_clause(own)} (Holm p = {control.p_adjusted:.2g} in "{CONTROLS}").'
            )
        lines.append(sentence)
        after = next((r for r in matrix_rows if r["model"] == name and r["circuit"] == f"{name} pruned"), None)
        if after is not None:
            lines.append(
                f"  After pruning ({after['n_pairs']} pairs): faithfulness {_interval(after, 'faithfulness')}."
            )
    return "\n".join(lines)


def findings(
    study: "Study",
    acc_rows: list[dict],
    matrix_rows: list[dict],
    overlaps: dict,
    cmap: dict,
    paired: Optional[list[dict]] = None,
    gain: Optional[dict] = None,
) -> str:
    """Plain sentences read off the tables (every figure here is in a table above); an ordering between models is
    read from the paired test on the same prompts (Holm within its family), never from two separate intervals."""
    base = study.spec.models.base
    acc = {r["model"]: r for r in acc_rows}
    gain = gain if gain is not None else cmap_family(cmap)
    lines = []
    for ft in study.spec.models.finetunes:
        a_b, a_f = acc[base], acc[ft]
        d = next((r for r in paired or [] if r["comparison"] == f"{ft} - {base}" and r["measure"] == "accuracy"), None)
        order = f"paired against {base} {_interval(a_b, 'accuracy')}: " + (
            difference_sentence(d) if d else "no per-prompt outcomes to pair"
        )
        lines.append(f"- **{ft}** accuracy {_interval(a_f, 'accuracy')}, {order}.")
        m = next((r for r in matrix_rows if r["model"] == ft and r["circuit"] == base), None)
        if m:
            lines.append(f"  The {base} circuit alone gives {ft} faithfulness {_interval(m, 'faithfulness')}.")
        rows = overlaps.get(ft, [])
        everything = next((r for r in rows if r["group"] == "all"), None)
        if everything:
            lines.append(
                f"  Its own circuit shares {everything['intersection']} of the base circuit's "
                f"{everything['size_first']} heads ({everything['frac_first']:.2f}; hypergeometric "
                f"p = {everything['p_value']:.2g})."
            )
        r = cmap.get(ft)
        r = None if r is None or "skipped" in r.result else r
        gap = r and cmap_has_gap(r.result)
        if r and not gap:
            lines.append(
                f"  On the CMAP prompts {ft} ({_fmt(r.result['finetune_accuracy'])}) is not above {base} "
                f"({_fmt(r.result['base_accuracy'])}): there is no gain for CMAP to localise."
            )
        if r and gap:
            lines.append(
                f"  CMAP ({ft} into {base}; base {_fmt(r.result['base_accuracy'])}, fine-tune "
                f"{_fmt(r.result['finetune_accuracy'])}):"
            )
            for x in r.result["rows"]:
                if x["kind"] != "z" or x["scope"].startswith("random"):
                    continue
                control = next(
                    (
                        y
                        for y in r.result.get("random_rows", [])
                        if y["scope"] == f"random:{x['scope']}" and y["kind"] == "z"
                    ),
                    None,
                )
                lines.append(
                    f"  - head outputs of `{x['scope']}`: accuracy {_fmt(x['accuracy'])}. "
                    f"{_ordering(gain, ft, x['scope'] + '/z', 'base')}"
                    + (
                        f" Random heads of the same layers: {_fmt(control['accuracy'])}; "
                        f"{_ordering(gain, ft, x['scope'] + '/z', 'random:' + x['scope'] + '/z')}"
                        if control
                        else ""
                    )
                )
            qk = {x["kind"]: x for x in r.result["rows"] if x["scope"] == "circuit"}
            if "qk" in qk and "v" in qk:
                lines.append(
                    f"  Whole circuit: QK patching gives {_fmt(qk['qk']['accuracy'])}, V patching "
                    f"{_fmt(qk['v']['accuracy'])}. {_ordering(gain, ft, 'circuit/v', 'circuit/qk')}"
                )
    return "\n".join(lines)


def _ordering(gain: dict, ft: str, a: str, b: str) -> str:
    """A sentence on ``a`` against ``b`` from their paired test on the same prompts, in the family "which parts
    carry the gain" (Holm): an ordering is stated only where the adjusted test rejects."""
    test = gain.get((ft, a, b))
    if test is None:
        return ""
    iv = test.interval
    ci = f"{iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"
    verdict = (
        ("so the first is larger" if iv.value > 0 else "so the second is larger")
        if test.rejects
        else "neither is shown to be larger"
    )
    p = f"{test.method}, Holm p = {test.p_adjusted:.2g}"
    return f"Paired difference {a} - {b} on the same prompts: {ci}, {verdict} ({p})."


def _rank_clause(row: dict) -> str:
    """A findings clause on the circuit's rank among its random draws (none where the row predates it)."""
    if "random_rank" not in row:
        return ""
    n = len(row["random_draws"])
    return (
        f"; on {row['random_n_prompts']} of the prompts, {row['random_rank']} of {n} draws are at least as accurate "
        f"as the circuit (rank p = {row['random_p']:.2g}; draws' accuracy 5-95% {row['random_q05']:.2f}-"
        f"{row['random_q95']:.2f})"
    )


def paired_findings(rows: list[dict]) -> str:
    """The paired differences in words (accuracy and each model's own circuit), each as far as its interval goes."""
    from ....report.paired import difference_sentence

    lines = []
    for comparison in dict.fromkeys(r["comparison"] for r in rows):
        mine = [r for r in rows if r["comparison"] == comparison and not r["measure"].startswith("DCM")]
        if mine:
            lines.append(f"- **{comparison}** on the same prompts (paired 95% intervals, Holm within the family): ")
            lines[-1] += "; ".join(difference_sentence(r) for r in mine) + "."
    return "\n".join(lines)


def paired_section(study: "Study", accuracy: dict, matrix: dict, dcm: "StageRecord") -> tuple[str, list[dict]]:
    """Every difference of a fine-tune from the base on the same prompts with its paired interval; the per-prompt
    outcomes behind them written to ``outcomes.json`` (committed with the results)."""
    from ....common.outcomes import write_outcomes
    from ....report.paired import CAPTION, outcome_stages, paired_rows

    stages = outcome_stages(accuracy, matrix, dcm)
    if not stages:
        return (
            "_No per-prompt outcomes in these stage records (made before mechdiff kept them): rerun the stages "
            "for paired intervals._\n",
            [],
        )
    write_outcomes(study.dir, stages)
    margins = study.spec.inference.margins  # the task file's [inference] margins: report-only
    items = _items(study, stages) or {}
    semantic = dcm_test_items(study, dcm) if dcm is not None else {}
    if semantic:  # the DCM test pairs' items, where an imported task's pairs share them
        items["semantic"] = semantic
    rows = paired_rows(stages, study.spec.models.base, study.spec.models.finetunes, items or None, margins)
    return study_table(study, rows, "paired_differences", CAPTION), rows


def _items(study: "Study", stages: dict) -> Optional[dict]:
    """Each paired stage's item ids (eval for accuracy, matrix for the circuit x model matrix), where the study
    knows them and they align with the recorded outcomes; None: one row an item."""
    get = getattr(study, "set_items", None)
    if get is None:
        return None
    out = {}
    for stage, name in (("accuracy", "eval"), ("matrix", "matrix")):
        try:
            ids = np.asarray(get(name))
        except (KeyError, TypeError, ValueError):
            continue
        record = next(iter(stages.get(stage, {}).values()), None) if stage == "accuracy" else None
        if record is None and stage == "matrix":
            record = next((v["full"] for k, v in stages.items() if k.startswith("matrix:")), None)
        n = len(record["correct"]) if record else None
        if n is not None and ids.size >= n:
            out[stage] = ids[:n]
    return out or None


def families_section(study: "Study", paired: list[dict], gain: dict, encoded: dict, controls: dict) -> str:
    """Every test a findings sentence reads, by family, with its adjusted p (docs/inference.md)."""
    rows = paired_family_rows(paired) + family_rows(gain, encoded, controls)
    if not rows:
        return "_No test: no per-prompt outcomes in these stage records._\n"
    caption = (
        "Every claim of the findings as a test in its family (differences between the models; sameness between "
        "the models; circuit against controls; which parts carry the gain; what the heads encode): estimate and "
        "95% interval (sameness: the 90% interval its two one-sided tests read, and its margin, from the task "
        "file's [inference] margins), p, Holm's adjusted p within the family, whether it is shown, the test, rows "
        "and items (docs/inference.md)"
    )
    return study_table(study, rows, "families", caption)
