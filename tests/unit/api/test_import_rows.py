"""`md.import_rows`: rows in memory through `mechdiff dataset import`'s checks into a task directory a study names;
every bad row reported at once by its index in the list."""

from __future__ import annotations

import json

import pytest
from conftest import capitals_rows

import mechdiff as md
from mechdiff.tasks.jsonl import import_pairs
from mechdiff.tasks.row_checks import ImportErrors


def test_rows_in_memory_make_the_directory_the_cli_import_makes(smollm2_tokenizer, tmp_path):
    rows = capitals_rows(12)
    task = md.import_rows(rows, model="smollm2-135m", name="caps", out=tmp_path / "caps")
    assert task.name == "caps" and task.source == str(tmp_path / "caps")
    kept = tmp_path / "caps.jsonl"  # the rows, as the CLI's import reads them
    assert [json.loads(line) for line in kept.read_text().splitlines()] == rows
    cli = import_pairs(kept, smollm2_tokenizer, tmp_path / "cli", model="smollm2-135m", name="caps")
    for name in ("pairs.jsonl", "desiderata/counterfactual.jsonl"):
        if (cli / name).exists():
            assert (cli / name).read_bytes() == (tmp_path / "caps" / name).read_bytes()
    assert task.rows_digest == md.task(cli).rows_digest
    study = md.Study(task=task, models=["smollm2-135m", "smollm2-et"], out=tmp_path / "run")
    assert study.spec.task.name == str(tmp_path / "caps")


def test_every_bad_row_is_named_by_its_index(tmp_path):
    rows = capitals_rows(6)
    del rows[1]["answer"]  # a missing field
    rows[3]["positions"]["country"] = [0, 200]  # a span past the prompt
    rows[4]["clean"] += " and"  # clean and counterfactual of different lengths
    with pytest.raises(ImportErrors) as err:
        md.import_rows(rows, model="smollm2-135m", name="bad", out=tmp_path / "bad")
    indices = {int(line.split("]")[0].removeprefix("rows[")) for line in err.value.lines if line.startswith("rows[")}
    assert indices == {1, 3, 4}, err.value.lines
    assert "nothing was written" in str(err.value) and str(tmp_path) not in str(err.value)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.jsonl").exists()


def test_an_existing_directory_and_non_dict_rows_are_refused_first(tmp_path):
    (tmp_path / "there").mkdir()
    with pytest.raises(ValueError, match="exists; give another out="):
        md.import_rows(capitals_rows(2), model="smollm2-135m", out=tmp_path / "there")
    with pytest.raises(TypeError, match=r"rows \[1\] are not dicts"):
        md.import_rows([{}, "row"], model="smollm2-135m", out=tmp_path / "t")
    with pytest.raises(ValueError, match="give the task a name"):
        md.import_rows(capitals_rows(2), model="smollm2-135m")
