"""Issue 49, items 10-12: a study of any task takes that task's own groups, desiderata, top_k and chance level, never
entity tracking's, and says which it used; answers of several tokens are reported by length."""

from __future__ import annotations

import numpy as np
import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def capitals_dir(tmp_path_factory, smollm2_tokenizer):
    """An imported capitals task (12 distinct answers over 48 rows; no path-patching plan)."""
    from conftest import capitals_rows, write_rows

    from mechdiff.tasks.jsonl import import_pairs

    root = tmp_path_factory.mktemp("capitals")
    rows = write_rows(root / "c.jsonl", capitals_rows(48))
    return str(import_pairs(rows, smollm2_tokenizer, root / "capitals", metric="logit_diff"))


def _study(spec, tokenizer, eval_n: int = 0):
    """A circuits study of ``spec`` without its models (enough for its task, prompt sets and floor); ``eval_n``:
    an imported task's accuracy prompts, every other set cut to a few rows."""
    from mechdiff.studies.circuits.study import CircuitsStudy

    if eval_n:
        spec.eval.n, spec.positions.n, spec.scoring.prune, spec.models.finetunes = eval_n, 0, False, []
        spec.scoring.reference_n = spec.discovery.n = spec.discovery.curve_n = spec.scoring.n = 1
        spec.dcm.n_train = spec.dcm.n_val = spec.dcm.n_test = 1
    study = CircuitsStudy.__new__(CircuitsStudy)
    study.spec, study.tokenizer = spec, tokenizer
    return study


def test_run_task_alone_gets_the_tasks_own_groups_and_desiderata(capitals_dir, tmp_path):
    """`mechdiff run --task DIR` (no task file) gets no groups, desiderata or top_k of entity tracking: DCM and CMAP
    then take every group of the task's circuit; a task file whose groups or desiderata are not the new task's is
    refused, naming them; path patching on a task without a plan is refused, never given entity tracking's."""
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.common.components import Head
    from mechdiff.studies.circuits.spec import default_spec, study_spec
    from mechdiff.studies.circuits.stages.groups import group_choice
    from mechdiff.studies.spec import SpecError
    from mechdiff.tasks.base import get_task

    spec = study_spec(None, capitals_dir)
    assert spec.task.name == capitals_dir
    assert (spec.dcm.groups, spec.cmap.groups, spec.dcm.desiderata, spec.discovery.top_k) == ([], [], [], {})
    assert study_spec(None).dcm.groups == default_spec().dcm.groups == ["last", "query_label"]  # the default study
    # the circuit of the capitals run: heads at last, country and after_country; every group is analysed
    heads = {"last": [Head(1, 0)], "country": [Head(0, 1)], "after_country": [Head(1, 2)]}
    circuit = Circuit("m", "capitals", heads, {g: g for g in heads})
    task = get_task(capitals_dir)
    assert group_choice(task, [], circuit, spec.dcm.groups, check=False)[0] == ["last", "country", "after_country"]
    # what today's default gave the same circuit: entity tracking's groups cut it to `last`
    assert group_choice(task, [], circuit, default_spec().dcm.groups, check=False)[0] == ["last"]
    with pytest.raises(SpecError, match=r"entity_tracking.toml: \[dcm\] groups names \['query_label'\], which task"):
        study_spec(ROOT / "tasks" / "entity_tracking.toml", capitals_dir)
    path = tmp_path / "path.toml"
    path.write_text('[models]\nbase = "smollm2-135m"\n\n[discovery]\nmethod = "path"\n\n[task]\nname = "ioi"\n')
    with pytest.raises(SpecError, match="has no path-patching plan: discover its circuit by the curve"):
        study_spec(path, capitals_dir)
    path.write_text(path.read_text().replace('"ioi"', f'"{capitals_dir}"'))
    with pytest.raises(SpecError, match=r"path.toml:5: task .* has no path-patching plan"):
        study_spec(path)


