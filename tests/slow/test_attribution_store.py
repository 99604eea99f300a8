"""The attributions behind both trajectories' structure tables fit the 20 MB #51 item 3 allows: the committed
stores, and a store simulated at the committed task files' shapes (entity tracking: 17 steps on 32 ranking prompts,
the 5 steps the between-run null reads and the four other runs' 20 checkpoints on 256; IOI: 17 steps on 32) by
`benchmarks/attribution_store.py` (a few CPU minutes) with the pairs' scales spread log-normally at sd 1.0, half the
spread of the committed attributions (2.1 on `smollm2-et@100`'s 256 ranking prompts). With every pair at one scale,
the store's worst case, these shapes take 24.5 MB: over the bound (docs/trajectories.md, "Size")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
RESULTS = Path(__file__).parents[2] / "results"
SPREAD = 1.0
RUNS = {"entity_tracking_trajectory.toml": "trajectory-smollm2", "ioi_trajectory.toml": "ioi-trajectory-smollm2"}


def test_the_committed_stores_fit_the_bound():
    """Both committed trajectories keep their attributions, and together within the bound."""
    from mechdiff.methods.structure import ATTRIBUTIONS, attributions_over_bound

    stores = sorted(RESULTS.glob(f"*/{ATTRIBUTIONS}"))
    assert {p.parent.name for p in stores} == {"trajectory-smollm2", "ioi-trajectory-smollm2"}
    assert attributions_over_bound(RESULTS) is None


@pytest.mark.slow
def test_both_trajectories_attributions_fit_the_bound_at_256_prompts(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("attribution_store", None)
    import attribution_store as bench

    from mechdiff.methods.structure import ATTRIBUTIONS_BOUND, read_attributions

    total = 0
    for task, (_, null) in bench.TASKS.items():
        t = bench.trajectory(task, spread=SPREAD)
        (tmp_path / task).mkdir()
        got = bench.store_size(t, tmp_path / task)
        record, total = got["record"], total + got["size"]
        # the simulation has the committed tables' null on 32 prompts (ET 0.379, IOI 0.458 in the regenerated
        # tables; calibrated to 0.40 and 0.47 before, it lands at 0.368 and 0.464 at this spread)
        committed = json.loads((RESULTS / RUNS[task] / "tables" / "structure_null.json").read_text())
        got_null = np.mean([e["value"] for e in record["null"].values()])
        assert abs(got_null - np.mean([r["null_overlap"] for r in committed])) < 0.03 and abs(got_null - null) < 0.04
        store = read_attributions(tmp_path / task / "store.h5")
        for c, a in store.dense.items():  # the further rows at the pairs the comparison on them selected
            assert np.array_equal(
                a, t["attribution"][c] * np.isin(np.arange(a[0].size), record["dense"]["kept"][c]).reshape(a.shape[1:])
            )
        if task.startswith("entity"):
            # the two blocks a checkpoint against every row at every pair: 0.64 of it at spread 0.5, 0.77 at 1.0
            assert set(store.dense) == set(record["dense"]["kept"]) and got["size"] < 0.8 * got["before"]
    assert total < ATTRIBUTIONS_BOUND
