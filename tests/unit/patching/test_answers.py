"""Answers of several tokens (#40 item 2): import, records, teacher-forced evaluation and the mean-ablation scorer,
each against an independent computation (a plain HF forward of prompt + answer)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import answer_records, capitals_rows, make_tiny, write_rows
from einops import rearrange
from tolerances import assert_close32

from mechdiff.circuits.scoring import EVERY_POSITION, Scorer
from mechdiff.common.components import Head
from mechdiff.common.metrics import answer_is_top1, answer_prob, logit_diff
from mechdiff.patching.core import Patch, answer_logits, run
from mechdiff.patching.evaluate import evaluate
from mechdiff.tasks.base import Pair, batch_tensors, get_task
from mechdiff.tasks.jsonl import ImportErrors, answer_ids, import_pairs
from mechdiff.tasks.records import check_one_token, dataset_hash

LONG = {"Argentina": " Buenos Aires", "Malaysia": " Kuala Lumpur", "France": " Paris", "Vietnam": " Ho Chi Minh City"}


def long_rows(n: int = 4) -> list[dict]:
    """Capitals rows whose answers (and counterfactual answers) are of 1 to 6 tokens, the countries cycled."""
    rows = []
    countries = list(LONG)
    for i, row in enumerate(capitals_rows(n, templates=("short",))):
        c, c2 = countries[i % 4], countries[(i + 1) % 4]
        clean, cf = f"The capital of {c} is", f"The capital of {c2} is"
        rows.append(
            {
                **row,
                "clean": clean,
                "counterfactual": cf,
                "answer": LONG[c],
                "counterfactual_answer": LONG[c2],
                "positions": {"country": [15, 15 + len(c)]},
                "counterfactual_positions": {"country": [15, 15 + len(c2)]},
            }
        )
    return rows


@pytest.fixture
def long_task(smollm2_tokenizer, tmp_path):
    path = write_rows(tmp_path / "long.jsonl", long_rows())
    return import_pairs(path, smollm2_tokenizer, tmp_path / "task", metric="logit_diff")


def test_import_keeps_every_token_the_answer_appends(smollm2_tokenizer, long_task):
    task = get_task(long_task)
    pairs = task.discovery_pairs(smollm2_tokenizer, 4)
    for pair, row in zip(pairs, long_rows()):
        for rec, prompt, answer, other in (
            (pair.base, row["clean"], row["answer"], row["counterfactual_answer"]),
            (pair.source, row["counterfactual"], row["counterfactual_answer"], row["answer"]),
        ):
            n = len(smollm2_tokenizer(prompt)["input_ids"])
            want = tuple(smollm2_tokenizer(prompt + answer)["input_ids"][n:])
            assert (rec.answer_tokens or (rec.answer_id,)) == want and rec.answer_id == want[0]
            assert smollm2_tokenizer.decode(list(want)) == answer
            assert smollm2_tokenizer.decode(list((rec.alternative_tokens or ((rec.alternative_ids[0],),))[0])) == other
        assert (pair.target_tokens or (pair.target_id,)) == (pair.base.answer_tokens or (pair.base.answer_id,))
    assert [len(p.base.answer_tokens) for p in pairs] == [2, 6, 0, 4]  # " Paris" is one token: no answer_tokens
    assert task.answer_tokens == 6
    cf = task.desideratum("counterfactual", smollm2_tokenizer, 4)
    assert [p.target_tokens or (p.target_id,) for p in cf] == [
        p.source.answer_tokens or (p.source.answer_id,) for p in pairs
    ]
    assert [Pair.from_dict(p.to_dict()) for p in pairs] == pairs  # the JSONL round trip keeps every token


def test_one_token_records_are_byte_identical(smollm2_tokenizer, tmp_path):
    """The pairs.jsonl of a one-token task is the one the importer wrote before answers of several tokens."""
    want = {
        False: "0e7039baab1e9e3c3a5f3ae5ef997d50be4a655af1c988ca0bc8a11c97e150cf",
        True: "aad18d9f7f0bfdaff1784dff001df468c43109370d62fd64dd1d6017aca9f3c4",
    }
    for classes in (False, True):
        path = write_rows(tmp_path / f"p{classes}.jsonl", capitals_rows(24, classes=classes))
        out = import_pairs(path, smollm2_tokenizer, tmp_path / f"t{classes}", metric="logit_diff")
        text = (out / "pairs.jsonl").read_bytes()
        if classes:  # a row's own classes now also hold `last` and `rest` (#40 item 5); the rest is as it was
            text = _without_last_and_rest(text)
        assert hashlib.sha256(text).hexdigest() == want[classes]
        assert b"answer_tokens" not in text and b"target_tokens" not in text


def _without_last_and_rest(text: bytes) -> bytes:
    """``pairs.jsonl`` with the classes ``last`` and ``rest`` taken out of every record (checked present first)."""
    lines = []
    for line in text.decode().splitlines():
        row = json.loads(line)
        for rec in (row["base"], row["source"]):
            n, classes = len(rec["input_ids"]), rec["classes"]
            last, rest = classes.pop("last"), classes.pop("rest")
            assert last == [n - 1] and sorted(rest + last + classes["words"]) == list(range(n))
        lines.append(json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n")
    return "".join(lines).encode()


def test_import_refuses_an_answer_merging_with_the_prompt(smollm2_tokenizer, tmp_path):
    prompt = "When Mary and John went to the store, John gave a drink to"
    with pytest.raises(ValueError, match="merges with the prompt's last token"):
        answer_ids(smollm2_tokenizer, prompt, "ward Mary")
    row = {**long_rows()[0], "answer": "n Aires"}  # "is" + "n" -> "isn"
    with pytest.raises(ImportErrors, match=r"long.jsonl:1: answer 'n Aires' merges with the prompt's last token"):
        import_pairs(write_rows(tmp_path / "long.jsonl", [row]), smollm2_tokenizer, tmp_path / "task")


def hf_logprob(lm, prompt: tuple, answer: list[int], hook=None) -> tuple[float, bool]:
    """Summed log-probability of ``answer`` after ``prompt`` and whether each token is the top-1: one plain HF
    forward of prompt + answer (``hook``: a forward pre-hook ``(module, fn)`` while it runs)."""
    ids = torch.tensor([list(prompt) + answer])
    handle = hook[0].register_forward_pre_hook(hook[1]) if hook else None
    try:
        with torch.no_grad():
            logits = lm.model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        if handle:
            handle.remove()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]
    logp = rows.log_softmax(-1)[torch.arange(len(answer)), torch.tensor(answer)]
    return float(logp.sum()), bool((rows.argmax(-1) == torch.tensor(answer)).all())


def greedy(lm, prompt: tuple, n: int) -> list[int]:
    """``n`` greedily decoded tokens after ``prompt``."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(lm.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_several_tokens_score_as_a_plain_forward(smollm2_tokenizer, family):
    """Accuracy (greedy decoding gives the whole answer), probability (exp of the summed log-probability) and the
    logit difference (difference of summed log-probabilities) against a plain HF forward of prompt + answer;
    answers of 1 to 4 tokens in one batch (right-padded)."""
    lm = make_tiny(family, smollm2_tokenizer)
    prompts = [tuple(smollm2_tokenizer(f"The capital of country {i} is")["input_ids"]) for i in range(4)]
    decoded = [greedy(lm, p, 4) for p in prompts]
    answers = [decoded[0][:3], decoded[1][:2] + [(decoded[1][2] + 1) % 49152], decoded[2][:1], [5, 7, 11, 13]]
    alternatives = [[17, 19], decoded[1][:4], [23], decoded[3][:2]]
    recs = answer_records(smollm2_tokenizer, answers, alternatives)
    res = evaluate(lm, recs, batch_size=4, progress=False)
    for i, (p, a, alt) in enumerate(zip(prompts, answers, alternatives)):
        logp, top1 = hf_logprob(lm, p, a)
        alt_logp, _ = hf_logprob(lm, p, alt)
        assert bool(res.correct[i]) == top1, i
        scale = max(abs(logp), abs(alt_logp), 10.0)
        assert_close32(np.log(res.prob[i]), logp, scale=scale, msg=f"log-prob {i}")
        assert_close32(res.logit_diff[i], logp - alt_logp, scale=scale, msg=f"logit diff {i}")
    assert res.correct.tolist() == [True, False, True, False]  # the greedy answers, and a last token changed


