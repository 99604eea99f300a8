"""Knowledge relations on the task protocol: records with ``subject``, ``relation`` and ``last`` at the tokens a
direct tokenization puts them, equal-length counterfactual pairs, and the CLI (eval, scan, circuit) on a
tiny saved model; a bad relation name, or a relation that cannot pair its facts, is refused before weights load."""

from __future__ import annotations

import json

import pytest
import torch

from mechdiff.tasks.base import batch_tensors, get_task, group_key, grouped_batches, task_names
from mechdiff.tasks.relation_data import Relation, available_relations
from mechdiff.tasks.relations import POSITIONS

SHIPPED = [r for r in available_relations() if not r.startswith("edits/")]


def expected_positions(tokenizer, template: str, subject: str) -> tuple[list[int], dict[str, int]]:
    """Token ids and positions from the prompt tokenised whole: the subject's characters located through the
    offset mapping, independently of the task's code."""
    prompt = template.format(subject)
    enc = tokenizer(prompt, return_offsets_mapping=True)
    start = template.index("{}")
    end = start + len(subject)
    subject_tokens = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    last = len(enc["input_ids"]) - 1
    relation = max(t for t in range(last) if t not in subject_tokens)
    return list(enc["input_ids"]), {"subject": max(subject_tokens), "relation": relation, "last": last}


@pytest.mark.parametrize("name", SHIPPED)
def test_relation_records_name_positions_at_the_right_tokens(name, smollm2_tokenizer):
    tok = smollm2_tokenizer
    relation = Relation.load(name)
    records = get_task(name).records(tok, 10_000)
    assert len(records) == len(relation.samples) * len(relation.prompt_templates)  # none left out for SmolLM2
    by_prompt = {r.prompt: r for r in records}
    for template in relation.prompt_templates:
        for sample in relation.samples:
            r = by_prompt[template.format(sample["subject"])]
            ids, positions = expected_positions(tok, template, sample["subject"])
            assert list(r.input_ids) == ids and r.positions == positions and r.template == template
            assert tok.decode(ids[positions["subject"]]).strip() and sample["subject"].endswith(
                tok.decode(ids[positions["subject"]]).strip()
            )
            full = tok(template.format(sample["subject"]) + " " + sample["object"])["input_ids"]
            assert r.answer_id == full[len(ids)] and (" " + sample["object"]).startswith(r.answer)


def test_relation_records_batch_in_groups_with_derived_classes(smollm2_tokenizer):
    task = get_task("country_capital")
    records = task.records(smollm2_tokenizer, 200)
    assert {group_key(r)[0] for r in records} == set(Relation.load("country_capital").prompt_templates)
    assert len({len(r.input_ids) for r in records}) > 1  # several token lengths
    for rows in grouped_batches(records, 16):
        t = batch_tensors([records[i] for i in rows])
        classes = t["position_classes"]
        assert list(classes) == ["before", "subject", "after_subject", "relation", "after_relation", "last"]
        assert torch.equal(sum(m.int() for m in classes.values()), torch.ones_like(t["input_ids"]))  # a partition
        batch = torch.arange(len(rows))
        for name in POSITIONS:
            assert classes[name][batch, t["positions"][name]].all()
    assert set(task.positions) >= {*POSITIONS, "after_subject"}


def test_relation_prompt_sets_are_seeded_permutations(smollm2_tokenizer):
    task = get_task("country_capital")
    a, b = task.records(smollm2_tokenizer, 20, seed=0), task.records(smollm2_tokenizer, 20, seed=1)
    assert a == task.records(smollm2_tokenizer, 20, seed=0) and a != b
    every = task.records(smollm2_tokenizer, 10_000, seed=3)
    assert sorted(r.prompt for r in every) == sorted(r.prompt for r in task.records(smollm2_tokenizer, 10_000))


def test_relation_pairs_swap_the_subject_within_one_template_and_length(smollm2_tokenizer):
    task = get_task("country_capital")
    records = task.records(smollm2_tokenizer, 10_000)
    groups: dict = {}
    for r in records:
        groups.setdefault(group_key(r), set()).add(r.answer_id)
    pairable = sum(1 for r in records if len(groups[group_key(r)]) > 1)
    pairs = task.discovery_pairs(smollm2_tokenizer, 10_000)
    assert len(pairs) == pairable < len(records)  # the one 8-token prompt has no partner
    for p in pairs:
        assert group_key(p.base) == group_key(p.source) and p.base.prompt != p.source.prompt
        assert p.base.answer_id != p.source.answer_id and p.target_id == p.base.answer_id
    moved = task.desideratum("subject", smollm2_tokenizer, 10)
    assert all(p.target_id == p.source.answer_id for p in moved)


