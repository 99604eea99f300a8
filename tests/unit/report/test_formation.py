"""The trajectory's formation account from per-prompt outcomes in the compact format: components on the change
scale (a DCM rate above its floor, CMAP from the first checkpoint's own outcomes), censoring written in every cell,
the order family with Holm's p, and the committed runs restated from their files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from mechdiff.common.outcomes import outcome_record
from mechdiff.report.formation import (
    MODEL,
    RESTATED,
    committed_formation,
    formation,
    formation_rows,
    order_rows,
    restate_formation,
    trajectory_components,
)

RESULTS = Path(__file__).resolve().parents[3] / "results"
STEPS = (0, 1, 2, 4, 8)
NAMES = [f"r@{s}" for s in STEPS]


def nested(shares: list[float], n: int, seed: int) -> np.ndarray:
    rank = np.random.default_rng(seed).permutation(n)
    return np.array([(rank < round(p * n)).astype(float) for p in shares])


def stages() -> dict:
    """A run whose model rises late (50% at step 4), whose circuit tracks it, whose CMAP group carries the gain
    from step 1 (left-censored), and whose DCM rate above its floor is 0 at every step (the floor rises with it)."""
    model = nested([0.1, 0.15, 0.3, 0.6, 0.9], 200, 0)
    kept = nested([0.1, 0.15, 0.3, 0.6, 0.9], 100, 1)
    cmap = nested([0.1, 0.8, 0.85, 0.9, 0.9], 64, 2)
    sem = nested([0.1, 0.2, 0.3, 0.4, 0.5], 48, 3)
    out: dict = {"accuracy": {n: outcome_record(model[i]) for i, n in enumerate(NAMES)}}
    for i, n in enumerate(NAMES):
        out[f"scores:{n}"] = {"full": outcome_record(kept[i]), "final": outcome_record(kept[i])}
        out[f"scores:{n}"]["first trained"] = outcome_record(kept[i])
        out[f"semantic:{n}"] = {"last/io": outcome_record(sem[i])}
        if i:
            out[f"cmap:{n}"] = {"base": outcome_record(cmap[0]), "finetune": outcome_record(cmap[i])}
            out[f"cmap:{n}"]["last/z"] = outcome_record(cmap[i])
    return out, sem.mean(1)


def test_components_on_the_change_scale_with_censoring_and_the_order_family():
    got_stages, floor = stages()
    comps = trajectory_components(got_stages, NAMES, {"last/io": list(floor)}, {"last/io": "L1H0"})
    final, first = "the final checkpoint's circuit (r@8)", "the first trained checkpoint's circuit (r@1)"
    assert list(comps) == [MODEL, final, first, "CMAP last/z", "DCM last io (L1H0)"]
    f = formation(comps, STEPS)
    rows = {r["component"]: r for r in formation_rows(f)}
    dcm = rows["DCM last io (L1H0)"]
    assert dcm["change"] == pytest.approx(0.0, abs=1e-12) and not dcm["formed"] and dcm["step_50%"] is None
    cmap = rows["CMAP last/z"]
    assert cmap["step_50%"] == "at or before step 1" and cmap["step_50%_low"] == "at or before step 1"
    assert rows[MODEL]["step_50%"] == 4 and rows[MODEL]["direction"] == "rise"
    for r in rows.values():  # no cell reads the first checkpoint after 0 as a bare step
        assert all(v != 1 for k, v in r.items() if k.startswith(("step_", "stays_")))
    orders = order_rows(f)
    assert len(orders) == 2 * 6  # four components change (the model, the two circuits, CMAP): 6 pairs, 2 levels
    assert all(r["p_holm"] >= r["p"] for r in orders)
    circuit = [r for r in orders if {r["a"], r["b"]} == {MODEL, final}]
    assert circuit and all(r["ordered"] == "not ordered" for r in circuit)  # it tracks the model
    early = [
        r for r in orders if r["level"] == "50%" and "CMAP last/z" in (r["a"], r["b"]) and MODEL in (r["a"], r["b"])
    ]
    assert early[0]["ordered"] == f"CMAP last/z before {MODEL}"


def test_the_committed_entity_tracking_run_orders_nothing_before_the_model():
    """Restated from the committed outcomes (no model run): on the change scale no component is ordered before the
    model (nor any pair, after Holm), though CMAP last/z reaches 50% at step 10 [10, 15], the model at 12 [10, 20]."""
    f = committed_formation(RESULTS / "trajectory-smollm2")
    rows = {r["component"]: r for r in formation_rows(f)}
    assert (rows["CMAP last/z"]["step_50%"], rows["CMAP last/z"]["step_50%_low"]) == (10, 10)
    assert (rows[MODEL]["step_50%"], rows[MODEL]["step_50%_low"], rows[MODEL]["step_50%_high"]) == (12, 10, 20)
    orders = order_rows(f)
    assert len(orders) == 2 * len(f.formed) * (len(f.formed) - 1) // 2
    assert all(r["ordered"] == "not ordered" for r in orders)


def test_the_committed_ioi_run_times_its_decline(tmp_path: Path):
    """IOI's accuracy falls by step 100: a decline, its loss first at 50% of the final loss at step 30, staying there
    only from step 100 (the loss recovers at 45-80). Restating rewrites the README's section, nothing else."""
    run = tmp_path / "ioi"
    shutil.copytree(RESULTS / "ioi-trajectory-smollm2", run, ignore=shutil.ignore_patterns("*.html", "figures"))
    before = (run / "README.md").read_text()
    restate_formation(run)
    after = (run / "README.md").read_text()
    assert RESTATED in after and "## Findings: structure beyond the within-checkpoint null" in after
    assert after.split("## Findings: structure")[1] == before.split("## Findings: structure")[1]
    rows = {r["component"]: r for r in formation_rows(committed_formation(run))}
    model = rows[MODEL]
    assert model["direction"] == "decline" and model["formed"]
    assert (model["step_50%"], model["stays_50%"]) == (30, 100)
    assert "of its final loss first 30" in after
