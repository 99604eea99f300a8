"""What issue #49's "Done when" asks of every committed circuits study, checked on the committed files themselves.

Each property is recomputed from the committed per-row files (``run.json``'s item ids, ``outcomes.json``), not read
back from the report: no two prompt sets share an item; every paired difference whose interval excludes 0 passes
its own test; each family's adjusted p is Holm's step-down of its raw p (recomputed here from its definition); the
headline accuracy of each model equals its count of correct eval rows.
"""

from __future__ import annotations

import csv
import json
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The circuits studies regenerated under the inference rules (results/capitals-smollm2 awaits its regeneration from
#: rows with distinct items: branch capitals-rows).
STUDIES = ["entity-tracking-smollm2", "ioi-smollm2", "capitals-smollm2"]


def _run(study: str) -> dict:
    return json.loads((ROOT / "results" / study / "run.json").read_text())


def _csv(study: str, table: str) -> list[dict]:
    with (ROOT / "results" / study / "tables" / f"{table}.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("study", STUDIES)
def test_no_two_prompt_sets_share_an_item(study):
    sets = _run(study)["prompt_sets"]
    assert not sets["nested"]
    items = {name: set(ids) for name, ids in sets["item_ids"].items()}
    for a, b in combinations(items, 2):
        assert not items[a] & items[b], f"{study}: sets {a} and {b} share items"
    assert sets["shared_items"] == 0


@pytest.mark.parametrize("study", STUDIES)
def test_an_interval_that_excludes_zero_passes_its_test(study):
    for table in ("paired_differences", "families"):
        for row in _csv(study, table):
            low, high = (
                (row["difference_low"], row["difference_high"])
                if "difference_low" in row
                else (row["low"], row["high"])
            )
            if low in ("", "nan") or high in ("", "nan") or row["p"] in ("", "nan"):
                continue
            excludes = float(low) > 0 or float(high) < 0
            point = row.get("difference") or row.get("estimate")
            if excludes and row.get("method", row.get("test", "")).startswith(
                ("McNemar", "sign-flip", "exact", "paired")
            ):
                assert float(row["p"]) < 0.05, f"{study} {table}: {row} excludes 0 at p={row['p']} (point {point})"


def _holm(ps: list[float]) -> list[float]:
    """Holm (1979), literally: the i-th smallest p times (m - i), running maximum, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


@pytest.mark.parametrize("study", STUDIES)
def test_each_familys_adjusted_p_is_holms(study):
    by_family: dict[str, list[dict]] = {}
    for row in _csv(study, "families"):
        by_family.setdefault(row["family"], []).append(row)
    assert by_family, f"{study}: no family of claims"
    for family, rows in by_family.items():
        tested = [r for r in rows if r["p"] not in ("", "nan")]
        for row, adjusted in zip(tested, _holm([float(r["p"]) for r in tested])):
            assert float(row["p_holm"]) == pytest.approx(adjusted, rel=1e-9, abs=1e-12), (family, row["claim"])
            assert (row["shown"] == "True") == (adjusted < 0.05), (family, row["claim"])


@pytest.mark.parametrize("study", STUDIES)
def test_the_headline_accuracy_is_the_count_of_correct_eval_rows(study):
    run = _run(study)
    outcomes = json.loads((ROOT / "results" / study / "outcomes.json").read_text())["stages"]["accuracy"]
    table = {row["model"]: row for row in _csv(study, "accuracy")}
    n_eval = run["prompt_sets"]["sizes"]["eval"]
    for model, outcome in outcomes.items():
        hits = [c == "1" for c in outcome["correct"]]
        assert len(hits) == n_eval
        assert float(table[model]["accuracy"]) == pytest.approx(sum(hits) / n_eval, abs=5e-4), model