def test_circuit_keys_carry_the_top_k_the_study_uses():
    """A path study keys each step's top_k as it runs (the file's where it names the step, else the plan's): IOI
    with top_k unset keys IOI's plan k, not entity tracking's A-D; entity tracking unset keys its plan's A-D, the
    committed value; a curve study, which reads none, keys the committed constant whatever the file sets."""
    from mechdiff.studies.circuits.spec import DiscoverySection, discovery_inputs, section_inputs
    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.plan import task_plan

    ioi, et = task_plan(get_task("ioi")).k, task_plan(get_task("entity-tracking")).k
    path = DiscoverySection(method="path")
    assert discovery_inputs(path, ioi)["top_k"] == {"NM": 6, "SI": 4, "IND": 4} == ioi
    assert section_inputs("discovery", path)["top_k"] == {"A": 8, "B": 3, "C": 5, "D": 3}  # what keyed it before
    assert discovery_inputs(DiscoverySection(method="path", top_k={"SI": 9}), ioi)["top_k"] == {**ioi, "SI": 9}
    assert discovery_inputs(path, et)["top_k"] == section_inputs("discovery", path)["top_k"]  # unchanged for ET
    curve = discovery_inputs(DiscoverySection(top_k={"NM": 2}))
    assert curve == section_inputs("discovery", DiscoverySection())  # the committed curve studies' key


def test_an_imported_tasks_floor_is_chance_among_its_answers(capitals_dir, tmp_path, smollm2_tokenizer):
    """Without [eval] floor, an imported task's floor is one over the distinct answers of its accuracy prompts (a
    two-way task: 0.5, where the fixed 0.1 let a model at chance through), said in words; a set floor or the task's
    own chance level is used as before."""
    from conftest import capitals_rows, write_rows

    from mechdiff.studies.circuits.spec import study_spec
    from mechdiff.tasks.base import answer_chance
    from mechdiff.tasks.jsonl import import_pairs

    rows = capitals_rows(40)
    for i, r in enumerate(rows):  # two answers: Paris or Rome
        r["answer"], r["counterfactual_answer"] = (" Paris", " Rome") if i % 2 else (" Rome", " Paris")
    two_way = str(import_pairs(write_rows(tmp_path / "two.jsonl", rows), smollm2_tokenizer, tmp_path / "two"))
    study = _study(study_spec(None, two_way), smollm2_tokenizer, eval_n=20)
    floor, how = study.floor_is()
    assert floor == 0.5 and study.floor() == 0.5
    assert how == "chance: one over the 2 distinct answers of the 20 accuracy prompts"
    study = _study(study_spec(None, capitals_dir), smollm2_tokenizer, eval_n=30)
    records = study.eval_records()
    answers = {r.answer for r in records}
    assert study.floor() == pytest.approx(1 / len(answers)) and 1 < len(answers) <= 12
    assert answer_chance(records)[0] == study.floor()
    study.spec.eval.floor = 0.3
    assert study.floor_is() == (0.3, "set by the task file's [eval] floor")
    ioi = _study(study_spec(None, "ioi"), smollm2_tokenizer)
    assert ioi.floor_is() == (0.5, "the task's chance level")


def test_eval_reports_accuracy_by_answer_length(smollm2_tokenizer):
    """Accuracy and the task's metric per answer length (1, 2, 3+ tokens), each against its own count; nothing
    where every answer has one length."""
    from mechdiff.patching.evaluate import EvalResult, by_answer_length
    from mechdiff.tasks.base import Example

    def record(n_tokens: int) -> Example:
        tokens = tuple(range(100, 100 + n_tokens))
        return Example("p", (1, 2), "a", tokens[0], answer_tokens=tokens if n_tokens > 1 else ())

    lengths = [1, 2, 3, 4, 1, 1, 2, 5, 3, 1]
    records = [record(n) for n in lengths]
    correct = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 1], bool)
    diff = np.arange(10, dtype=float)
    rows = EvalResult(correct, np.full(10, 0.5), diff).by_answer_length(records, "logit_diff")
    assert [(r["answer_tokens"], r["n"]) for r in rows] == [("1", 4), ("2", 2), ("3+", 4)]
    for r, members in zip(rows, ([0, 4, 5, 9], [1, 6], [2, 3, 7, 8])):
        assert r["accuracy"].value == pytest.approx(correct[members].mean())
        assert r["logit_diff"].value == pytest.approx(diff[members].mean())
        assert r["accuracy"].low <= r["accuracy"].value <= r["accuracy"].high
    prob = EvalResult(correct, np.linspace(0, 1, 10)).by_answer_length(records, "prob")
    assert prob[2]["answer_prob"].value == pytest.approx(np.linspace(0, 1, 10)[[2, 3, 7, 8]].mean())
    assert by_answer_length(records[:1] + records[4:6], correct[[0, 4, 5]]) == []  # one length: no split