def test_unknown_relation_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="did you mean country_capital") as err:
        get_task("country_capitol")
    for name in SHIPPED:
        assert name in str(err.value)
    assert set(SHIPPED) <= set(task_names())


def unpairable(path):
    """A relation file whose facts have subjects of 1, 2 and 3 tokens: no two prompts of one length."""
    path.write_text(
        json.dumps(
            {
                "name": "lonely",
                "prompt_templates": ["The capital of {} is"],
                "samples": [
                    {"subject": "France", "object": "Paris"},
                    {"subject": "Burkina Faso", "object": "Ouagadougou"},
                    {"subject": "Papua New Guinea", "object": "Port Moresby"},
                ],
            }
        )
    )
    return path


def test_a_relation_that_cannot_pair_is_refused(tmp_path, smollm2_tokenizer):
    task = get_task(unpairable(tmp_path / "lonely.json"))
    lengths = {len(r.input_ids) for r in task.records(smollm2_tokenizer, 3)}
    assert len(lengths) == 3
    with pytest.raises(ValueError, match="lonely gives no counterfactual pair"):
        task.discovery_pairs(smollm2_tokenizer, 3)


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: what is refused must be refused before."""
    from mechdiff.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loading, "_load_weights", refuse)


def test_cli_refuses_bad_relations_before_weights_load(tiny_family, tmp_path, capsys, no_weights):
    from mechdiff.cli import main

    for command in (["eval", "--models"], ["scan", "--model"], ["circuit", "--model"]):
        assert main([*command, tiny_family[0], "--task", "country_capitol"]) == 2
        err = capsys.readouterr().err
        assert "unknown task 'country_capitol'" in err and "knowledge relations: antonym, city_country" in err
    lonely = str(unpairable(tmp_path / "lonely.json"))
    for command in (["scan", "--model"], ["circuit", "--model"]):
        assert main([*command, tiny_family[0], "--task", lonely, "--out", str(tmp_path / "x")]) == 2
        assert "lonely gives no counterfactual pair" in capsys.readouterr().err


def test_cli_eval_scan_circuit_on_a_relation(tiny_family, tmp_path):
    from mechdiff.cli import main
    from mechdiff.models.loading import load_model

    model = tiny_family[0]
    assert (
        main(
            ["eval", "--task", "country_capital", "--models", model, "--n", "24", "--out", str(tmp_path / "eval.json")]
        )
        == 0
    )
    result = next(iter(json.loads((tmp_path / "eval.json").read_text()).values()))
    lm = load_model(model)
    records = get_task("country_capital").records(lm.tokenizer, 24)
    with torch.no_grad():  # independent: each prompt alone, argmax of the last logits
        correct = [int(lm.model(torch.tensor([r.input_ids])).logits[0, -1].argmax() == r.answer_id) for r in records]
    assert result["task"] == "country_capital" and result["n"] == 24 and result["correct"] == correct
    assert "n_boxes" not in result and "split" not in result  # entity tracking's options, not a relation's

    assert (
        main(
            [
                "scan",
                "--task",
                "country_capital",
                "--model",
                model,
                "--position",
                "subject",
                "--n",
                "6",
                "--out",
                str(tmp_path / "scan"),
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "scan" / "scan_z_subject.json").read_text())
    assert meta["task"] == "country_capital" and meta["n_pairs"] == 6 and torch.tensor(meta["effects"]).shape == (2, 4)

    assert (
        main(
            [
                "circuit",
                "--task",
                "country_capital",
                "--model",
                model,
                "--n",
                "6",
                "--top-k",
                "EXT=2,QRY=1,ENR=1",
                "--out",
                str(tmp_path / "circuit"),
            ]
        )
        == 0
    )
    circuit = json.loads((tmp_path / "circuit" / "circuit.json").read_text())
    assert circuit["task"] == "country_capital"
    assert circuit["positions"] == {"EXT": "last", "QRY": "last", "ENR": "subject"}
    assert [len(circuit["groups"][g]) for g in ("EXT", "QRY", "ENR")] == [2, 1, 1]
