"""A new user's first import (#52 item 6): every bad row of every kind in one pass, both token lists where a pair's
lengths differ, and warnings, with counts per template, where a named position falls on the last token or a class
is empty; the study report's limitations list the empty classes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mechdiff.cli import main
from mechdiff.studies.circuits.report.run import limitations
from mechdiff.tasks.base import get_task
from mechdiff.tasks.jsonl import ImportErrors, import_pairs
from mechdiff.tasks.row_checks import task_empty_classes

#: Two phrasings of subject-verb agreement: in ``end`` the attractor is the prompt's last word.
TEMPLATES = {"end": "The {s} to the {a}", "mid": "The {s} to the {a} on the left"}
SUBJECTS = [("keys", "key", " are", " is"), ("dogs", "dog", " are", " is")]
ATTRACTORS = ["cabinet", "house", "car"]


def agreement_row(template: str, s: tuple, attractor: str) -> dict:
    clean = TEMPLATES[template].format(s=s[0], a=attractor)
    cf = TEMPLATES[template].format(s=s[1], a=attractor)
    spans = {
        "subject": [4, 4 + len(s[0])],
        "attractor": [clean.index(attractor), clean.index(attractor) + len(attractor)],
    }
    cf_spans = {"subject": [4, 4 + len(s[1])], "attractor": [cf.index(attractor), cf.index(attractor) + len(attractor)]}
    return {
        "clean": clean,
        "counterfactual": cf,
        "answer": s[2],
        "counterfactual_answer": s[3],
        "template": template,
        "positions": spans,
        "counterfactual_positions": cf_spans,
        "number": s[0],
    }


def agreement_rows() -> list[dict]:
    return [agreement_row(t, s, a) for t in TEMPLATES for s in SUBJECTS for a in ATTRACTORS]


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def spelled(tokenizer, text: str) -> list[str]:
    """``text``'s tokens as the vocabulary spells them, byte-level space marker turned back into a space."""
    return [t.replace("\u0120", " ") for t in tokenizer.tokenize(text)]


def test_a_file_with_bad_rows_of_every_kind_gets_all_of_them_in_one_run(smollm2_tokenizer, tmp_path):
    """Spans off token boundaries and an answer merging into the prompt (one row), lengths that differ (with both
    token lists), a missing counterfactual_answer under logit_diff, a missing --item field, a bad desideratum entry
    and a line that is not JSON: one ImportErrors names each, and nothing is written."""
    rows = agreement_rows()
    rows[1]["positions"]["subject"] = [5, 8]  # "eys": not on token boundaries
    rows[1]["answer"] = "n"  # "cabinet" + "n": merges with the prompt's last token
    rows[2]["counterfactual"] = "The key to the cabinets and the car"  # more tokens than the clean prompt
    del rows[3]["counterfactual_answer"]
    del rows[4]["number"]
    rows[5]["swapped"] = 7  # the desideratum's target must be a string
    for r in rows[:5] + rows[6:]:
        r["swapped"] = r.get("counterfactual_answer", " is")
    path = write_rows(tmp_path / "rows.jsonl", [*rows, "{not json"])
    with pytest.raises(ImportErrors) as err:
        import_pairs(
            path, smollm2_tokenizer, tmp_path / "t", metric="logit_diff", desiderata=["swapped=swapped"], item="number"
        )
    text = str(err.value)
    clean, cf = rows[2]["clean"], rows[2]["counterfactual"]
    a, b = spelled(smollm2_tokenizer, clean), spelled(smollm2_tokenizer, cf)
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    for expected in (
        f"{path}:2: position 'subject': 'eys' at [5, 8] is not on token boundaries",
        f"{path}:2: answer 'n' merges with the prompt's last token",
        f"{path}:3: clean and counterfactual differ in token length: {len(a)} vs {len(b)} tokens",
        f"(first difference at token {first}); clean tokens {a}; counterfactual tokens {b}",
        f"metric logit_diff needs a counterfactual_answer in every row of {path}; lines 4 give none",
        f"--item number: every row of {path} needs a key 'number'",
        f"{path}:6: desideratum swapped: column 'swapped' must hold the target answer",
        f"{path}:{len(rows) + 1}: Expecting property name",
    ):
        assert expected in text
    assert text.startswith(f"8 problem(s) in {path}; nothing was written:\n{path}:2: ")  # sorted by line
    assert f"{path}:1:" not in text and not (tmp_path / "t").exists()


def test_named_positions_on_the_last_token_and_empty_classes_are_warned_with_counts_per_template(
    smollm2_tokenizer, tmp_path, capsys
):
    rows = agreement_rows()
    path = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "task"
    assert main(["dataset", "import", str(path), "--model", "smollm2-135m", "--out", str(out), "--item", "number"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    # by hand: in "end" the attractor is the prompt's last word, one token each; in "mid" it is not
    for r in rows:
        last = len(spelled(smollm2_tokenizer, r["clean"])) - 1
        n_before = len(spelled(smollm2_tokenizer, r["clean"][: r["positions"]["attractor"][0]].rstrip()))
        assert (n_before == last) == (r["template"] == "end")
    assert warned[0] == (
        "warning: position 'attractor' falls on the last token ('end': 6 of 6 rows): that token is always the class "
        "'last', so 'attractor' holds no token there; name a token before the last"
    )
    assert "warning: class 'attractor' is empty ('end': 6 of 6 rows)" in warned
    assert "warning: class 'after_attractor' is empty ('end': 6 of 6 rows)" in warned
    assert len(warned) == 3  # "mid" has every class; "before", "subject" and "after_subject" are never empty
    task = get_task(out)
    empty = {"attractor": {"end": (6, 6)}, "after_attractor": {"end": (6, 6)}}
    assert task_empty_classes(task) == empty
    study = SimpleNamespace(
        task=task,
        spec=SimpleNamespace(
            discovery=SimpleNamespace(method="curve"),
            scoring=SimpleNamespace(prune=False),
            cmap=SimpleNamespace(n_random=0),
        ),
    )
    text = limitations(study, {})
    assert (
        "- Position classes empty in some prompts: `attractor` ('end': 6 of 6 rows); `after_attractor` ('end': 6 of 6 "
        "rows)." in text
    )
    mid = write_rows(tmp_path / "mid.jsonl", [r for r in rows if r["template"] == "mid"])
    lines: list[str] = []
    import_pairs(mid, smollm2_tokenizer, tmp_path / "mid", warn=lines.append, item="number")
    assert lines == [] and task_empty_classes(get_task(tmp_path / "mid")) == {}
    assert "Position classes empty" not in limitations(
        SimpleNamespace(**{**vars(study), "task": get_task(tmp_path / "mid")}), {}
    )
