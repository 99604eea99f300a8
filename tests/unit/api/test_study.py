"""`mechdiff.api.study`: a study from keywords is the task file with those fields (one loader, the same checks and
messages), and a task file read into a `Study` writes back (`to_toml`) to a file that loads to the same spec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

import mechdiff as md
from mechdiff.api.study import toml_text
from mechdiff.studies.circuits.spec import load_spec
from mechdiff.studies.spec import SpecError

ROOT = Path(__file__).resolve().parents[3]
MODELS = ["smollm2-135m", "smollm2-et"]


@pytest.mark.parametrize("name", ["ioi.toml", "entity_tracking.toml", "capitals.toml"])
def test_a_task_file_round_trips_through_a_study(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # task directories and output dirs are relative to the working directory
    study = md.Study.from_file(f"tasks/{name}")
    assert study.spec.to_dict() == load_spec(f"tasks/{name}").to_dict()
    again = tmp_path / name
    study.to_toml(again)
    assert load_spec(again).to_dict() == study.spec.to_dict()
    assert md.Study.from_file(again).to_dict() == study.to_dict() == tomllib.loads(again.read_text())


def test_keywords_are_the_task_files_fields(tmp_path):
    """``Study(task=, models=, out=, eval=...)`` loads to the spec of the file spelling the same fields."""
    file = tmp_path / "ioi.toml"
    file.write_text(
        '[task]\nname = "ioi"\n[models]\nbase = "smollm2-135m"\nfinetunes = ["smollm2-et"]\n'
        f'[eval]\nn = 40\n[discovery]\nsizes = [0.1, 1.0]\ntarget = 0.75\n[output]\ndir = "{tmp_path / "x"}"\n'
    )
    study = md.Study(
        task="ioi", models=MODELS, out=tmp_path / "x", eval={"n": 40}, discovery={"sizes": [0.1, 1.0], "target": 0.75}
    )
    assert study.spec.to_dict() == load_spec(file).to_dict()
    assert study.spec.eval.n == 40 and study.spec.eval.batch_size == 50  # the rest at the file's defaults
    assert study.out == tmp_path / "x" and study.source == "md.Study"
    assert tomllib.loads(study.to_toml()) == tomllib.loads(file.read_text())


@pytest.mark.parametrize(
    "section, fields, message",
    [
        ("eval", {"nn": 3}, "unknown key 'nn' in [eval]"),
        ("eval", {"n": "forty"}, "n = 'forty' in [eval]"),
        ("discovery", {"method": "paths"}, "method = 'paths' in [discovery]"),
        ("scoring", {"prune": False}, None),  # valid: no error
        ("dcm", {"desiderata": ["nope"]}, "[dcm] desiderata ['nope'] are not task ioi's"),
    ],
)
def test_a_bad_keyword_gets_the_bad_fields_message(section, fields, message, tmp_path):
    """The same message as the same field in a task file, the file's ``FILE:LINE:`` given as ``md.Study:``."""
    file = tmp_path / "bad.toml"
    file.write_text(
        '[task]\nname = "ioi"\n[models]\nbase = "smollm2-135m"\n' + f"[{section}]\n" + toml_text({"x": fields})[4:]
    )
    if message is None:
        assert md.Study(task="ioi", models={"base": "smollm2-135m"}, **{section: fields}).spec.to_dict() == (
            load_spec(file).to_dict()
        )
        return
    with pytest.raises(SpecError) as from_file:
        load_spec(file)
    with pytest.raises(SpecError) as from_keywords:
        md.Study(task="ioi", models={"base": "smollm2-135m"}, **{section: fields})
    assert message in str(from_file.value)
    in_file = re.sub(rf"^{re.escape(str(file))}:\d+: ", "", str(from_file.value))
    assert str(from_keywords.value) == f"md.Study: {in_file}"


def test_unknown_sections_and_missing_fields_read_as_in_a_file():
    with pytest.raises(SpecError, match=r"^md\.Study: unknown section \[evaluation\]; valid sections: task, "):
        md.Study(task="ioi", models=MODELS, evaluation={"n": 3})
    with pytest.raises(SpecError, match=r"^md\.Study: \[models\] is missing the required field 'base'"):
        md.Study(task="ioi")
    with pytest.raises(SpecError, match="is neither a registered task nor a task directory; did you mean ioi"):
        md.Study(task="iox", models=MODELS)
    with pytest.raises(TypeError, match=r"eval= is the \[eval\] section"):
        md.Study(task="ioi", models=MODELS, eval=40)
    with pytest.raises(TypeError, match="models= takes"):
        md.Study(task="ioi", models="smollm2-135m")


def test_toml_text_writes_what_tomllib_reads_back():
    raw = {
        "task": {"name": 'a "quoted" \\ name', "seed": 3},
        "discovery": {
            "sizes": [0.5, 1e-05, 1.0],
            "top_k": {"A": 8, "my step": 2},
            "models": {"/data/m0": {"seed": 4, "top_k": {"A": 1}}},
            "screen": True,
            "pairs_per_part": None,
        },
        "inference": {"margins": {"accuracy": 0.03}},
    }
    back = tomllib.loads(toml_text(raw))
    del raw["discovery"]["pairs_per_part"]  # TOML has no null: a None field is left out (its default)
    assert back == raw
    with pytest.raises(TypeError, match=r"\[task\] seed = \{1, 2\}: give a string"):
        toml_text({"task": {"seed": {1, 2}}})
