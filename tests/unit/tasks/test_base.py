"""The task protocol, tasks imported from JSONL files, discovery plans and IOI (SmolLM2's tokenizer, tiny models)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.discovery import DiscoverySettings, discover
from mechdiff.common.components import Head
from mechdiff.common.metrics import task_metric
from mechdiff.patching.path import path_patch
from mechdiff.patching.path_pairs import prepare
from mechdiff.tasks import base, ioi
from mechdiff.tasks.base import get_task
from mechdiff.tasks.jsonl import ImportErrors, import_pairs
from mechdiff.tasks.plan import default_plan, load_plan

NAMES = ("Mary", "John", "Anna", "Tom", "Kate", "Paul", "Emma", "Mark")


def ioi_row(io: str, s: str, c: str) -> dict:
    clean = f"When {io} and {s} went to the store, {s} gave a drink to"
    cf = f"When {io} and {s} went to the store, {c} gave a drink to"
    i = clean.index(" and ")
    s2 = clean.index(", ") + 2
    return {
        "clean": clean,
        "counterfactual": cf,
        "answer": " " + io,
        "counterfactual_answer": " " + io,
        "positions": {"IO": [5, 5 + len(io)], "S1": [i + 5, i + 5 + len(s)], "S2": [s2, s2 + len(s)]},
        "counterfactual_positions": {"IO": [5, 5 + len(io)], "S1": [i + 5, i + 5 + len(s)], "S2": [s2, s2 + len(c)]},
    }


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    rows = [ioi_row(NAMES[i % 8], NAMES[(i + 1) % 8], NAMES[(i + 3) % 8]) for i in range(8)]
    return write_rows(tmp_path / "pairs.jsonl", rows)


# --------------------------------------------------------------------------------------
# The protocol
# --------------------------------------------------------------------------------------


def test_pair_of_unequal_lengths_is_refused_with_both_lengths():
    a = base.Example("a b", (1, 2, 3), " x", 9, {"last": 2})
    b = base.Example("a", (1, 2), " x", 9, {"last": 1})
    with pytest.raises(ValueError, match="3 vs 2 tokens"):
        base.Pair(a, b, " x", 9)


def test_batch_tensors_single_positions_and_position_classes():
    recs = [
        base.Example("p", (5, 6, 7, 8), " a", 3, {"END": 3, "names": (0, 2), "gone": None}, (" b",), (4,)),
        base.Example("q", (1, 2, 3, 4), " c", 8, {"END": 3, "names": (1, 2), "gone": 1}, (" d",), (6,)),
    ]
    t = base.batch_tensors(recs)
    assert t["positions"]["names"].tolist() == [[0, 2], [1, 2]]
    assert t["positions"]["gone"].tolist() == [-1, 1]
    assert t["alternative_ids"].tolist() == [[4], [6]]
    logits = torch.zeros(2, 10)
    logits[0, 3], logits[0, 4], logits[1, 8], logits[1, 6] = 2.0, -1.0, 0.5, 1.5
    assert task_metric(logits, t["answer_ids"], "logit_diff", t["alternative_ids"]).tolist() == [3.0, -1.0]
    with pytest.raises(ValueError, match="different token lengths"):
        base.batch_tensors(recs + [base.Example("r", (1, 2), " a", 3, {"END": 1, "names": (0, 1), "gone": None})])


def test_dataset_hash_of_entity_tracking_records_is_unchanged(smollm2_tokenizer):
    from mechdiff.tasks.entity_tracking import dataset_hash, generate

    recs = generate(smollm2_tokenizer, 3, n_boxes=3, seed=0)
    payload = json.dumps([{"type": "example", **r.to_dict()} for r in recs], sort_keys=True, separators=(",", ":"))
    assert dataset_hash(recs) == base.dataset_hash(recs) == hashlib.sha256(payload.encode()).hexdigest()


def test_registry_aliases_and_unknown_names():
    assert base.get_task("arithmetic-mc").name == "multiple-choice"
    assert base.get_task("arithmetic").name == "arithmetic"
    assert base.get_task("ioi").metric == "logit_diff"
    assert "arithmetic-mc" in base.trainable_tasks() and "ioi" not in base.trainable_tasks()
    with pytest.raises(ValueError, match="unknown task 'nope'.*dataset import"):
        base.get_task("nope")


def test_circuit_takes_any_position_name(tmp_path):
    c = Circuit("m", "ioi", {"NM": [Head(9, 1)], "IND": [Head(3, 0)]}, {"NM": "last", "IND": "after_S2"})
    back = Circuit.load(c.save(tmp_path / "c.json"))
    assert back.positions == {"NM": "last", "IND": "after_S2"} and back.names == {}
    with pytest.raises(ValueError, match="not names"):
        Circuit("m", "t", {"A": []}, {"A": ""})


# --------------------------------------------------------------------------------------
# Tasks from files
# --------------------------------------------------------------------------------------


def test_import_locates_every_position_on_the_token_holding_the_span(smollm2_tokenizer, pairs_file, tmp_path):
    out = import_pairs(pairs_file, smollm2_tokenizer, tmp_path / "task", model="smollm2-135m")
    task = get_task(out)
    pairs = task.discovery_pairs(smollm2_tokenizer, 8)
    assert len(pairs) == 8 and task.metric == "prob"
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    for p, row in zip(pairs, rows):
        for which, text, spans in (
            ("base", row["clean"], row["positions"]),
            ("source", row["counterfactual"], row["counterfactual_positions"]),
        ):
            rec = getattr(p, which)
            for name, (a, b) in spans.items():
                assert smollm2_tokenizer.decode([rec.input_ids[rec.positions[name]]]).strip() == text[a:b]
            assert rec.positions["last"] == len(rec.input_ids) - 1
        assert smollm2_tokenizer.decode([p.base.answer_id]) == row["answer"]
    # IOI-style rows: the counterfactual prompt's answer is the clean one, so no `counterfactual` desideratum
    assert task.desiderata == {} and json.loads((out / "task.json").read_text())["desiderata"] == {}


def test_import_reports_every_bad_row_with_its_line_and_writes_nothing(smollm2_tokenizer, tmp_path):
    good = ioi_row("Mary", "John", "Anna")
    merging = {**ioi_row("Mary", "John", "Anna"), "answer": "ward Mary"}  # " to" + "ward" -> " toward"
    unequal = {**ioi_row("Mary", "John", "Anna"), "counterfactual": "When Mary went home"}
    off_boundary = {**ioi_row("Mary", "John", "Anna"), "positions": {"IO": [6, 9], "S1": [14, 18], "S2": [38, 42]}}
    other_names = {**ioi_row("Mary", "John", "Anna"), "positions": {"IO": [5, 9]}, "counterfactual_positions": None}
    path = write_rows(tmp_path / "bad.jsonl", [good, merging, unequal, "{not json", off_boundary, other_names])
    with pytest.raises(ImportErrors) as err:
        import_pairs(path, smollm2_tokenizer, tmp_path / "task")
    text = str(err.value)
    for line, what in (
        (2, "merges with the prompt's last token"),
        (3, "14 vs 4 tokens"),
        (4, ""),
        (5, "not on token boundaries"),
        (6, "differ from line 1"),
    ):
        assert f"bad.jsonl:{line}: " in text and what in text
    assert "bad.jsonl:1:" not in text
    assert not (tmp_path / "task").exists() and [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_import_command_and_tokenizer_check(smollm2_tokenizer, pairs_file, tmp_path):
    from mechdiff.cli import main

    out = tmp_path / "task"
    assert main(["dataset", "import", str(pairs_file), "--model", "smollm2-135m", "--out", str(out)]) == 0
    assert main(["dataset", "import", str(pairs_file), "--model", "smollm2-135m", "--out", str(out)]) == 2  # exists
    meta = json.loads((out / "task.json").read_text())
    meta["tokenizer"] = "0" * 64
    (out / "task.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="another tokenizer"):
        get_task(out).records(smollm2_tokenizer, 2)


# --------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------


def test_shipped_plans_and_bad_plans(tmp_path):
    plan = default_plan()
    assert [(s.name, s.sender, s.site, s.receiver) for s in plan.steps] == [
        ("A", "last", None, None),
        ("B", "last", "q", "A"),
        ("C", "query_label", "v", "B"),
        ("D", "query_label_context", "v", "C"),
    ]
    assert load_plan(ioi.PLAN).positions() == {"last", "S2"}
    bad = tmp_path / "bad.toml"
    bad.write_text('[steps.X]\nsender = "END"\nreceiver = "Y"\nsite = "q"\nk = 2\n')
    with pytest.raises(ValueError, match="receiver 'Y' is not an earlier step"):
        load_plan(bad)
    bad.write_text('[steps.X]\nsender = "END"\nk = 2\nwhere = 1\n')
    with pytest.raises(ValueError, match="unknown keys \\['where'\\]"):
        load_plan(bad)


def test_a_relative_plan_path_reads_the_file_of_the_current_directory(tmp_path, monkeypatch):
    """Two plan files of the same name, size and modification time in two directories: ``load_plan("plan.toml")``
    after a change of directory reads the second, not the first one's cached parse."""
    for name, k in (("a", 2), ("b", 3)):
        (tmp_path / name).mkdir()
        plan = tmp_path / name / "plan.toml"
        plan.write_text(f'[steps.X]\nsender = "last"\nk = {k}\n')
        os.utime(plan, ns=(10**18, 10**18))
    monkeypatch.chdir(tmp_path / "a")
    assert load_plan("plan.toml").steps[0].k == 2
    monkeypatch.chdir(tmp_path / "b")
    assert load_plan("plan.toml").steps[0].k == 3


