"""The rows of each table that both a command and a study write: one function per measurement, so the
standalone commands (``mechdiff dcm``, ``cmap``, ``compare``, ``score``, ``curve``, ``positions``) and the circuits
study's report (``mechdiff run``) name its columns one way.

Each function reads the records a stage keeps (the ``to_dict`` forms: `mechdiff.methods.dcm.DCMResult.to_dict`,
`mechdiff.methods.cmap.CMAPResult.to_dict`; the scan, curve, matrix and completeness results as JSON), so a
command passes what it computed and the study what its stage record holds. The columns are the study's (the
trajectory study keys a stage on ``accuracy_low`` and ``floor_high`` of the DCM table); where the study's table
holds every model it adds a ``model`` column in front."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.metrics import continuous_key, continuous_label
from ..common.outcomes import from_bits
from ..methods.cmap import paired_outcomes
from .tables import estimate_columns


def dcm_rows(results: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One row per (group, desideratum) of DCM results (``DCMResult.to_dict``): the selected heads, the target
    accuracy on the test pairs, the no-intervention floor and random heads of the same size (where drawn)."""
    rows = []
    for r in results:
        row = {
            "group": r["group"],
            "desideratum": r["desideratum"],
            "position": r["position"],
            "n_heads": len(r["heads"]),
            "selected": " ".join(r["selected"]) or "-",
        }
        row.update(estimate_columns("accuracy", r["test_accuracy"]))
        row.update(estimate_columns("floor", r["floor"]))
        if r.get("random"):
            row.update(estimate_columns("random", r["random"]))
        rows.append(row)
    return rows


def control_outcomes(record: Mapping[str, Any], control: str) -> Optional[np.ndarray]:
    """A DCM selection's per-pair outcome under ``control``: the unpatched floor's 0/1 (``"floor"``) or the random
    draws' per-pair share (``"random"``), from the ``floor_outcomes``/``random_outcomes`` the stage kept (None:
    not kept)."""
    if control == "floor" and record.get("floor_outcomes"):
        return from_bits(record["floor_outcomes"])
    if control == "random" and record.get("random_outcomes"):
        return np.mean([from_bits(d) for d in record["random_outcomes"]], axis=0)
    return None


def semantic_test(record: Mapping[str, Any], control: str, items: Sequence) -> Optional[dict]:
    """The patched heads against ``control`` ("floor" or "random") on the same test pairs, clustered by the pairs'
    ``items`` (`inf.paired`), as the ``vs_floor``/``vs_random`` record the stage wrote with one pair an item."""
    outcomes = record.get("outcomes") or {}
    other = control_outcomes(record, control)
    if "correct" not in outcomes or other is None:
        return None
    patched = from_bits(outcomes["correct"])
    if other.shape != patched.shape or len(items) != patched.size:
        return None
    test = inf.paired(patched, other, list(items))
    return {"estimate": test.interval.value, "low": test.interval.low, "high": test.interval.high, "p": test.p}


def semantic_rows(records: Sequence[Mapping[str, Any]], items: Optional[Mapping[str, Sequence]] = None) -> list[dict]:
    """One row per (group, desideratum, model) of semantic patching (``{"group", "desideratum", "heads"} |
    SemanticResult.to_dict()``): the heads patched, target accuracy, the unpatched floor and (where drawn) random
    heads of the selection's layers and position, and the paired tests of the patched heads against each
    (``vs_floor``: exact McNemar; ``vs_random``: the sign-flip test against the per-pair share of draws; both
    clustered by item where ``items`` gives a ``group/desideratum``'s test pairs' items: `semantic_test`)."""
    rows = []
    for s in records:
        on = (items or {}).get(f"{s['group']}/{s['desideratum']}")
        row = {
            "group": s["group"],
            "desideratum": s["desideratum"],
            "model": s["model"],
            "heads": " ".join(s["heads"]),
            **estimate_columns("accuracy", s["accuracy"]),
            **estimate_columns("floor", s["floor"]),
        }
        if s.get("random"):
            row.update(estimate_columns("random", s["random"]))
        for control in ("floor", "random"):
            test = (semantic_test(s, control, on) if on is not None else None) or s.get(f"vs_{control}")
            if test:
                row[f"minus_{control}"] = test["estimate"]
                row[f"minus_{control}_low"], row[f"minus_{control}_high"] = test["low"], test["high"]
                row[f"{control}_p"] = test["p"]
        rows.append(row)
    return rows


