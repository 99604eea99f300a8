"""The circuits study's CMAP stage planned against one run of it in the committed study's form: every part (z, Q,
K, V and QK, isolated), layer-matched random head sets on a subset of the prompts (a pass of their own), the
base's circuit known: FLOPs against torch's FLOP counter, the models' runs against a count of them."""

from __future__ import annotations

from dataclasses import replace

from mechdiff.circuits.circuit import Circuit
from mechdiff.common.components import parse_heads
from mechdiff.models.devices import Device
from mechdiff.models.footprint import model_dims
from mechdiff.runs.stages import StageRecord
from mechdiff.studies.circuits.spec import default_spec
from mechdiff.studies.circuits.stages import cmap
from mechdiff.studies.circuits.stages.counting import Context
from mechdiff.studies.planner import task_lengths

#: The base's found circuit: ``last`` from layer 1 (patched runs resume there), ``query_label`` from layer 0.
GROUPS = {"last": ["L1H0", "L2H3"], "query_label": ["L0H1", "L2H2"], "query_box": ["L1H1"]}


def test_cmaps_planned_flops_and_runs_in_the_committed_form_are_what_its_run_performs(
    tiny_pair_dirs, tmp_path, monkeypatch
):
    """``[cmap]`` as the committed entity-tracking study sets it (parts z, q, k, v, qk isolated; 20 random head
    sets on 30 of the prompts, cut here to 3 sets on 5 of 12 prompts): the plan's FLOPs within 25% of torch's FLOP
    counter over the stage's computation, and its passes the runs counted on both models."""
    from torch.utils.flop_counter import FlopCounterMode

    import mechdiff.methods.cmap as method
    from mechdiff.studies.circuits.study import CircuitsStudy

    spec = default_spec()
    spec.models.base, spec.models.finetunes = tiny_pair_dirs[0], [tiny_pair_dirs[1]]
    spec.task.n_boxes = 3
    spec.eval.batch_size = 4
    spec.cmap = replace(spec.cmap, n=12, parts=["z", "q", "k", "v", "qk"], groups=["last", "query_label"])
    spec.cmap = replace(spec.cmap, isolate=True, n_random=3, random_prompts=5)
    spec.output.dir, spec.output.store = str(tmp_path / "run"), str(tmp_path / "store.h5")
    study = CircuitsStudy(spec, progress=False)
    base, finetune = spec.models.base, spec.models.finetunes[0]
    circuit = Circuit(base, "entity-tracking", {g: parse_heads(h) for g, h in GROUPS.items()}, {g: g for g in GROUPS})
    record = StageRecord(f"circuit:{base}", "key", {"circuit": circuit.to_dict()}, 0.0, False)
    study.model(base), study.model(finetune)  # loaded before the count
    runs, original = [], method.run

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(method, "run", counted)
    with FlopCounterMode(display=False) as counter:
        result = cmap.compute(study, finetune, record, None)
    assert result["random_prompts"] and len(result["random_prompts"]) == 5
    dims, _ = model_dims(base)
    known = {"circuit": {base: circuit.to_dict()}}
    ctx = Context(spec, dims, task_lengths(spec), "float32", Device("given", 1 << 40, {"float32": 1e9}), known)
    cost = cmap.cost(ctx, finetune)
    ratio = cost.flops / counter.get_total_flops()
    assert 1 / 1.25 <= ratio <= 1.25, ratio
    assert cost.reads.passes == len(runs)
