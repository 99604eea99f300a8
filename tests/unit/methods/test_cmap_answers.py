"""CMAP with answers of several tokens (#40 item 2): each outcome (greedy decoding of the whole answer) and answer
probability (``exp`` of the summed log-probability) against a plain HF forward of prompt + answer with the
fine-tune's head output written at the prompt's position by a torch hook; the appended answer is never patched."""

from __future__ import annotations

import numpy as np
import torch
from conftest import make_tiny
from tolerances import assert_close32

from mechdiff.circuits.circuit import Circuit
from mechdiff.common.components import Head
from mechdiff.methods.cmap import run_cmap
from mechdiff.tasks.base import Example

HEAD = Head(1, 2)


def forward(base, ids: list[int], donor=None, n: int = 0) -> torch.Tensor:
    """Logits ``"pos vocab"`` of a plain forward of ``base`` on ``ids``; with ``donor``, :data:`HEAD`'s output at
    the prompt's last position (``n - 1``) is the donor's on the prompt ``ids[:n]``."""
    d = base.shape.d_head
    cols = slice(HEAD.head * d, (HEAD.head + 1) * d)
    hooks = []
    with torch.no_grad():
        if donor is not None:
            seen = {}
            o_proj = donor.model.model.layers[HEAD.layer].self_attn.o_proj
            grab = o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0].clone()))
            donor.model(input_ids=torch.tensor([ids[:n]]), use_cache=False)
            grab.remove()

            def write(module, args):
                x = args[0].clone()
                x[:, n - 1, cols] = seen["z"][:, n - 1, cols]
                return (x,)

            hooks.append(base.model.model.layers[HEAD.layer].self_attn.o_proj.register_forward_pre_hook(write))
        try:
            return base.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        finally:
            for h in hooks:
                h.remove()


def scored(base, prompt: tuple, answer: list[int], donor=None) -> tuple[bool, float]:
    rows = forward(base, list(prompt) + answer[:-1], donor, len(prompt))[len(prompt) - 1 :]
    logp = rows.log_softmax(-1)[torch.arange(len(answer)), torch.tensor(answer)].sum()
    return bool((rows.argmax(-1) == torch.tensor(answer)).all()), float(logp)


def test_cmap_scores_answers_of_several_tokens_as_hooked_forwards(smollm2_tokenizer):
    base, finetune = make_tiny("llama", smollm2_tokenizer, seed=0), make_tiny("llama", smollm2_tokenizer, seed=1)
    records = []
    for i in range(4):
        ids = tuple(smollm2_tokenizer(f"The capital of country {i} is")["input_ids"])
        answer: list[int] = []
        for _ in range([3, 2, 1, 4][i]):  # greedy under the patch: reached, unless a token is changed below
            answer.append(int(forward(base, list(ids) + answer, finetune, len(ids))[-1].argmax()))
        if i % 2:
            answer[-1] = (answer[-1] + 1) % 49152
        several = tuple(answer) if len(answer) > 1 else ()
        records.append(Example("", ids, "", answer[0], {"last": len(ids) - 1}, ("",), answer_tokens=several))
    circuit = Circuit("tiny", "t", {"g": [HEAD]}, {"g": "last"}, names={"g": ""})
    res = run_cmap(base, finetune, circuit, records, kinds=["z"], batch_size=4, groups=["g"], progress=False)
    want = [scored(base, r.input_ids, list(r.answer_tokens or (r.answer_id,)), finetune) for r in records]
    plain = [scored(base, r.input_ids, list(r.answer_tokens or (r.answer_id,))) for r in records]
    own = [scored(finetune, r.input_ids, list(r.answer_tokens or (r.answer_id,))) for r in records]
    assert res.outcomes["g/z"] == [int(c) for c, _ in want] == [1, 0, 1, 0]
    assert res.outcomes["base"] == [int(c) for c, _ in plain]
    assert res.outcomes["finetune"] == [int(c) for c, _ in own]
    (row,) = [r for r in res.rows if (r.scope, r.kind) == ("g", "z")]
    logp = np.array([lp for _, lp in want])
    assert_close32(np.log(row.answer_prob.value), np.log(np.exp(logp).mean()), scale=max(np.abs(logp).max(), 10.0))


