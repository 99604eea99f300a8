"""Desiderata a task declares (#40 item 4) and a row's own classes covering every token (#40 item 5): import,
round trip, the drawn DCM set's rows, and refusals with their lines before anything is written."""

from __future__ import annotations

import json

import pytest
from conftest import capitals_rows, write_rows

from mechdiff.tasks.base import get_task
from mechdiff.tasks.declared import parse_declaration
from mechdiff.tasks.jsonl import ImportErrors, import_pairs
from mechdiff.tasks.records import answer_tokens, target_tokens
from mechdiff.tasks.task_directory import read_task_directory


def two_desiderata(tmp_path, n: int = 24) -> tuple[list[dict], list[str]]:
    """Capitals rows with a column ``swapped`` (the counterfactual country's capital) and a file ``rome.jsonl``
    (target " Rome", from a counterfactual prompt of its own): the two declarations."""
    rows = capitals_rows(n)
    for r in rows:
        r["swapped"] = r["counterfactual_answer"]
    own = [{"target": " Rome", "counterfactual": r["clean"]} for r in rows]  # a prompt of its own (here: the clean)
    write_rows(tmp_path / "rome.jsonl", own)
    return rows, ["swapped=swapped", f"rome={tmp_path / 'rome.jsonl'}"]


def test_two_declared_desiderata_import_and_round_trip(smollm2_tokenizer, tmp_path):
    rows, declared = two_desiderata(tmp_path)
    out = import_pairs(write_rows(tmp_path / "p.jsonl", rows), smollm2_tokenizer, tmp_path / "t", desiderata=declared)
    meta = json.loads((out / "task.json").read_text())
    assert list(meta["desiderata"]) == ["swapped", "rome"]
    assert meta["desiderata"]["swapped"] == {
        "target": "column swapped",
        "pairs": "desiderata/swapped.jsonl",
        "moved": 24,
    }
    rome = [r["answer"] != " Rome" for r in rows]
    assert meta["desiderata"]["rome"]["moved"] == sum(rome) < 24  # rows whose answer is Rome: nothing to move
    task = get_task(out)
    assert sorted(task.desiderata) == ["rome", "swapped"]  # declared: the implicit counterfactual is not added
    swapped = task.desideratum("swapped", smollm2_tokenizer, 24)
    assert [p.target for p in swapped] == [r["counterfactual_answer"] for r in rows]
    assert [p.source.prompt for p in swapped] == [r["counterfactual"] for r in rows]
    assert all(p.kind == "swapped" and p.target_id == smollm2_tokenizer.encode(p.target)[0] for p in swapped)
    own = task.desideratum("rome", smollm2_tokenizer, 24)
    assert all(p.target == " Rome" and p.source.prompt == p.base.prompt for p in own)  # its own counterfactual
    assert [p.base for p in own] == task.records(smollm2_tokenizer, 24)
    again = read_task_directory(out)
    assert again.desiderata["rome"] == own and again.desiderata["swapped"] == swapped  # the JSONL round trip
    digest = again.rows_digest
    (out / "desiderata" / "rome.jsonl").write_text((out / "desiderata" / "rome.jsonl").read_text().replace("Rome", "R"))
    assert read_task_directory(out).rows_digest != digest  # stage keys know a desideratum's rows too