def test_import_warns_about_answers_that_split_a_word_or_share_a_first_token(smollm2_tokenizer, tmp_path):
    """One line per kind with its count: answers without a leading space that split a word ("Madrid" -> 'Mad' +
    'rid'), and rows whose answer shares its first token with a different counterfactual answer (" New Delhi" /
    " New York"); the rows are imported all the same, and clean rows give no warning."""
    from conftest import capitals_rows, write_rows

    from mechdiff.tasks.jsonl import import_pairs

    rows = capitals_rows(12, templates=("short",))
    clean: list[str] = []
    import_pairs(write_rows(tmp_path / "ok.jsonl", rows), smollm2_tokenizer, tmp_path / "ok", warn=clean.append)
    # the conftest rows name an after_country class that the "short" template leaves empty: only that warning
    assert [w for w in clean if not w.startswith("class 'after_country' is empty")] == []
    rows[0]["answer"] = "Madrid"  # 'Mad' + 'rid'
    rows[1]["counterfactual_answer"] = "Canberra"  # 'Can' + 'berra'
    rows[2]["answer"] = "Paris"  # one token without its space: no word split
    rows[3]["answer"], rows[3]["counterfactual_answer"] = " New Delhi", " New York"
    rows[4]["answer"], rows[4]["counterfactual_answer"] = " San Jose", " San Salvador"
    said: list[str] = []
    out = import_pairs(write_rows(tmp_path / "bad.jsonl", rows), smollm2_tokenizer, tmp_path / "bad", warn=said.append)
    said = [w for w in said if not w.startswith("class 'after_country' is empty")]
    assert len(said) == 2 and (out / "pairs.jsonl").is_file()
    assert said[0].startswith("2 answers without a leading space split a word") and "'Madrid'" in said[0]
    assert said[1].startswith("2 of 12 rows have an answer that shares its first token with the counterfactual")
    assert "' New Delhi'/' New York'" in said[1]


def test_mechdiff_eval_prints_and_writes_accuracy_by_answer_length(smollm2_tokenizer, tmp_path):
    """`mechdiff eval` on a task whose answers have several lengths: a table by answer length, and in the JSON each
    length's prompts, accuracy and logit difference, as counted from the per-prompt outcomes it writes."""
    import json

    from conftest import capitals_rows, make_tiny, write_rows

    from mechdiff.studies.circuits.evaluation import eval_models
    from mechdiff.tasks.base import answer_tokens, get_task
    from mechdiff.tasks.jsonl import import_pairs

    rows = capitals_rows(12, templates=("short",))
    for r, (a, b) in zip(rows, [(" New Delhi", " Rome"), (" San Salvador", " Kuala Lumpur"), (" Reykjavik", " Oslo")]):
        r["answer"], r["counterfactual_answer"] = a, b
    task_dir = import_pairs(
        write_rows(tmp_path / "c.jsonl", rows), smollm2_tokenizer, tmp_path / "t", metric="logit_diff"
    )
    task = get_task(str(task_dir))
    lm = make_tiny("llama", smollm2_tokenizer, n_layers=1)
    table = eval_models([lm], task, 12, 0, {}, "eval", 4, tmp_path / "eval.json")
    assert "by answer length" in table
    got = json.loads((tmp_path / "eval.json").read_text())[lm.name]
    records = task.records(smollm2_tokenizer, 12, 0)
    lengths = np.array([min(len(answer_tokens(r)), 3) for r in records])
    correct, diff = np.array(got["correct"]), np.array(got["outcomes"]["logit_diff"])
    assert [(r["answer_tokens"], r["n"]) for r in got["by_answer_length"]] == [("1", 9), ("2", 2), ("3+", 1)]
    for r, n in zip(got["by_answer_length"], (1, 2, 3)):
        assert r["accuracy"]["value"] == pytest.approx(correct[lengths == n].mean())
        assert r["logit_diff"]["value"] == pytest.approx(diff[lengths == n].mean(), rel=1e-5)  # outcomes: 6 digits
    # by first token against the rest (#49 item 12), from the per-prompt outcomes it keeps
    first, rest = (np.array([c == "1" for c in got["outcomes"][k]]) for k in ("first", "rest"))
    assert "first token [95% CI]" in table and (correct == (first & rest)).all()
    for r, n in zip(got["by_answer_length"], (1, 2, 3)):
        assert r["first_token"]["value"] == pytest.approx(first[lengths == n].mean())
        assert (r["rest"] is None) == (n == 1) and (
            n == 1 or r["rest"]["value"] == pytest.approx(rest[lengths == n].mean())
        )