def cmap_has_gap(result: Mapping[str, Any]) -> bool:
    """Whether the fine-tune is above the base on the CMAP prompts beyond both CIs (``CMAPResult.to_dict``)."""
    return (
        inf.Interval.from_dict(result["finetune_accuracy"]).low > inf.Interval.from_dict(result["base_accuracy"]).high
    )


def cmap_rows(result: Mapping[str, Any]) -> list[dict]:
    """One row per (scope, kind), the random controls after: accuracy, the logit difference where the task's metric
    is it, and, only where the fine-tune is above the base beyond both CIs (`cmap_has_gap`), the recovered
    share of the gap."""
    gap = cmap_has_gap(result)  # a share of the gap means nothing when there is no gap
    return [
        {
            "scope": row["scope"],
            "kind": row["kind"],
            **estimate_columns("accuracy", row["accuracy"]),
            **(estimate_columns("logit_diff", row["logit_diff"]) if "logit_diff" in row else {}),
            **({"recovered": row["recovered"]} if gap else {}),
        }
        for row in result["rows"] + result.get("random_rows", [])
    ]


def cmap_caption(result: Mapping[str, Any], finetune: str) -> str:
    """The caption of `cmap_rows`: both models' accuracy, what ``recovered`` is, the result's own caption."""
    share = (
        "recovered = (patched - base)/(fine-tune - base)"
        if cmap_has_gap(result)
        else "no recovered share: the fine-tune is not above the base beyond their CIs"
    )
    diff = (
        f"; logit difference (the task's metric: the answer's summed log-probability minus the mean of its "
        f"alternatives', bootstrap CI) base {inf.Interval.from_dict(result['base_logit_diff'])}, fine-tune "
        f"{inf.Interval.from_dict(result['finetune_logit_diff'])}"
        if "base_logit_diff" in result
        else ""
    )
    base, ft = (inf.Interval.from_dict(result[f"{m}_accuracy"]) for m in ("base", "finetune"))
    return (
        f"CMAP {finetune} -> {result['base']}: base accuracy {base}, fine-tune {ft}{diff}; {share}. {result['caption']}"
    )


def cmap_paired_rows(result: Mapping[str, Any], items: Optional[Sequence] = None) -> list[dict]:
    """Each (scope, kind) against the plain base and against its random control; V - QK and Q - K per scope:
    paired tests of accuracy on the same prompts (`paired`: exact McNemar for two
    0/1 outcomes, the sign-flip test against a random control's per-prompt share of draws; clustered by item where
    ``items``, one per CMAP prompt, has prompts sharing one), each with its p."""
    outcomes, rows = result.get("outcomes", {}), []

    def add(a: str, b: str) -> None:
        if a in outcomes and b in outcomes:
            on = cmap_items(result, a, b, items)
            test = inf.paired(*paired_outcomes(result, a, b), on)
            iv = test.interval
            row = {"first": a, "second": b, "difference": iv.value, "difference_low": iv.low}
            rows.append({**row, "difference_high": iv.high, "p": test.p, "method": test.method})

    for row in result["rows"]:
        key = f"{row['scope']}/{row['kind']}"
        add(key, "base")
        add(key, f"random:{key}")
    for scope in dict.fromkeys(row["scope"] for row in result["rows"]):
        add(f"{scope}/v", f"{scope}/qk")
        add(f"{scope}/q", f"{scope}/k")
    return rows


def cmap_items(result: Mapping[str, Any], a: str, b: str, items: Optional[Sequence]) -> Optional[list]:
    """The items of the prompts `paired_outcomes` pairs ``a`` and ``b`` on (None: one prompt an item)."""
    if items is None:
        return None
    outcomes, on, listed = result["outcomes"], result.get("random_prompts") or [], list(items)
    if len(outcomes[a]) != len(outcomes[b]) and on:
        return [listed[i] for i in on]
    return listed[: len(outcomes[a])]


def cmap_paired_caption(result: Mapping[str, Any], finetune: str) -> str:
    """The caption of `cmap_paired_rows`."""
    return (
        f"CMAP {finetune} -> {result['base']}: paired differences of accuracy on the same prompts (exact McNemar "
        "test with its exact-hulled interval; against a random control, the sign-flip test on the per-prompt share "
        "of its draws; docs/inference.md); a part is larger than another only where its test rejects (p <= 0.05)"
    )