def test_user_plan_discovers_on_an_imported_task(tiny_llama, smollm2_tokenizer, pairs_file, tmp_path):
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(
        '[plan]\nname = "movers"\n[steps.M]\ngroup = "mover"\nsender = "last"\nk = 3\n'
        '[steps.Q]\nsender = "S2"\nreceiver = "M"\nsite = "v"\nk = 2\n'
    )
    out = import_pairs(pairs_file, smollm2_tokenizer, tmp_path / "task", plan=plan_path)
    task = get_task(out)
    pairs = task.discovery_pairs(smollm2_tokenizer, 6)
    plan = load_plan(task.plan)
    circuit, steps = discover(
        tiny_llama, pairs, DiscoverySettings(screen=False), task=task.name, progress=False, plan=plan
    )
    assert circuit.positions == {"M": "last", "Q": "S2"} and circuit.names == {"M": "mover", "Q": ""}
    assert circuit.sizes() == {"M": 3, "Q": 2}
    # Step M is an independent path-patching run to the logits: its three most negative senders.
    direct = path_patch(
        tiny_llama,
        prepare(tiny_llama, pairs),
        [Head(l, h) for l in range(3) for h in range(4)],
        "last",
        None,
        progress=False,
    )
    assert circuit.groups["M"] == sorted(direct, key=lambda h: (direct[h], h))[:3]
    assert steps["Q"].receivers.position == "S2" and steps["Q"].receivers.kind == "v"


