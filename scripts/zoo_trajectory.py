"""Install a rerun of the entity-tracking recipe as the ``smollm2-et@STEP`` trajectory, after checking it.

usage: python scripts/zoo_trajectory.py RUN_DIR [--out results/zoo/trajectory.json] [--add STEPS]

RUN_DIR holds ``step-NNNN`` adapters of every step of ``TRAJECTORIES["smollm2-et"]`` (``mechdiff finetune
--save 0,5,...``). Checks, written to ``--out``:
- step 0: every LoRA B is exactly zero, so the merge is the base bit for bit (the registry's step 0 is the base);
- steps 15 and 100 against the committed smollm2-et-early and smollm2-et: every tensor (bitwise, or the max abs
  difference relative to the tensor's scale), the training losses, the validation accuracies and the merged
  model's fingerprint;
- every step: the adapter file's sha256, the merged fingerprint and the run's validation accuracy.
Steps 1.. are copied to mechdiff/zoo/smollm2-et-trajectory/ (step 0 is the base). Exits 1 if step 0 is not
exactly the base.

``--add 1,2,3``: RUN_DIR is a shorter rerun of the same recipe (``--steps 12``) saving those steps and some already
installed; every installed step it also saved must be the installed adapter bit for bit (the same run), else it
exits 1 and installs nothing. The added steps are copied and recorded in ``--out`` beside the others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from mechdiff.models.loading import load_model, resolve_source, resolve_spec
from mechdiff.models.registry import REGISTRY, TRAJECTORIES, step_dirname

ROOT = Path(__file__).resolve().parents[1]
REPRODUCES = {15: "smollm2-et-early", 100: "smollm2-et"}  # committed adapters this recipe built


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare(run_step: Path, committed: Path) -> dict:
    """Tensors, losses and history of a run's adapter against a committed one."""
    a, b = (load_file(str(d / "adapter_model.safetensors")) for d in (run_step, committed))
    ra, rb = (json.loads((d / "recipe.json").read_text()) for d in (run_step, committed))
    same_keys = a.keys() == b.keys()
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if k in b}
    relative = {k: diffs[k] / b[k].float().abs().max().item() for k in diffs if b[k].any()}
    steps_b = {h["step"] for h in rb["history"]}
    losses = [abs(x - y) for x, y in zip(ra["train_loss"], rb["train_loss"])]
    delta = {}  # per module: ||B A - B' A'||_F / ||B' A'||_F, the change each adapter makes to a weight
    for k in (k for k in a if ".lora_A." in k):
        kb = k.replace("lora_A", "lora_B")
        da, db = (x[kb].float() @ x[k].float() for x in (a, b))
        delta[k.replace(".lora_A.weight", "")] = ((da - db).norm() / db.norm()).item()
    return {
        "committed": str(committed.relative_to(ROOT)),
        "same_tensor_names": same_keys,
        "bitwise_equal_tensors": same_keys and all(torch.equal(a[k], b[k]) for k in a),
        "max_abs_diff": max(diffs.values()),
        "max_abs_diff_over_tensor_max_abs": max(relative.values()),
        "weight_update_relative_diff": {
            "max": max(delta.values()),
            "median": sorted(delta.values())[len(delta) // 2],
            "n_modules": len(delta),
        },
        "n_tensors": len(a),
        "n_tensors_bitwise_equal": sum(torch.equal(a[k], b[k]) for k in a if k in b),
        "same_file_sha256": sha256(run_step / "adapter_model.safetensors")
        == sha256(committed / "adapter_model.safetensors"),
        "same_train_loss": ra["train_loss"] == rb["train_loss"],
        "max_train_loss_diff": max(losses),
        "first_train_loss": [ra["train_loss"][0], rb["train_loss"][0]],
        "same_validation_accuracy": [h["et_accuracy"] for h in ra["history"] if h["step"] in steps_b]
        == [h["et_accuracy"] for h in rb["history"]],
    }


def step_record(traj, step: int, validation: dict) -> dict:
    """An installed step's model, source, adapter sha256, merged fingerprint and validation accuracy."""
    spec = resolve_spec(f"{traj.name}@{step}")
    folder = Path(resolve_source(spec.source))
    return {
        "model": spec.name,
        "source": spec.source,
        "adapter_sha256": sha256(folder / "adapter_model.safetensors") if spec.kind == "lora" else None,
        "fingerprint": load_model(spec).fingerprint,
        "validation_et_accuracy": validation.get(step),
    }


def add(run: Path, steps: list[int], out: Path) -> int:
    """Install ``steps`` of a shorter rerun after checking it is the installed run where both saved a step."""
    traj = TRAJECTORIES["smollm2-et"]
    dest = Path(resolve_source(traj.source))
    report = json.loads(out.read_text())
    shared = [s for s in traj.steps if s and s not in steps and (run / step_dirname(s)).is_dir()]
    same = {
        s: sha256(run / step_dirname(s) / "adapter_model.safetensors") == report["steps"][str(s)]["adapter_sha256"]
        for s in shared
    }
    print("installed steps the rerun also saved, bitwise equal:", same, flush=True)
    if not shared or not all(same.values()):
        print("not the installed run (or no step to check it by): nothing installed", file=sys.stderr)
        return 1
    history = {
        h["step"]: h["et_accuracy"]
        for h in json.loads((run / step_dirname(max(steps)) / "recipe.json").read_text())["history"]
    }
    for step in steps:
        shutil.rmtree(dest / step_dirname(step), ignore_errors=True)
        shutil.copytree(run / step_dirname(step), dest / step_dirname(step))
    report["added"] = {
        "run": json.loads((run / step_dirname(max(steps)) / "recipe.json").read_text())["options"],
        "checked_against_installed": {str(s): v for s, v in same.items()},
    }
    for step in steps:
        report["steps"][str(step)] = step_record(traj, step, history)
        print(step, report["steps"][str(step)], flush=True)
    report["steps"] = dict(sorted(report["steps"].items(), key=lambda kv: int(kv[0])))
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "zoo" / "trajectory.json")
    ap.add_argument("--add", default="", help="steps of a shorter rerun to add (comma-separated)")
    args = ap.parse_args()
    if args.add:
        return add(args.run, [int(s) for s in args.add.split(",")], args.out)
    traj = TRAJECTORIES["smollm2-et"]
    missing = [s for s in traj.steps if not (args.run / step_dirname(s) / "adapter_config.json").is_file()]
    if missing:
        raise SystemExit(f"{args.run} lacks steps {missing}; rerun with --save {','.join(map(str, traj.steps))}")
    zero = load_file(str(args.run / step_dirname(0) / "adapter_model.safetensors"))
    report = {
        "run": json.loads((args.run / step_dirname(traj.steps[-1]) / "recipe.json").read_text())["options"],
        "step_0_lora_B_all_zero": all(not v.any() for k, v in zero.items() if "lora_B" in k),
        "reproduction": {},
        "steps": {},
    }
    for step, alias in REPRODUCES.items():
        committed = Path(resolve_source(REGISTRY[alias].source))
        report["reproduction"][step] = compare(args.run / step_dirname(step), committed)
    dest = Path(resolve_source(traj.source))
    for step in traj.steps:
        if step:
            shutil.rmtree(dest / step_dirname(step), ignore_errors=True)
            shutil.copytree(args.run / step_dirname(step), dest / step_dirname(step))
    history = {
        h["step"]: h["et_accuracy"]
        for h in json.loads((args.run / step_dirname(traj.steps[-1]) / "recipe.json").read_text())["history"]
    }
    for step in traj.steps:
        report["steps"][step] = step_record(traj, step, history)
        if step in REPRODUCES:
            report["reproduction"][step].update(
                fingerprint=report["steps"][step]["fingerprint"],
                committed_fingerprint=load_model(REPRODUCES[step]).fingerprint,
            )
        print(step, report["steps"][step], flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["reproduction"], indent=2))
    return 0 if report["step_0_lora_B_all_zero"] else 1


if __name__ == "__main__":
    sys.exit(main())
