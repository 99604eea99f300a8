"""The trajectory's edge stages (``[edges]``) on tiny full-weight checkpoints: each checkpoint's per-prompt edge
scores and the comparison are stage records; a run that adds a step reuses the scores it has and equals a run made
from nothing; two identical checkpoints differ by exactly 0 beyond the null; off by default, with no stage; bad
settings refused with their line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny, save_wide_run

from mechdiff.methods.edge_structure import decode_half
from mechdiff.studies.spec import SpecError
from mechdiff.studies.trajectory.settings import load_settings
from mechdiff.studies.trajectory.study import TrajectoryStudy


@pytest.fixture(scope="module")
def run(smollm2_tokenizer, tmp_path_factory) -> Path:
    """Full-weight tiny llamas at steps 0, 5 (the same weights as step 0) and 10 (other weights)."""
    root = tmp_path_factory.mktemp("edges") / "run"
    for seed, step in ((0, 0), (2, 10)):
        lm = make_tiny("llama", smollm2_tokenizer, seed=seed, n_layers=2)
        lm.model.save_pretrained(root / f"step-{step:04d}")
        smollm2_tokenizer.save_pretrained(root / f"step-{step:04d}")
    shutil.copytree(root / "step-0000", root / "step-0005")
    return root


def task_file(path: Path, run: Path, out: Path, edges: str) -> Path:
    path.write_text(
        f"""[study]
kind = "trajectory"
[task]
name = "entity-tracking"
n_boxes = 3
[models]
checkpoints = ["{run}@0", "{run}@5", "{run}@10"]
[eval]
batch_size = 4
[discovery]
n = 8
runs_n = 8
[scoring]
reference_n = 12
[structure]
draws = 10
resamples = 20
resample_splits = 2
[edges]
{edges}
[output]
dir = "{out}"
store = "{out}/activations.h5"
"""
    )
    return path


def edge_stages(study: TrajectoryStudy) -> tuple[dict, object]:
    scored = {n: study.edge_scores(n) for n in study.edge_checkpoints()}
    return scored, study.edges(scored)


def study_of(tmp_path: Path, run: Path, out: Path, edges: str) -> TrajectoryStudy:
    return TrajectoryStudy(load_settings(task_file(tmp_path / "t.toml", run, out, edges)), progress=False)


def test_a_step_added_reuses_the_cached_scores_and_equals_a_run_from_nothing(run, tmp_path):
    names = [f"{run}@{s}" for s in (0, 5, 10)]
    on = "on = true\nn = 12\nbatch_size = 4\n"
    first = study_of(tmp_path, run, tmp_path / "a", on + "steps = [0]\n")  # step 0 and the final
    assert first.edge_checkpoints() == [names[0], names[2]]
    before, _ = edge_stages(first)
    grown = study_of(tmp_path, run, tmp_path / "a", on + "steps = [0, 5]\n")
    scored, rec = edge_stages(grown)
    assert [scored[n].cached for n in names] == [True, False, True] and not rec.cached
    assert all(scored[n].key == before[n].key for n in before)
    fresh = study_of(tmp_path, run, tmp_path / "b", on + "steps = [0, 5]\n")
    again, full = edge_stages(fresh)
    assert not any(r.cached for r in again.values())
    assert json.dumps(full.result, sort_keys=True) == json.dumps(rec.result, sort_keys=True)
    cached = study_of(tmp_path, run, tmp_path / "b", on + "steps = [0, 5]\n")
    scored_again, rec_again = edge_stages(cached)
    assert rec_again.cached and all(r.cached for r in scored_again.values()) and cached._checkpoints is None
    # the scores: every ranking prompt (the structure stage's first rows), every edge, the node ranking's metric
    x = decode_half(scored[names[0]].result["scores"])
    assert x.shape == (8, rec.result["graph"]["n_edges"]) and scored[names[0]].result["metric"] == "prob"
    assert np.array_equal(x, decode_half(scored[names[1]].result["scores"]))  # the same weights
    # identical checkpoints (steps 0 and 5): the same top-n on every half, so (null - cross) is 0 on every split
    same = rec.result["consecutive"][0]
    for kind in ("edges", "nodes"):
        d = same[kind]["null_minus_cross"]
        assert d["value"] == d["low"] == d["high"] == 0.0 and same[kind]["cross"] == rec.result["null"][names[0]][kind]
    assert rec.result["top"][names[0]] == rec.result["top"][names[1]] != rec.result["top"][names[2]]


def test_off_by_default_with_no_stage_and_bad_settings_refused_with_their_line(run, tmp_path):
    study = study_of(tmp_path, run, tmp_path / "c", "")
    assert study.st.edges.on is False and study.edge_checkpoints() == []
    for bad, what in (("steps = [7]", "steps must be steps of the trajectory"), ("n = 0", "n must be at least 1")):
        path = task_file(tmp_path / "bad.toml", run, tmp_path / "c", f"on = true\n{bad}\n")
        line = next(i for i, x in enumerate(path.read_text().splitlines(), 1) if x == bad)
        with pytest.raises(SpecError, match=rf"bad.toml:{line}: \[edges\] {what}"):
            load_settings(path)
    path = task_file(tmp_path / "bad.toml", run, tmp_path / "c", 'method = "acdc"\n')
    with pytest.raises(SpecError, match="acdc"):
        load_settings(path)


def test_a_whole_study_with_edges_on_writes_node_overlap_beside_edge_overlap(run, tmp_path):
    """Every stage of a tiny trajectory with ``[edges]`` on (steps 0 and 10: the final always scored), then the
    report: the edge stages in the manifest, the section and its table, the README paragraph and settings line."""
    labels = tmp_path / "dcm.json"
    row = {"group": "last", "desideratum": "positional", "position": "last", "selected": "L1H0"}
    labels.write_text(json.dumps([row]))
    out = tmp_path / "whole"
    path = task_file(tmp_path / "t.toml", run, out, "on = true\nn = 12\nsteps = [0]\n")
    text = path.read_text().replace(
        "[structure]",
        f'[dcm]\nlabels = "{labels}"\ndesiderata = ["positional"]\ngroups = ["last"]\nn_test = 8\n'
        '[cmap]\nn = 8\ngroups = ["last"]\n[structure]',
    )
    text = text.replace("[discovery]\n", "[discovery]\nsizes = [0.2, 1.0]\ncurve_n = 8\nstability_draws = 10\n")
    text = text.replace("[scoring]\n", "[scoring]\nn = 8\n")
    path.write_text(text.replace("batch_size = 4\n[discovery]", "n = 8\nbatch_size = 4\n[discovery]", 1))
    study = TrajectoryStudy(load_settings(path), progress=False)
    study.run()
    stages = json.loads((out / "run.json").read_text())["stages"]
    assert {f"edges:{run}@0", f"edges:{run}@10", "edges"} <= set(stages) and f"edges:{run}@5" not in stages
    rows = json.loads((out / "tables" / "edges_nodes.json").read_text())
    assert [(r["against"], r["from_step"], r["to_step"]) for r in rows] == [("next", 0, 10), ("final", 0, 10)]
    assert "## Edges beside nodes" in (out / "report.md").read_text()
    readme = (out / "README.md").read_text()
    assert "## Findings: edges beside nodes" in readme and "edges: steps; top-n edges; method; prompts" in readme


@pytest.fixture(scope="module")
def wide_run(smollm2_tokenizer, tmp_path_factory) -> Path:
    """Full-weight random llamas at steps 0, 5 (step 0's weights) and 10 whose blocks outweigh the read-out (4
    layers of width 128), so that the edge graph's passes, not the unembedding, decide what the edge stage costs."""
    return save_wide_run(tmp_path_factory.mktemp("wide") / "run", smollm2_tokenizer)


