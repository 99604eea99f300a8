"""``mechdiff tasks`` (#52 item 6): registered tasks, knowledge relations and imported task directories, each with
what a study reads (rows, items, templates, token lengths, metric, desiderata), counted here from the rows."""

from __future__ import annotations

import json
from collections import Counter

from conftest import capitals_rows, write_rows

from mechdiff.cli import main
from mechdiff.tasks.base import TASKS
from mechdiff.tasks.catalog import imported_summary, relation_tasks, task_directories
from mechdiff.tasks.jsonl import import_pairs
from mechdiff.tasks.relation_data import DATA_DIR


def test_tasks_command_lists_every_kind_with_counts_from_the_rows(smollm2_tokenizer, tmp_path, capsys):
    rows = capitals_rows(20)
    rows[0]["template"] = rows[1]["template"]  # uneven templates, so the counts per template are not all equal
    rows[0]["clean"], rows[0]["counterfactual"] = rows[1]["clean"], rows[1]["counterfactual"]
    rows[0]["positions"], rows[0]["counterfactual_positions"] = (
        rows[1]["positions"],
        rows[1]["counterfactual_positions"],
    )
    out = import_pairs(write_rows(tmp_path / "rows.jsonl", rows), smollm2_tokenizer, tmp_path / "tasks" / "caps")
    (tmp_path / "tasks" / "notes").mkdir()  # a folder that is no task: skipped
    assert task_directories(tmp_path / "tasks") == [out] and task_directories(out) == [out]
    s = imported_summary(out)
    assert s.rows == 20 and s.items == len({r["clean"] for r in rows}) == 19
    assert s.templates == dict(sorted(Counter(r["template"] for r in rows).items()))
    assert s.lengths == tuple(sorted({len(smollm2_tokenizer(r["clean"])["input_ids"]) for r in rows}))
    assert s.metric == "prob" and s.positions == ("capital", "country", "last")
    assert s.desiderata == {"counterfactual": "counterfactual_answer, 20 rows move"}
    assert main(["tasks", str(tmp_path / "tasks")]) == 0
    text = capsys.readouterr().out
    for name in TASKS:
        assert f"\n{name} " in text
    facts = {p.stem: len(json.loads(p.read_text())["samples"]) for p in DATA_DIR.glob("*.json")}
    assert {r.name: r.facts for r in relation_tasks() if "/" not in r.name} == facts
    assert f"{out}  (task caps; imported from {tmp_path / 'rows.jsonl'} for ?; --task {out})" in text
    templates = ", ".join(f"{t} {n}" for t, n in s.templates.items())
    assert f"  rows 20 over 19 items (distinct clean prompts); metric prob\n  templates (rows): {templates}" in text
    assert "DCM desiderata: counterfactual (counterfactual_answer, 20 rows move)" in text
    assert main(["tasks", str(tmp_path / "none")]) == 0 and "\n  none\n" in capsys.readouterr().out
