"""The resource planner's per-stage FLOPs (mechdiff.studies.planner) against torch's FLOP counter over each stage
of a real tiny study, the planner told what the run found (its circuits, scan steps, pruning's searches)."""

from __future__ import annotations

import pytest
import torch.utils.flop_counter

from mechdiff.models.devices import Device
from mechdiff.runs import stages as stage_module
from mechdiff.studies.circuits.stages.plan import found_in, resource_plan
from mechdiff.studies.circuits.study import CircuitsStudy

#: How far a stage's planned FLOPs may lie from those counted: the plan counts every prompt at the mean token
#: length and a suffix run from a class's mean first position (the run: each batch from its own), so it is not exact.
WITHIN = 1.25


@pytest.fixture(scope="module")
def counted(tiny_family, tmp_path_factory, monkeypatch_module) -> tuple:
    """The tiny study run once with each stage's matrix-multiply FLOPs counted: (spec, stage -> FLOPs)."""
    from test_study import tiny_spec

    flops: dict[str, int] = {}
    original = stage_module.StageCache.run

    def counting(self, name, inputs, compute):
        def wrapped():
            with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
                result = compute()
            flops[name] = counter.get_total_flops()
            return result

        return original(self, name, inputs, wrapped)

    monkeypatch_module.setattr(stage_module.StageCache, "run", counting)
    spec = tiny_spec(tiny_family, tmp_path_factory.mktemp("counted"))
    study = CircuitsStudy(spec, progress=False)
    for name in spec.model_names:
        study.model(name)  # loaded before any stage, so that no stage counts a load
    study.stages()  # every stage, as `run` computes them (not its report: no stage, nothing counted or planned)
    return spec, flops


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_each_stages_planned_flops_are_those_its_run_performs(counted):
    spec, flops = counted
    here = Device("given", 1 << 40, {"float32": 1e9}, False)
    planned = {p.cost.stage: p.cost.flops for p in resource_plan(spec, here, known=found_in(spec.output.dir))}
    assert set(planned) == set(flops)
    ratios = {stage: planned[stage] / flops[stage] for stage in flops}
    shown = "; ".join(f"{s.split(':')[0]} {s.rsplit('/', 1)[-1]}: {r:.3f}" for s, r in ratios.items())
    assert all(1 / WITHIN <= r <= WITHIN for r in ratios.values()), shown


@pytest.mark.parametrize("mode", ["memory", "recompute"])
def test_dcm_planned_flops_in_each_cache_mode_are_those_its_run_performs(counted, mode):
    """DCM run again with its pair cache in host memory (full patched runs) and recomputed (the sources again for
    every batch): the plan of the mode the run records counts its FLOPs (the file mode: above)."""
    from dataclasses import replace
    from pathlib import Path

    spec, flops = counted
    spec = replace(spec, dcm=replace(spec.dcm, cache=mode))
    (Path(spec.output.dir) / "stages" / "dcm.json").unlink()
    study = CircuitsStudy(spec, progress=False)
    for name in spec.model_names:
        study.model(name)
    study.stages()  # every other stage from the cache: the mode is not in DCM's key
    known = found_in(spec.output.dir)
    assert known["dcm_cache"] == {spec.models.base: mode}
    here = Device("given", 1 << 40, {"float32": 1e9}, False)
    planned = {p.cost.stage: p.cost.flops for p in resource_plan(spec, here, known=known)}
    assert 1 / WITHIN <= planned["dcm"] / flops["dcm"] <= WITHIN, planned["dcm"] / flops["dcm"]