def hf_hits(lm, prompt: tuple, answer: list[int]) -> list[bool]:
    """Whether each answer token is the top-1 after the prompt and the answer's tokens before it (one plain HF
    forward of prompt + answer)."""
    ids = torch.tensor([list(prompt) + answer])
    with torch.no_grad():
        logits = lm.model(input_ids=ids, use_cache=False).logits[0].float()
    return (logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].argmax(-1) == torch.tensor(answer)).tolist()


def test_accuracy_splits_by_first_token_against_the_rest(tiny_llama, smollm2_tokenizer):
    """#49 item 12: per prompt, the first answer token the top-1 after the prompt, and every later token the top-1
    given the answer's tokens before it (teacher forced), against a plain HF forward: a greedy answer (both), one
    whose last token is changed (first only), one whose first token is changed and the rest decoded greedily after
    it (the rest only), and one-token answers (no rest: true). Accuracy is the two together; the outcome record
    keeps both; a task of one-token answers keeps neither, so its records are as before."""
    lm = tiny_llama
    prompts = [tuple(smollm2_tokenizer(f"The capital of country {i} is")["input_ids"]) for i in range(5)]
    g = [greedy(lm, p, 3) for p in prompts]
    wrong = (g[2][0] + 1) % 49152
    answers = [g[0], g[1][:2] + [(g[1][2] + 1) % 49152], [wrong, *greedy(lm, prompts[2] + (wrong,), 2)], g[3][:1]]
    answers.append([(g[4][0] + 1) % 49152])
    recs = answer_records(smollm2_tokenizer, answers, [[17]] * 5)
    res = evaluate(lm, recs, batch_size=5, progress=False)
    hits = [hf_hits(lm, p, a) for p, a in zip(prompts, answers)]
    assert res.first.tolist() == [h[0] for h in hits] == [True, True, False, True, False]
    assert res.rest.tolist() == [all(h[1:]) for h in hits] == [True, False, True, True, True]
    assert res.correct.tolist() == (res.first & res.rest).tolist()
    record = res.outcomes()
    assert (record["first"], record["rest"]) == ("11010", "10111")
    one = evaluate(lm, answer_records(smollm2_tokenizer, [[5], [7]], [[13], [17]]), batch_size=2, progress=False)
    assert one.first is None and "first" not in one.outcomes() and "rest" not in one.outcomes()
    rows = res.by_answer_length(recs)
    assert [(r["answer_tokens"], r["first_token"].value) for r in rows] == [("1", 0.5), ("3+", 2 / 3)]
    assert rows[0]["rest"] is None and rows[1]["rest"].value == pytest.approx(2 / 3)