# --------------------------------------------------------------------------------------
# IOI
# --------------------------------------------------------------------------------------


def test_ioi_positions_answers_and_abc_corruptions(smollm2_tokenizer):
    pairs = ioi.abc_pairs(smollm2_tokenizer, 12, seed=3)
    dec = lambda i: smollm2_tokenizer.decode([i])  # noqa: E731
    for p in pairs:
        b, s = p.base, p.source
        io, subj = b.answer.strip(), b.alternatives[0].strip()
        assert dec(b.input_ids[b.positions["IO"]]).strip() == io == dec(b.answer_id).strip()
        assert dec(b.input_ids[b.positions["S1"]]).strip() == subj == dec(b.input_ids[b.positions["S2"]]).strip()
        assert b.prompt.endswith(" to") and len(b.input_ids) == len(s.input_ids)
        src_names = {dec(s.input_ids[s.positions[k]]).strip() for k in ("IO", "S1", "S2")}
        assert len(src_names) == 3 and not src_names & {io, subj} and p.target_id == b.answer_id
    assert {p.base.positions["IO"] < p.base.positions["S1"] for p in pairs} == {True, False}


def test_the_engine_imports_no_concrete_task():
    import ast

    root = Path(__file__).resolve().parents[3] / "mechdiff"
    engine = [
        *root.glob("models/*.py"),
        *root.glob("patching/*.py"),
        *root.glob("circuits/*.py"),
        root / "methods" / "dcm.py",
        root / "methods" / "cmap.py",
    ]
    assert all(path.is_file() for path in engine) and len(engine) > 20
    offenders = []
    for path in engine:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module or ''}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                (path.name, n)
                for n in names
                if "tasks" in n and not n.split("tasks")[1].startswith((".base", ".desiderata", ".plan"))
            ]
    assert offenders == []


def test_scan_command_on_an_imported_task(tiny_llama, smollm2_tokenizer, pairs_file, tmp_path, monkeypatch):
    """A user's JSONL task scans at its own positions with `--task DIR`, no code change."""
    from mechdiff.cli import main
    from mechdiff.commands import scan as command

    out = import_pairs(pairs_file, smollm2_tokenizer, tmp_path / "task")
    monkeypatch.setattr(command, "load_from_args", lambda name, args, tokenizer=None: tiny_llama)
    monkeypatch.setattr(command, "tokenizer_from_args", lambda name, args: smollm2_tokenizer)
    assert (
        main(
            [
                "scan",
                "--task",
                str(out),
                "--model",
                "tiny",
                "--position",
                "S2",
                "--n",
                "4",
                "--out",
                str(tmp_path / "scan"),
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "scan" / "scan_z_S2.json").read_text())
    assert len(meta["effects"]) == tiny_llama.shape.n_layers and len(meta["effects"][0]) == tiny_llama.shape.n_heads
    assert meta["n_pairs"] == 4


def test_stage_keys_carry_only_the_tasks_own_held_out_vocabulary(monkeypatch):
    """A study's stage keys carry the digest of its task's eval vocabulary: entity tracking's changes with its
    held-out objects (and equals the digest of ``eval_objects()``, which the committed keys were made with); a
    task that does not split its objects (IOI) does not depend on entity tracking's."""
    from mechdiff.runs.stages import key_hash
    from mechdiff.studies.base import vocabulary_digest
    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.entity_tracking import splits

    et, ioi = get_task("entity-tracking"), get_task("ioi")
    before = vocabulary_digest(et), vocabulary_digest(ioi)
    assert before[0] == key_hash(splits.eval_objects())
    monkeypatch.setattr(splits, "HOLDOUT_EVERY", 3)  # another held-out split of the objects
    assert vocabulary_digest(et) != before[0]
    assert vocabulary_digest(ioi) == before[1] == key_hash(None)
