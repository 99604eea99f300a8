"""The claims of a circuits study's findings as tests in named families (docs/inference.md), built before any
sentence is written so that each sentence reads its family's Holm-adjusted p.

- "which parts carry the gain" (CMAP): each patched scope against the base, against random heads of its layers,
  and V against QK, paired on the same prompts;
- "what the heads encode" (DCM): each selected group's patched target rate against the unpatched floor and
  against random heads, on the same test pairs; paired exactly where the stage kept per-pair outcomes of the
  floor and the random heads (clustered by item where a row gives its pairs' items, ``test_items``), else the exact
  McNemar test at the least favourable pairing the counts allow (a bound on the paired p);
- "roles" (a trajectory's roles by DCM, `mechdiff.studies.trajectory.roles`): the same two tests of each step's
  selection, every step and role adjusted together;
- "differences between the models" lives in `mechdiff.report.paired`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..common import inference as inf
from ..common.outcomes import from_bits
from ..methods.cmap import paired_outcomes
from .families import worst_pairing
from .rows import cmap_items, control_outcomes

GAIN = "which parts carry the gain"
CONTROLS = "circuit against controls"
ENCODES = "what the heads encode"
ROLES = "roles"


def cmap_pairs(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (a, b) comparisons the CMAP table holds and the findings read: every patched (scope, kind) against the
    base and against its random heads, and the whole circuit's V against its QK."""
    outcomes = result.get("outcomes", {})
    pairs = []
    for x in result.get("rows", []):
        if not x["scope"].startswith("random"):
            key = f"{x['scope']}/{x['kind']}"
            pairs.append((key, "base"))
            pairs.append((key, f"random:{key}"))
    pairs.append(("circuit/v", "circuit/qk"))
    return [(a, b) for a, b in pairs if a in outcomes and b in outcomes]


def cmap_family(
    cmap: Mapping[str, Any], items: Optional[Mapping[str, Sequence]] = None
) -> dict[tuple[str, str, str], inf.Test]:
    """Every CMAP comparison of every fine-tune, adjusted together: ``(fine-tune, a, b) -> test`` (``items``: a
    fine-tune's CMAP prompts' items, where several prompts share one; the tests then cluster by item)."""
    fam, keys = inf.Family(GAIN), []
    for ft, rec in cmap.items():
        if rec is None or "skipped" in rec.result:
            continue
        for a, b in cmap_pairs(rec.result):
            x, y = paired_outcomes(rec.result, a, b)  # a random control may run on a subset of the prompts
            on = cmap_items(rec.result, a, b, (items or {}).get(ft))
            fam.add(inf.paired(x, y, on, claim=f"CMAP {ft} into the base: {a} - {b}"))
            keys.append((ft, a, b))
    return dict(zip(keys, fam.adjusted()))


def _bits(row: Mapping[str, Any], key: str) -> Optional[np.ndarray]:
    value = row.get(key)
    if value is None:
        return None
    return from_bits(value["correct"] if isinstance(value, Mapping) else value)


def _against(row: Mapping[str, Any], kind: str, claim: str) -> Optional[inf.Test]:
    """Patched against ``kind`` ("floor" or "random") on the same test pairs."""
    patched, other = _bits(row, "test_outcomes"), control_outcomes(row, kind)
    if patched is not None and other is not None and other.shape == patched.shape:
        items = row.get("test_items")
        return inf.paired(patched, other, None if items is None else list(items), claim=claim)
    est = row.get(kind)
    if not est:
        return None
    n = int(row["test_accuracy"]["n"])
    k, f = round(row["test_accuracy"]["value"] * n), round(est["value"] * n)
    return worst_pairing(k, f, n, claim)


def encodes_family(
    dcm_rows: list[Mapping[str, Any]], family: str = ENCODES, by: Sequence[str] = ("group", "desideratum")
) -> dict[tuple, inf.Test]:
    """Every selected DCM group against its floor and its random heads, adjusted together in ``family``:
    ``(*row[by], "floor" | "random") -> test`` (``by``: the fields naming a row, e.g. the step as well where a
    trajectory tests each step's selection; a row's ``label``, where it has one, names it in the claim)."""
    fam, keys = inf.Family(family), []
    for r in dcm_rows:
        if not r.get("selected"):
            continue
        label = r.get("label") or f"{r['group']}/{r['desideratum']}"
        for kind in ("floor", "random"):
            test = _against(r, kind, f"DCM {label}: patched - {kind}")
            if test is not None:
                fam.add(test)
                keys.append((*(r[k] for k in by), kind))
    return dict(zip(keys, fam.adjusted()))


def encodes(tests: Mapping[tuple, inf.Test], *key: Any) -> bool:
    """Whether a group is shown to encode a desideratum (``key``: as `encodes_family`'s ``by``, e.g. group
    and desideratum): above the floor and above random heads, each surviving Holm in its family (a group with no
    random control needs the floor alone)."""
    floor, random = tests.get((*key, "floor")), tests.get((*key, "random"))
    return all(t is not None and t.rejects and t.interval.value > 0 for t in (floor, random) if t is not None) and (
        floor is not None
    )


def controls_family(matrix_rows: list[Mapping[str, Any]]) -> dict[tuple[str, str], inf.Test]:
    """Each circuit scored with random draws of its size against those draws, by its rank among them on the same
    prompts (accuracy; p = (1 + draws at least as accurate) / (1 + draws)): ``(circuit, model) -> test``, adjusted
    together. The estimate is the circuit's accuracy minus the draws' median; the interval is the draws' 5th-95th
    percentile range moved the same way (a spread of draws, not a confidence interval)."""
    fam, keys = inf.Family(CONTROLS), []
    for r in matrix_rows:
        draws = r.get("random_draws")
        if not draws:
            continue
        d = np.asarray(draws, dtype=float)
        if "random_rank" in r:  # the rank the stage counted on the draws' own prompts
            rank, n = int(r["random_rank"]), int(r.get("random_n_prompts", r["n_prompts"]))
            acc, q05, q95, mid = (
                r.get("random_circuit_accuracy", r["accuracy"]),
                r["random_q05"],
                r["random_q95"],
                r["random_q50"],
            )
        else:  # records whose draws ran on every matrix prompt
            rank, n = int((d >= r["accuracy"] - 1e-12).sum()), int(r["n_prompts"])
            acc, (q05, mid, q95) = r["accuracy"], np.quantile(d, [0.05, 0.5, 0.95])
        acc = float(acc)
        iv = inf.Interval(acc - float(mid), acc - float(q95), acc - float(q05), n, n, "rank among random draws")
        claim = f"circuit of {r['circuit']} in {r['model']}: above {d.size} random circuits of its size"
        fam.add(inf.Test(claim, iv, (1 + rank) / (1 + d.size), f"rank among {d.size} draws on {n} prompts"))
        keys.append((r["circuit"], r["model"]))
    return dict(zip(keys, fam.adjusted()))


def family_rows(*families: Mapping[Any, inf.Test]) -> list[dict]:
    """One table row per test of the given families."""
    return [t.row() for fam in families for t in fam.values()]
