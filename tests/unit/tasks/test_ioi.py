"""IOI over templates of several token lengths: every named position sits at the token a direct tokenization
of the prompt's prefix puts it, counterfactual pairs stay equal in length, and scoring the mixed set gives
each prompt what its own template's set gives alone."""

from __future__ import annotations

import pytest
from tolerances import assert_close32

from mechdiff.circuits.scoring import Scorer
from mechdiff.common.components import Head
from mechdiff.patching.evaluate import evaluate
from mechdiff.tasks import ioi
from mechdiff.tasks.base import derived_classes, group_key


def test_templates_have_several_token_lengths(smollm2_tokenizer):
    lengths = ioi.template_lengths(smollm2_tokenizer)
    assert set(lengths) == set(ioi.TEMPLATES) and len(set(lengths.values())) == len(ioi.TEMPLATES) == 4
    assert len(set(ioi.template_lengths(smollm2_tokenizer, ioi.ALL_TEMPLATES).values())) == 5
    for t, n in lengths.items():  # one length a template, whatever the names, place and object drawn
        assert {len(r.input_ids) for r in ioi.generate(smollm2_tokenizer, 6, seed=1, templates=[t])} == {n}


@pytest.mark.parametrize("template", ioi.ALL_TEMPLATES)
def test_named_positions_match_a_direct_tokenization(smollm2_tokenizer, template):
    """IO, S1, S2 and last against the tokens of the prompt's prefix up to each name, tokenized on its own."""
    tok = smollm2_tokenizer
    records = ioi.generate(tok, 6, seed=5, templates=[template])
    assert {r.positions["IO"] < r.positions["S1"] for r in records} == {True, False}  # ABBA and BABA
    for r in records:
        assert list(r.input_ids) == tok(r.prompt)["input_ids"] and r.template == template
        io, s = r.answer.strip(), r.alternatives[0].strip()
        first = r.prompt.index(" " + io if r.positions["IO"] < r.positions["S1"] else " " + s)
        # the n-th occurrence of each name, by character: IO once, S twice (S1 in the first clause, S2 later)
        ends = {"IO": r.prompt.index(" " + io) + 1 + len(io), "S1": r.prompt.index(" " + s) + 1 + len(s)}
        ends["S2"] = r.prompt.index(" " + s, ends["S1"]) + 1 + len(s)
        assert first < ends["S2"]
        for name, end in ends.items():
            prefix = tok(r.prompt[:end])["input_ids"]
            assert r.positions[name] == len(prefix) - 1, (name, r.prompt)
            assert tok.decode([r.input_ids[r.positions[name]]]) == " " + (io if name == "IO" else s)
        assert r.positions["last"] == len(r.input_ids) - 1 and tok.decode([r.input_ids[-1]]) == " to"
        assert r.answer_id == tok(" " + io, add_special_tokens=False)["input_ids"][0]
        assert r.alternative_ids == (tok(" " + s, add_special_tokens=False)["input_ids"][0],)


def test_the_committed_study_circuits_load_with_the_tasks_classes(tmp_path):
    """A circuit of (head, derived class) pairs is a valid IOI circuit file; a position IOI lacks is refused."""
    import json
    from pathlib import Path

    from mechdiff.circuits.circuit import CircuitFileError, load_circuit_file

    assert ioi.TASK.positions == ("before", "IO", "after_IO", "S1", "after_S1", "S2", "after_S2", "last")
    run = Path(__file__).resolve().parents[3] / "results" / "ioi-smollm2" / "circuits"
    paths = sorted(run.glob("*.json"))
    assert [p.stem for p in paths] == ["smollm2-135m", "smollm2-et"]
    for path in paths:
        assert set(load_circuit_file(path, 30, 9).positions.values()) <= set(ioi.TASK.positions)
    stale = tmp_path / "stale.json"  # the old layout's END position
    stale.write_text(json.dumps({"task": "ioi", "groups": {"NM": ["L29H1"]}, "positions": {"NM": "END"}}))
    with pytest.raises(CircuitFileError, match="not positions of the task"):
        load_circuit_file(stale, 30, 9)


def test_derived_classes_partition_every_template(smollm2_tokenizer):
    records = ioi.generate(smollm2_tokenizer, 16, seed=2)
    for r in records:
        masks = derived_classes([r], len(r.input_ids))
        assert list(masks) == ["before", "IO", "after_IO", "S1", "after_S1", "S2", "after_S2", "last"]
        counts = sum(m.long() for m in masks.values())[0]
        assert counts.tolist() == [1] * len(r.input_ids)  # every token in exactly one class
        for name in ("IO", "S1", "S2", "last"):
            assert masks[name][0].nonzero().flatten().tolist() == [r.positions[name]]
        assert masks["after_S2"][0].sum() == r.positions["last"] - r.positions["S2"] - 1


@pytest.mark.parametrize("pairs", [ioi.abc_pairs, ioi.io_name_pairs])
def test_pairs_stay_equal_length_within_a_pair(smollm2_tokenizer, pairs):
    got = pairs(smollm2_tokenizer, 24, seed=4)
    assert len({len(p.base.input_ids) for p in got}) >= 4
    for p in got:
        assert len(p.base.input_ids) == len(p.source.input_ids) and p.base.template == p.source.template
        assert [p.base.positions[k] for k in ("S2", "last")] == [p.source.positions[k] for k in ("S2", "last")]


def test_a_multi_length_eval_equals_the_per_template_evals_pooled(tiny_llama, smollm2_tokenizer):
    records = ioi.generate(smollm2_tokenizer, 24, seed=3)  # 6 prompts of each of 4 templates, interleaved
    pooled = evaluate(tiny_llama, records, batch_size=4, progress=False)
    seen = []
    for template in ioi.TEMPLATES:
        rows = [i for i, r in enumerate(records) if r.template == template]
        alone = evaluate(tiny_llama, [records[i] for i in rows], batch_size=2, progress=False)
        assert_close32(pooled.prob[rows], alone.prob, msg=template)
        assert_close32(pooled.logit_diff[rows], alone.logit_diff, msg=template)
        assert (pooled.correct[rows] == alone.correct).all()
        seen += rows
    assert sorted(seen) == list(range(len(records)))


def test_mean_ablation_of_the_mixed_set_equals_each_template_alone(tiny_llama, smollm2_tokenizer):
    """The scorer's means are per (template, length): the pooled set scores each prompt as its template alone."""
    pairs = ioi.abc_pairs(smollm2_tokenizer, 16, seed=6)
    pooled = Scorer.build(tiny_llama, [p.base for p in pairs], [p.source for p in pairs], batch_size=4, progress=False)
    assert set(pooled.means) == {group_key(p.base) for p in pairs} and len(pooled.means) == len(ioi.TEMPLATES)
    circuit = [(Head(0, 1), "last"), (Head(1, 2), "S2"), (Head(2, 0), "after_IO"), (Head(1, 3), "before")]
    got = pooled.keep(circuit)
    for template in ioi.TEMPLATES:
        rows = [i for i, p in enumerate(pairs) if p.base.template == template]
        alone = Scorer.build(
            tiny_llama, [pairs[i].base for i in rows], [pairs[i].source for i in rows], progress=False
        ).keep(circuit)
        assert_close32(got.prob[rows], alone.prob, msg=template)
        assert (got.correct[rows] == alone.correct).all()
