"""The dataset command, task specs and CLI errors."""

from __future__ import annotations

import json

import pytest

from mechdiff.cli import main
from mechdiff.studies.circuits.spec import default_spec, load_spec
from mechdiff.studies.spec import SpecError


def test_dataset_command_writes_jsonl_and_pairs(tmp_path, capsys):
    out = tmp_path / "ds"
    assert (
        main(
            [
                "dataset",
                "entity-tracking",
                "--n-boxes",
                "3",
                "--n",
                "12",
                "--pairs",
                "positional",
                "--out",
                str(out),
                "--hf",
            ]
        )
        == 0
    )
    lines = (out / "examples.jsonl").read_text().splitlines()
    assert len(lines) == 12
    first = json.loads(lines[0])
    assert first["prompt"].endswith("contains the") and len(first["objects"]) == 3
    assert len((out / "positional.jsonl").read_text().splitlines()) == 12
    assert (out / "examples").is_dir()
    assert "kept" in capsys.readouterr().out


def test_dataset_command_shows_dropped_words_before_generation_fails(tmp_path, capsys):
    """Too few single-token words: the vocabulary report (naming the dropped ones) is printed before the error."""
    vocabulary = tmp_path / "objects.txt"
    vocabulary.write_text("apple\nmug\nscarf\nsofa\nbook\n")
    assert (
        main(
            [
                "dataset",
                "entity-tracking",
                "--n-boxes",
                "3",
                "--n",
                "4",
                "--vocabulary",
                str(vocabulary),
                "--out",
                str(tmp_path / "ds"),
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "kept 2 of 5 objects" in captured.out and "dropped 3: mug, scarf, sofa" in captured.out
    assert "need at least 3" in captured.err


def test_dataset_command_rejects_unknown_pair_kind(tmp_path, capsys):
    assert main(["dataset", "entity-tracking", "--pairs", "colour", "--out", str(tmp_path)]) == 2
    assert "unknown pair kinds" in capsys.readouterr().err


def test_unknown_model_error_lists_registry(capsys):
    assert main(["dataset", "entity-tracking", "--model", "gpt-5", "--out", "x"]) == 2
    assert "smollm2-et-early" in capsys.readouterr().err


def test_spec_defaults_and_shipped_file():
    spec = load_spec("tasks/entity_tracking.toml")
    assert spec.models.base == "smollm2-et-early"
    assert spec.model_names == ["smollm2-et-early", "smollm2-et"]
    assert default_spec().to_dict() == {**spec.to_dict()}


def test_spec_unknown_key_names_line_and_valid_keys(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('[task]\nname = "entity-tracking"\n\n[models]\nbase = "smollm2-135m"\nfinetune = ["x"]\n')
    with pytest.raises(SpecError) as err:
        load_spec(p)
    assert ":6:" in str(err.value) and "finetunes" in str(err.value)


def test_spec_missing_field_and_unknown_section(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('[task]\nn_boxes = 3\n[models]\nbase = "a"\n')
    with pytest.raises(SpecError, match="missing the required field 'name'"):
        load_spec(p)
    p.write_text('[task]\nname = "entity-tracking"\n[models]\nbase = "a"\n[plots]\nx = 1\n')
    with pytest.raises(SpecError, match=":5: unknown section"):
        load_spec(p)


def test_spec_bad_value_names_line_and_valid_values(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('[task]\nname = "entity-tracking"\n[models]\nbase = "a"\n[cmap]\nparts = ["z", "o"]\n')
    with pytest.raises(SpecError, match=r":6: parts = \['z', 'o'\] in \[cmap\]; valid values: z, q, k, v, qk, qkv"):
        load_spec(p)
    p.write_text('[task]\nname = "entity-tracking"\n[models]\nbase = "a"\n[dcm]\nrandom_pool = "model"\n')
    with pytest.raises(SpecError, match=":6: random_pool"):
        load_spec(p)