def test_rows_may_declare_their_own_desiderata_and_counterfactual_still_works(smollm2_tokenizer, tmp_path):
    rows = capitals_rows(8)
    plain = import_pairs(write_rows(tmp_path / "plain.jsonl", rows), smollm2_tokenizer, tmp_path / "plain")
    meta = json.loads((plain / "task.json").read_text())["desiderata"]
    assert meta == {"counterfactual": {"target": "counterfactual_answer", "pairs": None, "moved": 8}}
    cf = get_task(plain).desideratum("counterfactual", smollm2_tokenizer, 8)
    assert [p.target for p in cf] == [r["counterfactual_answer"] for r in rows]
    old = json.loads((plain / "task.json").read_text())
    del old["desiderata"]  # a task imported before desiderata were declared: counterfactual, as it was
    (plain / "task.json").write_text(json.dumps(old))
    assert list(get_task(plain).desiderata) == ["counterfactual"]
    for r in rows:
        r["desiderata"] = {"lima": {"target": " Lima"}}
    out = import_pairs(write_rows(tmp_path / "inline.jsonl", rows), smollm2_tokenizer, tmp_path / "inline")
    task = get_task(out)
    assert list(task.desiderata) == ["lima"]
    assert json.loads((out / "task.json").read_text())["desiderata"]["lima"]["target"] == "the rows' desiderata"
    assert {p.target for p in task.desideratum("lima", smollm2_tokenizer, 8)} == {" Lima"}


def test_each_desideratum_reads_the_rows_of_the_drawn_dcm_set(smollm2_tokenizer, tmp_path):
    rows, declared = two_desiderata(tmp_path, 48)
    out = import_pairs(write_rows(tmp_path / "p.jsonl", rows), smollm2_tokenizer, tmp_path / "t", desiderata=declared)
    task, sets = get_task(out).draw_prompt_sets({"reference": 8, "eval": 12, "dcm": 16, "cmap": 8}, seed=3)
    clean = [r["clean"] for r in rows]
    for name in ("swapped", "rome"):
        pairs = task.desideratum(name, smollm2_tokenizer, 16, prompt_set="dcm")
        assert [clean.index(p.base.prompt) for p in pairs] == sets["dcm"]
        others = {i for s, rows_of in sets.items() if s != "dcm" for i in rows_of}
        assert not others & {clean.index(p.base.prompt) for p in pairs}