def test_one_token_numbers_are_todays(tiny_llama, smollm2_tokenizer):
    """A task of one-token answers is read at the prompt's last token exactly as before (the same run, the same
    metric functions: equal, not close), with no answer tokens in its batches."""
    recs = answer_records(smollm2_tokenizer, [[5], [7], [11]], [[13], [17], [19]])
    batch = batch_tensors(recs)
    assert "answer_tokens" not in batch
    res = evaluate(tiny_llama, recs, batch_size=3, progress=False)
    logits = run(tiny_llama, batch["input_ids"]).logits
    assert res.prob.tolist() == answer_prob(logits, batch["answer_ids"]).tolist()
    assert res.correct.tolist() == answer_is_top1(logits, batch["answer_ids"]).tolist()
    assert res.logit_diff.tolist() == logit_diff(logits, batch["answer_ids"], batch["alternative_ids"]).tolist()


def test_answer_logits_leave_the_answer_positions_unpatched(tiny_llama, smollm2_tokenizer):
    """Patching nothing changes no logit; a patch of every position writes the prompt's positions only (a manual
    hook on the prompt's positions agrees; one on every position, answer included, does not)."""
    lm = tiny_llama
    recs = answer_records(smollm2_tokenizer, [[5, 6, 7], [8, 9, 10]], [[1, 2], [3, 4]])
    batch = batch_tensors(recs)
    ids, tokens = batch["input_ids"], batch["answer_tokens"]
    n = ids.shape[1]
    with torch.no_grad():
        plain = lm.model(input_ids=torch.cat([ids, tokens[:, :-1]], 1)).logits[:, n - 1 :]
        got = answer_logits(lm, ids, tokens)
        z = torch.randn(1, n, 32)  # a value for layer 1's z at every prompt position
        keep_all = answer_logits(lm, ids, tokens, [Patch("z", 1, z, mask=torch.ones(1, n, 32))])
    assert torch.equal(keep_all, got)  # x * 1 + y * 0: exact
    assert_close32(got, plain, msg="unpatched")
    o_proj = lm.model.model.layers[1].self_attn.o_proj

    def prompt_only(module, args):
        x = args[0].clone()
        x[:, :n] = z
        return (x,)

    with torch.no_grad():
        patched = answer_logits(lm, ids, tokens, [Patch("z", 1, z)])
        handle = o_proj.register_forward_pre_hook(prompt_only)
        try:
            manual = lm.model(input_ids=torch.cat([ids, tokens[:, :-1]], 1)).logits[:, n - 1 :]
        finally:
            handle.remove()
    assert_close32(patched, manual, msg="patched at the prompt's positions")
    assert (patched - got).abs().max() > 1e-3  # the patch moved the logits