def test_cmap_scores_the_logit_difference_of_a_logit_diff_task(smollm2_tokenizer):
    """On a ``logit_diff`` task CMAP's continuous score is the logit difference, not only the answer's probability:
    the answer's summed log-probability minus its alternative's, each teacher-forced with the fine-tune's head
    output written at the prompt (one token: the two logits' difference), against hooked forwards; the plain base
    and fine-tune likewise. A ``prob`` task keeps none."""
    base, finetune = make_tiny("llama", smollm2_tokenizer, seed=0), make_tiny("llama", smollm2_tokenizer, seed=1)
    circuit = Circuit("tiny", "t", {"g": [HEAD]}, {"g": "last"}, names={"g": ""})
    for lengths in ([(3, 1), (2, 2), (1, 3), (4, 2)], [(1, 1)] * 4):  # (answer, alternative) tokens; one-token only
        records, answers = [], []
        for i, (n_answer, n_alt) in enumerate(lengths):
            ids = tuple(smollm2_tokenizer(f"The capital of country {i} is")["input_ids"])
            answer, alt = [100 + 7 * i + k for k in range(n_answer)], [900 + 5 * i + k for k in range(n_alt)]
            several = any(n > 1 for n in (n_answer, n_alt))
            records.append(
                Example(
                    "",
                    ids,
                    "",
                    answer[0],
                    {"last": len(ids) - 1},
                    ("",),
                    (alt[0],),
                    answer_tokens=tuple(answer) if n_answer > 1 else (),
                    alternative_tokens=(tuple(alt),) if several else (),
                )
            )
            answers.append((answer, alt))
        res = run_cmap(
            base, finetune, circuit, records, ["z"], batch_size=4, groups=["g"], progress=False, metric="logit_diff"
        )

        def diffs(model, donor=None):
            return np.array(
                [
                    scored(model, r.input_ids, a, donor)[1] - scored(model, r.input_ids, b, donor)[1]
                    for r, (a, b) in zip(records, answers)
                ]
            )

        (row,) = [r for r in res.rows if (r.scope, r.kind) == ("g", "z")]
        for got, want in (
            (row.logit_diff, diffs(base, finetune)),
            (res.base_logit_diff, diffs(base)),
            (res.finetune_logit_diff, diffs(finetune)),
        ):
            assert_close32(got.value, want.mean(), scale=max(np.abs(want).max(), 10.0))
        assert "logit_diff" in row.to_dict() and "base_logit_diff" in res.to_dict()
    plain = run_cmap(base, finetune, circuit, records, ["z"], batch_size=4, groups=["g"], progress=False)
    assert plain.rows[0].logit_diff is None and "base_logit_diff" not in plain.to_dict()
    assert plain.rows[0].answer_prob == row.answer_prob  # the probability is the same under either metric


def test_random_draws_on_a_subset_score_the_logit_difference_as_a_run_on_those_prompts(smollm2_tokenizer):
    """On a ``logit_diff`` task with answers of several tokens, draws on ``random_prompts`` only (a pass of their
    own) give the random rows, logit difference included, and each draw's outcomes of a run on those prompts alone
    (the same draws: the seed's); the groups, base and fine-tune are those of a run without draws, and each draw's
    correctness is the answer's run's (the same under ``prob``)."""
    from mechdiff.tasks.base import take

    base, finetune = make_tiny("llama", smollm2_tokenizer, seed=0), make_tiny("llama", smollm2_tokenizer, seed=1)
    circuit = Circuit("tiny", "t", {"g": [HEAD]}, {"g": "last"}, names={"g": ""})
    records = []
    for i, (n_answer, n_alt) in enumerate([(3, 1), (2, 2), (1, 3), (4, 2), (2, 1)]):
        ids = tuple(smollm2_tokenizer(f"The capital of country {i} is")["input_ids"])
        answer, alt = [], [900 + 5 * i + k for k in range(n_alt)]
        for _ in range(n_answer):  # the base's greedy answer: draws' outcomes not all 0
            answer.append(int(forward(base, list(ids) + answer)[-1].argmax()))
        records.append(
            Example(
                "",
                ids,
                "",
                answer[0],
                {"last": len(ids) - 1},
                ("",),
                (alt[0],),
                answer_tokens=tuple(answer) if n_answer > 1 else (),
                alternative_tokens=(tuple(alt),),
            )
        )
    kw = dict(kinds=["z"], batch_size=4, groups=["g"], progress=False, metric="logit_diff", seed=3)
    part = run_cmap(base, finetune, circuit, records, n_random=2, random_prompts=[3, 1], **kw)
    alone = run_cmap(base, finetune, circuit, take(records, [1, 3]), n_random=2, **kw)
    plain = run_cmap(base, finetune, circuit, records, **kw)
    assert part.random_prompts == [1, 3] and part.random_heads == alone.random_heads
    assert part.random_outcomes == alone.random_outcomes
    (got,), (want,) = part.random_rows, alone.random_rows
    assert got.logit_diff is not None and got.logit_diff.value == want.logit_diff.value
    assert got.accuracy.value == want.accuracy.value and got.answer_prob.value == want.answer_prob.value
    assert part.rows[0].logit_diff.value == plain.rows[0].logit_diff.value
    assert part.base_logit_diff.value == plain.base_logit_diff.value
    by_prob = run_cmap(base, finetune, circuit, records, n_random=2, random_prompts=[3, 1], **{**kw, "metric": "prob"})
    assert by_prob.random_outcomes == part.random_outcomes and by_prob.random_rows[0].logit_diff is None
    assert "1" in "".join(o for draws in part.random_outcomes.values() for o in draws)
