"""The rows of each table that both a command and a study write: one function per measurement, so
``mechdiff dcm`` and ``mechdiff run`` (and the other commands beside it) name its columns one way.

Each function reads the records a stage keeps (the ``to_dict`` forms: :meth:`mechdiff.methods.dcm.DCMResult.to_dict`,
:meth:`mechdiff.methods.cmap.CMAPResult.to_dict`, the scan, curve and matrix results as JSON), so a command
passes what it computed and the study what its stage record holds. The columns are the study's (the trajectory
study keys a stage on ``accuracy_low`` and ``floor_high`` of the DCM table)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..common.stats import Estimate, paired_difference
from .tables import estimate_columns


def _est(d: Mapping[str, Any]) -> Estimate:
    return Estimate(d["value"], d["low"], d["high"], d["n"])


def dcm_rows(results: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One row per (group, desideratum) of DCM results (``DCMResult.to_dict``): the selected heads, the target
    accuracy on the test pairs, the no-intervention floor and random heads of the same size (where drawn)."""
    rows = []
    for r in results:
        row = {"group": r["group"], "desideratum": r["desideratum"], "position": r["position"],
               "n_heads": len(r["heads"]), "selected": " ".join(r["selected"]) or "-"}
        row.update(estimate_columns("accuracy", r["test_accuracy"]))
        row.update(estimate_columns("floor", r["floor"]))
        if r.get("random"):
            row.update(estimate_columns("random", r["random"]))
        rows.append(row)
    return rows


def semantic_rows(records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One row per (group, desideratum, model) of semantic patching (``{"group", "desideratum", "heads"} |
    SemanticResult.to_dict()``): the heads patched, target accuracy and the unpatched floor."""
    return [{"group": s["group"], "desideratum": s["desideratum"], "model": s["model"], "heads": " ".join(s["heads"]),
             **estimate_columns("accuracy", s["accuracy"]), **estimate_columns("floor", s["floor"])}
            for s in records]


def cmap_has_gap(result: Mapping[str, Any]) -> bool:
    """Whether the fine-tune is above the base on the CMAP prompts beyond both CIs (``CMAPResult.to_dict``)."""
    return _est(result["finetune_accuracy"]).low > _est(result["base_accuracy"]).high


def cmap_rows(result: Mapping[str, Any]) -> list[dict]:
    """One row per (scope, kind), the random controls after: accuracy and, only where the fine-tune is above the
    base beyond both CIs (:func:`cmap_has_gap`), the recovered share of the gap."""
    gap = cmap_has_gap(result)  # a share of the gap means nothing when there is no gap
    return [{"scope": row["scope"], "kind": row["kind"], **estimate_columns("accuracy", row["accuracy"]),
             **({"recovered": row["recovered"]} if gap else {})}
            for row in result["rows"] + result.get("random_rows", [])]


def cmap_caption(result: Mapping[str, Any], finetune: str) -> str:
    """The caption of :func:`cmap_rows`: both models' accuracy, what ``recovered`` is, the result's own caption."""
    share = ("recovered = (patched - base)/(fine-tune - base)" if cmap_has_gap(result) else
             "no recovered share: the fine-tune is not above the base beyond their CIs")
    return (f"CMAP {finetune} -> {result['base']}: base accuracy {_est(result['base_accuracy'])}, fine-tune "
            f"{_est(result['finetune_accuracy'])}; {share}. {result['caption']}")


def cmap_paired_rows(result: Mapping[str, Any]) -> list[dict]:
    """Each (scope, kind) against the plain base and against its random control; V - QK and Q - K per scope:
    paired differences of accuracy on the same prompts."""
    outcomes, rows = result.get("outcomes", {}), []

    def add(a: str, b: str) -> None:
        if a in outcomes and b in outcomes:
            rows.append({"first": a, "second": b,
                         **estimate_columns("difference", paired_difference(outcomes[a], outcomes[b]))})

    for row in result["rows"]:
        key = f"{row['scope']}/{row['kind']}"
        add(key, "base")
        add(key, f"random:{key}")
    for scope in dict.fromkeys(row["scope"] for row in result["rows"]):
        add(f"{scope}/v", f"{scope}/qk")
        add(f"{scope}/q", f"{scope}/k")
    return rows


def cmap_paired_caption(result: Mapping[str, Any], finetune: str) -> str:
    """The caption of :func:`cmap_paired_rows`."""
    return (f"CMAP {finetune} -> {result['base']}: paired differences of accuracy on the same prompts (paired "
            "bootstrap CI); a part is larger than another only where the interval excludes 0")