def test_the_edge_stages_planned_flops_memory_and_passes_are_what_its_run_performs(wide_run, tmp_path, monkeypatch):
    """``edges:<ckpt>`` (the reference means' edge forwards, then EAP's forward and backward a batch over the ranking
    prompts) planned from the task file alone against one run of it in the checkpoint: its FLOPs within 25% of
    torch's FLOP counter, its models' passes exactly (a hook on the model's forward), and its bytes beside the
    weights (kept and its largest batch's) within 25% of the most torch allocated at once. The ranking scorer's
    means are read from the store, as the circuit stage leaves them there."""
    from torch.utils.flop_counter import FlopCounterMode

    from mechdiff.models.devices import Device
    from mechdiff.models.memory import torch_peak
    from mechdiff.studies.trajectory.stages.edges import EdgeScoresStage

    on = "on = true\nsteps = [0]\nbatch_size = 4\n"
    path = task_file(tmp_path / "t.toml", wide_run, tmp_path / "out", on)
    study = TrajectoryStudy(load_settings(path), progress=False)
    name = study.final
    model = study.checkpoints().model(name)
    study.scorer(name, "ranking", EdgeScoresStage(study).prompts())  # the circuit stage's means, in the store
    passes = []
    handle = model.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        with FlopCounterMode(display=False) as counter:
            EdgeScoresStage(study).compute(name)
    finally:
        handle.remove()
    measured = torch_peak(lambda: EdgeScoresStage(study).compute(name))
    inputs = TrajectoryStudy.plan_inputs(path)
    costs = {c.stage: c for c in TrajectoryStudy.stage_costs(inputs, Device("given", 1 << 40, {"float32": 1e9}))}
    cost = costs[f"edges:{name}"]
    assert {f"edges:{c}" for c in study.edge_checkpoints()} | {"edges"} <= set(costs)
    assert 1 / 1.25 <= cost.flops / counter.get_total_flops() <= 1.25, cost.flops / counter.get_total_flops()
    assert cost.reads.passes == len(passes) == 12 / 4 + 8 / 4  # reference_n, then discovery n, in batches of 4
    assert measured == pytest.approx(cost.kept + cost.transient, rel=0.25)
