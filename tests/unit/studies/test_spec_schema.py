"""The task-file schema on pydantic (mechdiff.studies.spec.SCHEMA): every field's type checked with the file's line,
fields that default to None included; numbers kept as the file writes them; the nearest valid name suggested."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from mechdiff.studies import spec as S
from mechdiff.studies.circuits import spec as C
from mechdiff.studies.trajectory import settings as T

HEAD = '[task]\nname = "entity-tracking"\n\n[models]\nbase = "smollm2-et-early"\nfinetunes = ["smollm2-et"]\n'


def _wrong(default):
    """A TOML value of another type than the field's: a list where a scalar or nothing is the default, a string
    where a list, a table, a number or a bool is."""
    return '"x"' if isinstance(default, (list, tuple, dict, bool, int, float)) else "[[1]]"


def _cases(sections: dict, skip: tuple = ()) -> list:
    return [
        (name, f.name, getattr(cls(), f.name))
        for name, cls in sections.items()
        for f in dataclasses.fields(cls)
        if (name, f.name) not in skip
    ]


def _refused_at_its_line(tmp_path, load, head: str, section: str, key: str, value: str) -> str:
    """Load ``head`` with ``[section] key = value`` (in place of the head's own ``key``) and return
    the refusal, after checking it names the file and the line the key was written on (counted here)."""
    lines = [x for x in head.splitlines() if not x.startswith(f"{key} = ")]  # head's keys: one in each section
    if f"[{section}]" in lines:  # the key goes into the section the head already has
        lines.insert(lines.index(f"[{section}]") + 1, f"{key} = {value}")
    else:
        lines += ["", f"[{section}]", f"{key} = {value}"]
    path = tmp_path / "t.toml"
    path.write_text("\n".join(lines) + "\n")
    line = lines.index(f"{key} = {value}") + 1
    with pytest.raises(S.SpecError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}:{line}: {key} = "), str(err.value)
    assert f" in [{section}] — give " in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(("section", "key", "default"), _cases(C.SECTIONS))
def test_every_field_of_a_circuits_task_file_is_checked_with_its_line(tmp_path, section, key, default):
    """Each field given a value of another type is refused with its line: the fields that default to None too
    (eval floor, models device and device_map, discovery pairs_per_part), which a check against the default's
    type never saw; those say they may be left out."""
    message = _refused_at_its_line(tmp_path, C.load_spec, HEAD, section, key, _wrong(default))
    assert ("(or leave it out)" in message) == (default is None)


TRAJECTORY_HEAD = (
    '[study]\nkind = "trajectory"\n\n[task]\nname = "entity-tracking"\n\n[models]\n'
    'checkpoints = ["smollm2-et-early", "smollm2-et"]\n'
)


@pytest.mark.parametrize(("section", "key", "default"), _cases(T.SECTIONS, skip=(("study", "kind"),)))
def test_every_field_of_a_trajectory_task_file_is_checked_with_its_line(tmp_path, section, key, default):
    message = _refused_at_its_line(tmp_path, T.load_settings, TRAJECTORY_HEAD, section, key, _wrong(default))
    assert ("(or leave it out)" in message) == (default is None)


@pytest.mark.parametrize(
    ("section", "text", "type_name"),
    [
        ("eval", 'floor = "high"', "a number"),
        ("models", "device = 0", "a string"),
        ("models", "device_map = true", "a string"),
        ("discovery", 'method = "path"\npairs_per_part = 2.5', "an integer"),
    ],
)
def test_a_field_that_defaults_to_none_is_checked_as_the_type_it_takes(tmp_path, section, text, type_name):
    path = tmp_path / "t.toml"
    path.write_text(HEAD.replace("[models]\n", "[models]\n" + text + "\n") if section == "models" else
                    f"{HEAD}\n[{section}]\n{text}\n")  # fmt: skip
    line = path.read_text().splitlines().index(text.splitlines()[-1]) + 1
    with pytest.raises(
        S.SpecError, match=rf"t.toml:{line}: .* in \[{section}\] — give {type_name} \(or leave it out\)"
    ):
        C.load_spec(path)


def test_the_same_fields_given_their_type_load_as_written(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        HEAD.replace("[models]\n", '[models]\ndevice = "cpu"\n')
        + '\n[eval]\nfloor = 0.4\n\n[discovery]\nmethod = "path"\npairs_per_part = 50\n'
    )
    spec = C.load_spec(path)
    assert (spec.eval.floor, spec.models.device, spec.discovery.pairs_per_part) == (0.4, "cpu", 50)


def test_a_number_is_kept_as_the_file_writes_it_so_stage_keys_do_not_move(tmp_path):
    """A file's ``lam = 1`` keys its stages as ``1``, as before the schema; ``1.0`` as ``1.0``. A float field of
    pydantic's would have made both ``1.0``."""
    for text, kept in (("1", 1), ("1.0", 1.0)):
        path = tmp_path / "t.toml"
        path.write_text(f"{HEAD}\n[dcm]\nlam = {text}\n\n[discovery]\nsizes = [0.5, {text}]\n")
        spec = C.load_spec(path)
        assert type(spec.dcm.lam) is type(kept) and spec.dcm.lam == kept
        assert json.dumps(C.section_inputs("dcm", spec.dcm)["lam"]) == text
        assert json.dumps(C.section_inputs("discovery", spec.discovery)["sizes"]) == f"[0.5, {text}]"


def test_an_unknown_key_or_section_names_the_nearest_valid_one(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(f"{HEAD}\n[dcm]\nlamb = 0.1\n")
    with pytest.raises(S.SpecError, match=r"t.toml:9: unknown key 'lamb' in \[dcm\]; did you mean 'lam'\? valid keys"):
        C.load_spec(path)
    path.write_text(f"{HEAD}\n[dcmm]\nlam = 0.1\n")
    with pytest.raises(S.SpecError, match=r"t.toml:8: unknown section \[dcmm\]; did you mean \[dcm\]\? valid sec"):
        C.load_spec(path)
    path.write_text(f"{HEAD}\n[dcm]\nzzzz = 0.1\n")  # nothing near: the valid keys only
    with pytest.raises(S.SpecError, match=r"unknown key 'zzzz' in \[dcm\]; valid keys: desiderata"):
        C.load_spec(path)


def test_an_item_of_a_list_or_table_is_named(tmp_path):
    path = tmp_path / "t.toml"
    for text, where in (('sizes = [0.1, "x"]', "item 1 is 'x'"), ('top_k = { A = "x" }', "A is 'x'")):
        path.write_text(f"{HEAD}\n[discovery]\n{text}\n")
        with pytest.raises(S.SpecError, match=rf"t.toml:9: .*; {where}$"):
            C.load_spec(path)


def test_a_section_built_in_python_is_checked_as_a_file_is():
    """The same schema holds for a study built in Python: a wrong type or an unknown field is refused."""
    with pytest.raises(ValidationError, match="pairs_per_part"):
        C.DiscoverySection(pairs_per_part="many")
    with pytest.raises(ValidationError, match="lamb"):
        S.DcmSection(lamb=0.1)
    assert S.DcmSection(lam=1).lam == 1 and dataclasses.asdict(S.DcmSection()) == dataclasses.asdict(S.DcmSection())


def test_a_plain_settings_dataclass_is_checked_and_kept(tmp_path):
    """A kind whose settings are a plain dataclass (knowledge: also built from flags) is checked by the same schema
    when read from a file, and built as its own class from the values as the file gives them (a list where a
    tuple is the default becomes a tuple)."""
    from mechdiff.studies.knowledge.settings import KnowledgeSettings, load_settings

    path = tmp_path / "k.toml"
    path.write_text('[knowledge]\nk = "ten"\n')
    with pytest.raises(S.SpecError, match=r"k.toml:2: k = 'ten' in \[knowledge\] — give an integer \(the default"):
        load_settings(path)
    path.write_text('[knowledge]\nshrink = 1\nmodels = ["a", "b"]\n')
    settings = load_settings(path)
    assert type(settings) is KnowledgeSettings and settings == KnowledgeSettings(shrink=1, models=("a", "b"))
    assert type(settings.shrink) is int
