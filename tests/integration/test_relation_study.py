"""The circuits study on a knowledge relation: `mechdiff run` of a task file with `[task] name =
"country_capital"` on tiny saved models, every stage written, a second run all cached."""

from __future__ import annotations

import json

from mechdiff.tasks.base import derived_class_names
from mechdiff.tasks.relations import POSITIONS

TASK_FILE = """
[task]
name = "country_capital"

[models]
base = "{base}"
finetunes = ["{finetune}"]

[eval]
n = 6
batch_size = 12
floor = -1.0  # random tiny models answer nothing: every model counts as doing the task (mechanics)

[positions]
n = 4
max_steps = 2

[discovery]
n = 6
curve_n = 6
sizes = [0.1, 0.5, 1.0]
stability_draws = 20

[scoring]
n = 6
random_draws = 2
completeness_draws = 1
reference_n = 68  # 110 distinct prompts, each in one set: the other sets are small so the reference holds every group
prune_n = 2

[dcm]
desiderata = ["subject"]
groups = []
n_train = 4
n_val = 2
n_test = 2
epochs = 1

[cmap]
n = 2
parts = ["z", "qk"]
groups = []
n_random = 1

[output]
dir = "{out}/run"
store = "{out}/store.h5"
"""


def test_circuits_study_on_a_relation(tiny_family, tmp_path, capsys):
    from mechdiff.cli import main

    path = tmp_path / "relation.toml"
    path.write_text(TASK_FILE.format(base=tiny_family[0], finetune=tiny_family[1], out=tmp_path))
    assert main(["run", str(path), "--no-progress"]) == 0
    run = tmp_path / "run"
    report = (run / "report.md").read_text()
    assert "## Circuits" in report and "## What the heads encode (DCM)" in report
    base = tiny_family[0].rsplit("/", 1)[-1]
    stages = run / "stages"
    accuracy = json.loads((stages / f"accuracy__{base}.json").read_text())["result"]
    assert accuracy["accuracy"]["n"] == 6
    scan = json.loads((stages / f"positions__{base}.json").read_text())["result"]["scan"]
    assert scan["classes"] == derived_class_names(POSITIONS)
    circuit = json.loads((run / "circuits" / f"{base}.json").read_text())
    assert circuit["task"] == "country_capital" and set(circuit["positions"].values()) <= set(scan["classes"])
    dcm = json.loads((stages / "dcm.json").read_text())["result"]
    assert {r["desideratum"] for r in dcm["dcm"]} <= {"subject"}
    capsys.readouterr()

    assert main(["run", str(path), "--no-progress"]) == 0
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["stages"] and all(s["cached"] for s in manifest["stages"].values())