def test_bad_desiderata_are_refused_with_their_lines_and_nothing_is_written(smollm2_tokenizer, tmp_path):
    rows, declared = two_desiderata(tmp_path, 6)
    del rows[2]["swapped"]
    rows[4]["swapped"] = "n"  # "is" + "n" -> "isn": merges with the prompt's last token
    bad = write_rows(tmp_path / "own.jsonl", [{"target": " Rome"}, "{no", {"target": " Rome", "counterfactual": "A"}])
    path = write_rows(tmp_path / "p.jsonl", rows)
    with pytest.raises(ImportErrors) as err:
        import_pairs(path, smollm2_tokenizer, tmp_path / "t", desiderata=["swapped=swapped"])
    text = str(err.value)
    assert f"{path}:3: desideratum swapped: column 'swapped' must hold the target answer" in text
    assert f"{path}:5: desideratum swapped: answer 'n' merges with the prompt's last token" in text
    assert f"{path}:1:" not in text and not (tmp_path / "t").exists()
    path = write_rows(tmp_path / "plain.jsonl", capitals_rows(6))
    with pytest.raises(ImportErrors, match="own.jsonl has 3 rows and .*plain.jsonl 6"):
        import_pairs(path, smollm2_tokenizer, tmp_path / "t", desiderata=[f"own={bad}"])
    lines = [{"target": " Rome"}, "{no", {"target": " Rome", "counterfactual": "A"}, *[{"target": " Rome"}] * 3]
    bad.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    with pytest.raises(ImportErrors) as err:
        import_pairs(path, smollm2_tokenizer, tmp_path / "t", desiderata=[f"own={bad}"])
    text = str(err.value)
    assert f"{bad}:2: desideratum own: Expecting" in text and f"{bad}:3: desideratum own: the counterfactual" in text
    assert "differ in token length" in text and f"{bad}:1" not in text
    same = capitals_rows(6)
    for r in same:
        r["same"] = r["answer"]
    with pytest.raises(ImportErrors, match=r"desideratum same \(column same\): the target is the clean answer on ev"):
        import_pairs(
            write_rows(tmp_path / "s.jsonl", same), smollm2_tokenizer, tmp_path / "t", desiderata=["same=same"]
        )
    with pytest.raises(ValueError, match="write NAME=COLUMN"):
        import_pairs(path, smollm2_tokenizer, tmp_path / "t", desiderata=["swapped"])
    with pytest.raises(FileNotFoundError, match="desideratum x: file nope.jsonl does not exist"):
        parse_declaration("x=nope.jsonl")
    inline = capitals_rows(3)
    inline[0]["desiderata"], inline[1]["desiderata"] = {"a": {"target": " Rome"}}, {"b": {"target": " Rome"}}
    with pytest.raises(ImportErrors, match=r"i.jsonl:2: desiderata \['b'\] differ from line 1's \['a'\]"):
        import_pairs(write_rows(tmp_path / "i.jsonl", inline), smollm2_tokenizer, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_logit_diff_that_is_always_zero_is_refused(smollm2_tokenizer, tmp_path):
    rows = capitals_rows(5)
    for r in rows:
        r["counterfactual_answer"] = r["answer"]
    with pytest.raises(ImportErrors, match=r"counterfactual_answer equals answer on every row .* \(lines 1-5\)"):
        import_pairs(write_rows(tmp_path / "p.jsonl", rows), smollm2_tokenizer, tmp_path / "t", metric="logit_diff")
    del rows[3]["counterfactual_answer"]
    with pytest.raises(ImportErrors, match="needs a counterfactual_answer in every row .*; lines 4 give none"):
        import_pairs(write_rows(tmp_path / "p.jsonl", rows), smollm2_tokenizer, tmp_path / "t", metric="logit_diff")
    task = get_task(import_pairs(tmp_path / "p.jsonl", smollm2_tokenizer, tmp_path / "t"))  # prob: accepted
    assert task.desiderata == {}  # no row's counterfactual moves the answer: no counterfactual desideratum
    assert all(target_tokens(p) == answer_tokens(p.base) for p in task.discovery_pairs(smollm2_tokenizer, 4))


def test_a_rows_own_classes_hold_last_and_the_rest_and_never_overlap(smollm2_tokenizer, tmp_path):
    rows = capitals_rows(4, classes=True)
    n_chars = len(rows[0]["clean"])
    rows[0]["classes"]["all"] = [[0, n_chars]]  # overlaps words
    rows[1]["classes"] = {"words": rows[1]["classes"]["words"], "last": [[0, 3]]}
    rows[2]["classes"] = {
        "words": rows[2]["classes"]["words"],
        "end": [[len(rows[2]["clean"]) - 2, len(rows[2]["clean"])]],
    }
    with pytest.raises(ImportErrors) as err:
        import_pairs(write_rows(tmp_path / "c.jsonl", rows), smollm2_tokenizer, tmp_path / "t")
    text = str(err.value)
    assert "c.jsonl:1: classes 'words' and 'all' both cover token 1 (' capital')" in text
    assert "c.jsonl:2: class 'last' is always the final token" in text
    assert "c.jsonl:3: classes ['end'] cover only the final token" in text and "c.jsonl:4" not in text
    rows = capitals_rows(4, classes=True)
    rows[0]["classes"]["words"] = [[0, len(rows[0]["clean"])]]  # covers every token, the final one too
    task = get_task(import_pairs(write_rows(tmp_path / "c.jsonl", rows), smollm2_tokenizer, tmp_path / "t"))
    records = task.records(smollm2_tokenizer, 4)
    assert records[0].classes["rest"] == ()  # every row gets `rest`: empty where its classes cover every token
    for r in records:
        n = len(r.input_ids)
        assert r.classes["last"] == (n - 1,) and n - 1 not in r.classes["words"]
        assert sorted(t for c in r.classes.values() for t in c) == list(range(n))  # a partition of the prompt
    assert json.loads((tmp_path / "t" / "task.json").read_text())["classes"] == ["last", "rest", "words"]
