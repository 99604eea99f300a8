"""Checkpoints of a run addressed as ``NAME@STEP``: a tiny run trained here, and the committed smollm2-et trajectory."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch

from mechdiff.commands.finetune import _save_spec
from mechdiff.methods.finetune import FinetuneConfig
from mechdiff.models.loading import load_model
from mechdiff.models.registry import REGISTRY, TRAJECTORIES, step_dirname
from mechdiff.models.resolve import resolve_source, resolve_spec, trajectory_steps

ET = TRAJECTORIES["smollm2-et"]
EPS32 = torch.finfo(torch.float32).eps
TRAJECTORY_RECORD = Path(__file__).resolve().parents[3] / "results" / "zoo" / "trajectory.json"


def merged_by_hand(base_sd: dict[str, torch.Tensor], adapter_dir: Path, scaling: float) -> dict[str, torch.Tensor]:
    """Base weights plus ``scaling * B @ A`` from the adapter file, with an elementwise float32 rounding bound."""
    from safetensors.torch import load_file

    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = {}
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = lora[key.replace("lora_A", "lora_B")].float()
        w = base_sd[name]
        out[name] = (w + scaling * (b @ a.float()), 8 * EPS32 * (w.abs() + scaling * (b.abs() @ a.float().abs())))
    return out


def test_save_spec_takes_bare_steps_as_step_directories():
    assert _save_spec("early=15,0,45") == {"early": 15, "step-0000": 0, "step-0045": 45}
    assert step_dirname(45) == "step-0045"
    for bad in ("x", "early=", "=3", "early=1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=STEP or STEP"):
            _save_spec(bad)


def test_tiny_run_checkpoints_load_as_the_adapters_they_name(tiny_run):
    base, run = tiny_run
    assert trajectory_steps(str(run)) == (0, 2, 4)
    spec = resolve_spec(f"{run}@4")
    assert (spec.kind, spec.source, spec.base, spec.name) == ("lora", str(run / "step-0004"), str(base), f"{run}@4")
    assert spec.extra == {"trajectory": str(run), "step": 4}
    base_sd = load_model(str(base)).model.state_dict()
    cfg = json.loads((run / "step-0004" / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    for step in (2, 4):
        loaded = load_model(f"{run}@{step}").model.state_dict()
        expected = merged_by_hand(base_sd, run / step_dirname(step), scaling)
        assert len(expected) == 3 * 4  # q, k, v, o of 3 layers
        for name, (want, bound) in expected.items():
            assert ((loaded[name] - want).abs() <= bound).all(), name
            assert not torch.equal(loaded[name], base_sd[name]), name  # the trained adapter moved every module
        untouched = [k for k in base_sd if k not in expected]
        assert untouched and all(torch.equal(loaded[k], base_sd[k]) for k in untouched)
    at2, at4 = (load_model(f"{run}@{s}").model.state_dict() for s in (2, 4))
    assert any(not torch.equal(at2[k], at4[k]) for k in at2)


def test_step_zero_is_the_base_bit_for_bit(tiny_run):
    """A fresh LoRA's B is zero, so the step-0 adapter merged is exactly the base (why the registry's step 0 is
    its base, with no adapter file)."""
    base, run = tiny_run
    at0, base_sd = load_model(f"{run}@0").model.state_dict(), load_model(str(base)).model.state_dict()
    assert at0.keys() == base_sd.keys() and all(torch.equal(at0[k], base_sd[k]) for k in at0)
    assert resolve_spec("smollm2-et@0").source == REGISTRY["smollm2-135m"].source


def test_unsaved_step_and_bad_names_are_refused_with_the_saved_steps(tiny_run):
    _, run = tiny_run
    with pytest.raises(KeyError, match=r"step 3 is not saved .*saved steps: 0, 2, 4"):
        resolve_spec(f"{run}@3")
    saved = "0, 1, 2, 3, 4, 5, 6, 8, 10"
    with pytest.raises(KeyError, match=rf"smollm2-et@7: step 7 is not saved; saved steps of smollm2-et: {saved}"):
        resolve_spec("smollm2-et@7")
    with pytest.raises(ValueError, match="whole step number"):
        resolve_spec("smollm2-et@late")
    with pytest.raises(KeyError, match="Registered trajectories: smollm2-et"):
        resolve_spec("smollm2-nope@5")
    with pytest.raises(ValueError, match="holds no step-NNNN directory"):
        resolve_spec(f"{run.parent / 'base'}@0")


def committed_recipe(step: int) -> dict:
    return json.loads((Path(resolve_source(ET.spec(step).source)) / "recipe.json").read_text())


def test_committed_trajectory_is_one_run_of_the_smollm2_et_recipe():
    """Every trained step of smollm2-et@STEP is a committed adapter of one run (its losses and evaluations are a prefix
    of the last step's: equal floats), with smollm2-et's options but the save list, and the files that
    results/zoo/trajectory.json describes."""
    record = json.loads(TRAJECTORY_RECORD.read_text())
    final = json.loads((Path(resolve_source(REGISTRY["smollm2-et"].source)) / "recipe.json").read_text())
    last = committed_recipe(ET.steps[-1])
    assert ET.steps[0] == 0 and ET.steps[-1] == final["step"] and list(ET.steps) == sorted(set(ET.steps))
    assert sorted(map(int, record["steps"])) == list(ET.steps)
    for step in ET.steps[1:]:
        spec = ET.spec(step)
        assert resolve_spec(f"smollm2-et@{step}") == spec and spec.base == "smollm2-135m"
        folder = Path(resolve_source(spec.source))
        recipe = committed_recipe(step)
        assert recipe["step"] == step and recipe["train_loss"] == last["train_loss"][:step]
        # a step added by a shorter rerun (scripts/zoo_trajectory.py --add): the same losses bit for bit, every
        # evaluation the full run made up to the step equal; it ran --steps 12 and evaluated at every save
        shorter = recipe["options"]["steps"] != final["options"]["steps"]
        if shorter:
            checked = record["added"]["checked_against_installed"]
            assert str(step) not in checked and checked and all(checked.values())
            accuracy = {h["step"]: h["et_accuracy"] for h in recipe["history"]}
            assert all(accuracy[h["step"]] == h["et_accuracy"] for h in last["history"] if h["step"] <= step)
        else:
            assert recipe["history"] == [h for h in last["history"] if h["step"] <= step]
        assert recipe["history"][-1]["step"] == step
        ignored = ("save_steps", "save_every") + (("steps", "stop_accuracy") if shorter else ())
        assert {k: v for k, v in recipe["options"].items() if k not in ignored} == {
            k: v for k, v in final["options"].items() if k not in ignored
        }
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2-135m"
        weights = (folder / "adapter_model.safetensors").read_bytes()
        assert hashlib.sha256(weights).hexdigest() == record["steps"][str(step)]["adapter_sha256"]
        assert record["steps"][str(step)]["validation_et_accuracy"] == recipe["history"][-1]["et_accuracy"]
    assert record["steps"]["0"]["source"] == REGISTRY["smollm2-135m"].source and record["step_0_lora_B_all_zero"]


@pytest.mark.slow
def test_committed_checkpoint_loads_with_its_recorded_fingerprint_and_accuracy():
    """smollm2-et@45 (real weights) merges to the recorded fingerprint and scores its run's validation accuracy."""
    from mechdiff.methods.finetune import accuracy, validation_sets
    from mechdiff.tasks.entity_tracking.splits import train_objects

    lm = load_model("smollm2-et@45")
    assert lm.fingerprint == json.loads(TRAJECTORY_RECORD.read_text())["steps"]["45"]["fingerprint"]
    recipe = committed_recipe(45)
    cfg = FinetuneConfig(**{**recipe["options"], "save_steps": {}})
    measured = accuracy(lm.model, validation_sets(cfg, lm.tokenizer, train_objects())["et_accuracy"])
    assert abs(measured - recipe["history"][-1]["et_accuracy"]) <= 0.02  # merged float16 adapter vs training's fp32
