"""A circuits study's prompt sets by item, before any weights load: disjoint by default, the declared nested sets
(``[sets] nested = true``) first-N of one draw, and what ``run.json`` records of them."""

from __future__ import annotations

import pytest

from mechdiff.tasks.prompt_sets import clean_key


def _study(tmp_path, monkeypatch, nested: bool):
    from mechdiff.studies.circuits import study as circuits
    from mechdiff.studies.circuits.spec import load_spec

    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / "study.toml"
    spec_file.write_text(
        '[task]\nname = "entity-tracking"\n[models]\nbase = "smollm2-135m"\nfinetunes = ["smollm2-capital-edit"]\n'
        f'[output]\ndir = "{tmp_path / "run"}"\nstore = "{tmp_path / "store.h5"}"\n'
        '[eval]\nn = 24\n[positions]\nn = 0\n[discovery]\nmethod = "path"\nn = 12\n'
        "[scoring]\nn = 20\nreference_n = 16\nprune_n = 8\n[dcm]\nn_train = 4\nn_val = 2\nn_test = 4\n[cmap]\nn = 8\n"
        + ("[sets]\nnested = true\n" if nested else "")
    )
    monkeypatch.setattr(circuits, "ModelSet", _tokenizers_only)  # no weights: the sets are drawn before
    return circuits.CircuitsStudy(load_spec(spec_file), progress=False)


def _tokenizers_only(names, **_):
    """A model set that reads each model's tokenizer and no weights."""
    from types import SimpleNamespace

    from mechdiff.models.loading import load_tokenizer
    from mechdiff.models.resolve import resolve_spec

    return SimpleNamespace(tokenizers={resolve_spec(n).name: load_tokenizer(resolve_spec(n)) for n in names})


def _clean(study, name: str, n: int) -> list:
    """The clean prompts of the set ``name`` as its stage draws them (path discovery: pairs)."""
    t = study.task
    if name == "discovery":
        return [
            clean_key(p) for p in t.discovery_pairs(study.tokenizer, n, study.seed(name), **study.options(prompts=name))
        ]
    return [clean_key(r) for r in t.records(study.tokenizer, n, study.seed(name), **study.options(prompts=name))]


def test_nested_sets_are_prefixes_of_one_draw_and_the_record_says_so(tmp_path, monkeypatch):
    """With [sets] nested = true, discovery (12), pruning (8) and the matrix (20) are the first prompts of the
    accuracy set's draw (24), as the paper's sets are the first lines of one file; run.json lists them as nested,
    with the departure; the default study's sets share no clean prompt."""
    study = _study(tmp_path, monkeypatch, nested=True)
    assert study.nested_sets() == ["eval", "discovery", "matrix", "prune"]
    eval_ = _clean(study, "eval", 24)
    for name, n in (("discovery", 12), ("prune", 8), ("matrix", 20)):
        assert _clean(study, name, n) == eval_[:n], name
    record = study.prompt_sets_record()
    assert record["nested"] == ["eval", "discovery", "matrix", "prune"] and "first-N of one draw" in record["departure"]
    assert record["shared_items"] == 0  # nested sets with each other aside
    assert record["item_ids"]["discovery"] == record["item_ids"]["eval"][:12]
    matrix = study.set_items("matrix").tolist()
    assert matrix == record["item_ids"]["eval"][:20] and len(set(matrix)) == 20  # entity tracking: no repeats
    assert "nested_sets" in study.task_inputs()

    default = _study(tmp_path / "d", monkeypatch, nested=False)
    drawn = {n: set(_clean(default, n, k)) for n, k in (("eval", 24), ("discovery", 12), ("matrix", 20), ("prune", 8))}
    names = list(drawn)
    assert all(not drawn[a] & drawn[b] for i, a in enumerate(names) for b in names[i + 1 :])
    record = default.prompt_sets_record()
    assert record["nested"] == [] and "departure" not in record and record["shared_items"] == 0
    assert record["sizes"] == default.prompt_set_sizes() and "nested_sets" not in default.task_inputs()


@pytest.mark.parametrize("value", ["yes", 1])
def test_sets_nested_is_a_boolean(tmp_path, value):
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError

    path = tmp_path / "t.toml"
    path.write_text(
        f'[task]\nname = "entity-tracking"\n[models]\nbase = "smollm2-135m"\n[sets]\nnested = {value!r}\n'.replace(
            "'", '"'
        )
    )
    with pytest.raises(SpecError, match=r"t.toml:6: nested = .* in \[sets\] — give a bool"):
        load_spec(path)