def test_mean_ablation_scores_several_tokens_against_hooks(tiny_llama, smollm2_tokenizer):
    """The scorer's F(M) and a mean ablation of one head at every position, against a plain HF forward of
    prompt + answer with the head's z replaced by its mean at the prompt's positions only."""
    lm = tiny_llama
    answers = [[5, 6, 7], [8, 9], [10, 11, 12]]
    recs = answer_records(smollm2_tokenizer, answers, [[1, 2], [3, 4], [5, 6]])
    scorer = Scorer.build(lm, recs, recs, batch_size=3, progress=False)
    n = len(recs[0].input_ids)
    head = Head(1, 2)
    means = scorer.means[1][:, head.head * 8 : (head.head + 1) * 8]  # "pos d_head"
    o_proj = lm.model.model.layers[1].self_attn.o_proj

    def ablate(module, args):
        x = rearrange(args[0].clone(), "b p (h d) -> b p h d", h=4)
        x[:, :n, head.head] = means
        return (rearrange(x, "b p h d -> b p (h d)"),)

    full, ablated = scorer.full(), scorer.ablate([(head, EVERY_POSITION)])
    for i, (r, a) in enumerate(zip(recs, answers)):
        logp, top1 = hf_logprob(lm, r.input_ids, a)
        ab_logp, ab_top1 = hf_logprob(lm, r.input_ids, a, (o_proj, ablate))
        assert_close32(np.log(full.prob[i]), logp, scale=max(abs(logp), 10.0), msg=f"F(M) {i}")
        assert_close32(np.log(ablated.prob[i]), ab_logp, scale=max(abs(ab_logp), 10.0), msg=f"ablated {i}")
        assert (bool(full.correct[i]), bool(ablated.correct[i])) == (top1, ab_top1)
        assert abs(ab_logp - logp) > 1e-4  # the ablation moved this prompt's answer
    dropped = scorer.keep_without([(head, EVERY_POSITION), (Head(2, 0), "last")], [(Head(2, 0), "last")])
    assert np.array_equal(dropped.prob, scorer.keep([(head, EVERY_POSITION)]).prob)  # the same runs, the same cache


def test_training_batches_refuse_longer_answers_and_path_patching_takes_them(smollm2_tokenizer, long_task):
    """Fine-tuning / HeadMap batches train on one answer token and refuse longer answers, saying so; path patching's
    batch takes them (teacher-forced rows, :mod:`tests.unit.patching.test_path_answers` checks its numbers)."""
    from mechdiff.tasks.records import answer_batch

    pairs = get_task(long_task).discovery_pairs(smollm2_tokenizer, 4)
    with pytest.raises(ValueError, match=r"stage path patching scores one answer token; task .* up to 6 tokens"):
        check_one_token(pairs, "path patching")
    with pytest.raises(ValueError, match=r"HeadMap training batches trains on one answer token .* up to 6 tokens"):
        answer_batch([p.base for p in pairs])
    assert dataset_hash(pairs) == dataset_hash([Pair.from_dict(json.loads(json.dumps(p.to_dict()))) for p in pairs])


def test_a_study_of_longer_answers_takes_path_patching(smollm2_tokenizer, tmp_path, monkeypatch):
    """A study of method = "path" on a task of longer answers (and a plan of its own) is no longer refused: it goes
    on to load weights. Without a plan the task is refused before anything loads (never given entity tracking's)."""
    from mechdiff.studies.circuits import study as circuits
    from mechdiff.studies.circuits.spec import load_spec
    from mechdiff.studies.spec import SpecError

    plan = tmp_path / "plan.toml"
    plan.write_text('[plan]\nname = "capitals"\n\n[steps.A]\nsender = "last"\nk = 2\n')
    rows = write_rows(tmp_path / "rows.jsonl", long_rows(16))
    long_task = import_pairs(rows, smollm2_tokenizer, tmp_path / "task", plan=plan)
    no_plan = import_pairs(rows, smollm2_tokenizer, tmp_path / "no-plan")

    spec_file = tmp_path / "study.toml"
    spec_file.write_text(
        f'[task]\nname = "{long_task}"\n[models]\nbase = "smollm2-135m"\nfinetunes = ["smollm2-capital-edit"]\n'
        f'[output]\ndir = "{tmp_path / "run"}"\nstore = "{tmp_path / "store.h5"}"\n'
        '[eval]\nn = 1\n[positions]\nn = 0\n[discovery]\nmethod = "path"\nn = 1\n[scoring]\nn = 1\nreference_n = 1\n'
        "prune = false\n[dcm]\nn_train = 0\nn_val = 0\nn_test = 1\n[cmap]\nn = 1\n"
        "[sets]\nnested = true\n"  # 4 items (clean prompts) for reference, eval/discovery/matrix, dcm and cmap
    )

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(circuits, "ModelSet", load)
    with pytest.raises(Loaded):
        circuits.CircuitsStudy(load_spec(spec_file), progress=False)
    spec_file.write_text(spec_file.read_text().replace(str(long_task), str(no_plan)))
    with pytest.raises(SpecError, match="has no path-patching plan"):
        load_spec(spec_file)
