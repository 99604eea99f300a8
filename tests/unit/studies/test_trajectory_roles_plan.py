"""The trajectory's roles by DCM (``[roles] method = "dcm"``) planned from the task file and the run's circuits
against one run of the stage in a checkpoint of random full-weight llamas: FLOPs against torch's FLOP counter,
the model runs (forward, and backward for a training step) against a count of the pair cache's runs, memory
against the most torch allocated at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_wide_run

from mechdiff.circuits.circuit import Circuit
from mechdiff.common.components import parse_heads
from mechdiff.models.devices import Device
from mechdiff.runs.stages import StageRecord
from mechdiff.studies.trajectory.settings import load_settings
from mechdiff.studies.trajectory.stages.circuit import trajectory_found
from mechdiff.studies.trajectory.stages.roles import RolesStage
from mechdiff.studies.trajectory.study import TrajectoryStudy

#: Each checkpoint's circuit (step -> group -> heads): the union a group's candidates are drawn from, its lowest
#: layer (1 in ``last``, where patched runs resume; 0 in ``query_label``) only in the checkpoints before the final.
CIRCUITS = {
    0: {"last": ["L1H0"], "query_label": ["L0H1"]},
    5: {"last": ["L2H3"], "query_label": ["L2H0"]},
    10: {"last": ["L2H1", "L3H2"], "query_label": ["L1H3", "L3H0"]},
}


@pytest.fixture(scope="module")
def wide_run(smollm2_tokenizer, tmp_path_factory) -> Path:
    """Full-weight random llamas at steps 0, 5 (step 0's weights) and 10 whose blocks outweigh a tiny model's (4
    layers of width 128), so that the blocks DCM's suffix runs skip or compute weigh beside the read-out."""
    return save_wide_run(tmp_path_factory.mktemp("wide-roles") / "run", smollm2_tokenizer)


def task_file(path: Path, run: Path, out: Path) -> Path:
    """Roles by DCM at the final step over ``last`` and ``query_label``, two seeds of 2 epochs over 8 training
    pairs in steps of 4 (4 steps, validated after every second), 3 random head sets; the learning rate high
    enough that a mask selects heads from its first step on (so that every validation and test runs)."""
    path.write_text(
        f"""[study]
kind = "trajectory"
[task]
name = "entity-tracking"
n_boxes = 3
[models]
checkpoints = ["{run}@0", "{run}@5", "{run}@10"]
[eval]
batch_size = 5
[dcm]
desiderata = ["positional"]
groups = ["last", "query_label"]
n_train = 8
n_val = 4
n_test = 7
epochs = 2
batch_size = 4
eval_every = 2
lr = 1.0
[roles]
method = "dcm"
steps = [10]
desiderata = ["positional", "object_value"]
lam = 0.00001
seeds = 2
votes = 1
n_random = 3
[output]
dir = "{out}"
store = "{out}/activations.h5"
"""
    )
    return path


def circuit_records(study: TrajectoryStudy, stages: Path) -> dict[str, StageRecord]:
    """`CIRCUITS` as the checkpoints' circuit records, also written where `trajectory_found` reads a run's."""
    out = {}
    for name, step in zip(study.names, (0, 5, 10)):
        groups = CIRCUITS[step]
        circuit = Circuit(
            name, "entity-tracking", {g: parse_heads(hs) for g, hs in groups.items()}, {g: g for g in groups}
        )
        out[name] = StageRecord(f"circuit:{name}", f"key{step}", {"circuit": circuit.to_dict()}, 0.0, False)
        rec = {"name": f"circuit:{name}", "result": {"circuit": circuit.to_dict()}}
        (stages / f"circuit-{step}.json").write_text(json.dumps(rec))
    return out


def test_roles_by_dcm_planned_flops_and_runs_are_what_its_run_performs(wide_run, tmp_path, monkeypatch):
    """``roles:<ckpt>`` with ``method = "dcm"`` planned from the task file and the run's circuits (the candidates'
    lowest layer in each group) against one run of the stage: its FLOPs within 25% of torch's FLOP counter, its
    model runs exactly (each run of the pair cache, a training step's backward counted as one more: the plan's
    passes) and its bytes beside the weights within 25% of the most torch allocated at once. Both count every
    seed's training and validation, the selection's and the random head sets' tests and one pair cache a
    desideratum (main's plan counted two runs of ``[roles] n`` pairs: 0.26 of the FLOPs, 20 of 128 runs)."""
    from torch.utils.flop_counter import FlopCounterMode

    import mechdiff.methods.dcm_cache as dcm_cache
    from mechdiff.models.memory import torch_peak

    path = task_file(tmp_path / "t.toml", wide_run, tmp_path / "out")
    study = TrajectoryStudy(load_settings(path), progress=False)
    stages = tmp_path / "run" / "stages"
    stages.mkdir(parents=True)
    circuits = circuit_records(study, stages)
    name = study.final
    study.checkpoints().model(name)  # loaded before the count
    runs, found, original = [], [], dcm_cache.run

    def counted(*args, **kwargs):
        runs.append(2 if kwargs.get("grad") else 1)
        return original(*args, **kwargs)

    monkeypatch.setattr(dcm_cache, "run", counted)
    with FlopCounterMode(display=False) as counter:
        measured = torch_peak(lambda: found.append(RolesStage(study).compute(name, circuits)))
    rows = found[0]["rows"]
    assert [(r["group"], r["desideratum"]) for r in rows] == [
        ("last", "positional"),
        ("query_label", "positional"),
        ("last", "object_value"),
        ("query_label", "object_value"),
    ]
    assert all(r["selected"] and len(r["random_outcomes"]) == 3 for r in rows)  # every test ran
    inputs = TrajectoryStudy.plan_inputs(path)
    inputs = type(inputs)(**{**vars(inputs), "known": {**inputs.known, "circuits": trajectory_found(stages.parent)}})
    costs = {c.stage: c for c in TrajectoryStudy.stage_costs(inputs, Device("given", 1 << 40, {"float32": 1e9}))}
    cost = costs[f"roles:{name}"]
    assert [s for s in costs if s.startswith("roles:")] == [f"roles:{name}"]
    ratio = cost.flops / counter.get_total_flops()
    assert 1 / 1.25 <= ratio <= 1.25, ratio
    assert cost.reads.passes == sum(runs)
    # the most torch held at once beside the weights: a training step's backward (with the rows it read back from
    # the scratch file, on a CPU its own tensors) or a cache write
    cpu = Device("given", 1 << 40, {"float32": 1e9})
    print("DBG", measured, cost.kept, cost.transient, cost.host_kept)
    assert cost.staged and cost.device_peak(cpu) == cost.weights + cost.kept + cost.transient + cpu.baseline
    assert measured == pytest.approx(cost.kept + cost.transient, rel=0.25)