def scan_rows(scan: Mapping[str, Any]) -> list[dict]:
    """One row per greedy step of a position scan: the class added and the kept set's accuracy and faithfulness."""
    return [
        {
            "step": i + 1,
            "added": s["added"],
            **estimate_columns("accuracy", s["accuracy"]),
            **estimate_columns("faithfulness", s["faithfulness"]),
            **estimate_columns(continuous_key(s), s[continuous_key(s)]),
        }
        for i, s in enumerate(scan["steps"])
    ]


def curve_caption(model: str, curve: Mapping[str, Any]) -> str:
    """The caption of ``mechdiff curve``'s table: the model and the curve's areas (CPR, CMD) of its continuous
    metric (named where it is the logit difference)."""
    if "cpr_logit_diff" in curve:
        areas = f"CPR (logit difference) {curve['cpr_logit_diff']}, CMD (logit difference) {curve['cmd_logit_diff']}"
        return (
            f"Faithfulness of nested circuits over (head, position class) pairs on {model} (ranked by mean-ablation "
            f"attribution of the logit difference; {areas}){metric_note(curve['rows'][0])}"
        )
    return (
        f"Faithfulness of nested circuits over (head, position class) pairs on {model} (ranked by mean-ablation "
        f"attribution; CPR {curve['cpr_prob']}, CMD {curve['cmd_prob']})"
    )


def metric_note(record: Mapping[str, Any]) -> str:
    """A caption's words on the continuous faithfulness column of ``record`` where it is not the answer
    probability (``""`` for a ``prob`` task, so its captions read as before)."""
    key = continuous_key(record)
    if key == "faithfulness_prob":
        return ""
    return (
        f"; {key}: faithfulness ({continuous_label(record)}: the answer's summed log-probability minus the mean of "
        "its alternatives')"
    )


def curve_rows(curve: Mapping[str, Any]) -> list[dict]:
    """One row per size of a faithfulness curve: the fraction of pairs, the pairs kept, accuracy and faithfulness
    (accuracy and the task's continuous metric: answer probability or logit difference)."""
    return [
        {
            "fraction": r["fraction"],
            "n_pairs": r["n_pairs"],
            **estimate_columns("accuracy", r["accuracy"]),
            **estimate_columns("faithfulness", r["faithfulness"]),
            **estimate_columns(continuous_key(r), r[continuous_key(r)]),
        }
        for r in curve["rows"]
    ]


#: The columns of `circuit_x_model_rows` (each with its ``_low`` and ``_high``).
CIRCUIT_X_MODEL = (
    "circuit",
    "model",
    "n_pairs",
    "full_accuracy",
    "accuracy",
    "faithfulness",
    "random_accuracy",
    "random_faithfulness",
    "random_n_prompts",
    "random_rank",
    "random_p",
    "random_q05",
    "random_q50",
    "random_q95",
)


def circuit_x_model_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The circuit x model table from `mechdiff.circuits.measures.matrix_rows`: the columns of
    `CIRCUIT_X_MODEL` and, where random circuits were drawn, the range of their accuracies (the circuit's rank
    among them, its p and their quantiles are on their ``random_n_prompts`` prompts)."""
    shown = []
    for r in rows:
        row = {k: v for k, v in r.items() if k.split("_low")[0].split("_high")[0] in CIRCUIT_X_MODEL}
        if r.get("random_draws"):
            row["random_draws_min_max"] = f"{min(r['random_draws']):.3f}-{max(r['random_draws']):.3f}"
        shown.append(row)
    return shown


def completeness_rows(completeness: Mapping[str, Optional[Mapping[str, Any]]]) -> list[dict]:
    """One row per model of `mechdiff.circuits.measures.completeness` results (``{model: result}``; a model
    without one is left out): random K's mean and std over the draws (where drawn), then each group's."""
    rows = []
    for name, comp in completeness.items():
        if not comp:
            continue
        row = {"model": name}
        if "random" in comp:
            row.update({"random K mean": comp["random"]["mean"], "random K std": comp["random"]["std"]})
        row.update(
            {f"group {g}": "n/a" if v["completeness"] is None else v["completeness"] for g, v in comp["groups"].items()}
        )
        rows.append(row)
    return rows
