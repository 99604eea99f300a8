"""DCM and semantic patching with targets of several tokens (#40 item 2): the pair cache's teacher-forced runs,
DCM's loss (the target's negative summed log-probability) and target accuracy (greedy decoding of the whole
target), each against a plain HF forward of base prompt + target with the source's head outputs written at the
prompt's position by a torch hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny
from tolerances import assert_close32

from mechdiff.common.components import Head
from mechdiff.methods.dcm_cache import PairCache, target_score
from mechdiff.methods.semantic import semantic_patching
from mechdiff.tasks.base import Example, Pair

HEADS = [Head(1, 0), Head(2, 3)]
POSITION = "subject"  # the prompt position the heads are patched at


def prompt(tokenizer, text: str) -> Example:
    ids = tuple(tokenizer(text)["input_ids"])
    return Example(text, ids, "", 0, {"last": len(ids) - 1, POSITION: 2})


def forward(lm, ids: list[int], source: tuple | None) -> torch.Tensor:
    """Logits ``"pos vocab"`` of one plain HF forward of ``ids``, the :data:`HEADS` outputs at :data:`POSITION`
    replaced by the ``source`` prompt's (its own plain forward) where given."""
    d, zs = lm.shape.d_head, {}
    o_proj = {h: lm.model.model.layers[h.layer].self_attn.o_proj for h in HEADS}

    def grab(module, args, layer):
        zs[layer] = args[0].clone()

    def write(module, args, head):
        x = args[0].clone()
        cols = slice(head.head * d, (head.head + 1) * d)
        x[:, 2, cols] = zs[head.layer][:, 2, cols]
        return (x,)

    with torch.no_grad():
        if source is not None:
            handles = [o_proj[h].register_forward_pre_hook(lambda m, a, h=h: grab(m, a, h.layer)) for h in HEADS]
            lm.model(input_ids=torch.tensor([list(source)]), use_cache=False)
            for handle in handles:
                handle.remove()
        handles = [o_proj[h].register_forward_pre_hook(lambda m, a, h=h: write(m, a, h)) for h in HEADS]
        try:
            if source is None:
                for handle in handles:
                    handle.remove()
            return lm.model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0].float()
        finally:
            for handle in handles:
                handle.remove()


def hf_run(lm, base: tuple, target: list[int], source: tuple | None) -> tuple[float, bool]:
    """Summed log-probability of ``target`` after ``base`` and whether greedy decoding gives it (:func:`forward` of
    base + target, the heads patched from ``source`` at the prompt's position)."""
    rows = forward(lm, list(base) + target[:-1], source)[len(base) - 1 :]
    logp = rows.log_softmax(-1)[torch.arange(len(target)), torch.tensor(target)]
    return float(logp.sum()), bool((rows.argmax(-1) == torch.tensor(target)).all())


def greedy(lm, ids: tuple, n: int, source: tuple | None) -> list[int]:
    """``n`` tokens greedy decoding gives after ``ids`` with the heads patched from ``source``."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(forward(lm, list(ids) + out, source)[-1].argmax()))
    return out


@pytest.fixture
def case(smollm2_tokenizer):
    """A tiny llama and pairs of two prompt lengths whose targets have 1 to 4 tokens: two are what the patched
    run decodes greedily (reached), two have a token changed (not reached)."""
    lm = make_tiny("llama", smollm2_tokenizer)
    texts = [
        ("The cat sat on the", "The dog ran to the"),
        ("A red box holds the", "A blue box holds the"),
        ("My old friend owns a large", "My new friend owns a small"),
        ("One tall tree grew near the", "One short tree grew near the"),
    ]
    pairs = []
    for i, (b, s) in enumerate(texts):
        base, source = prompt(smollm2_tokenizer, b), prompt(smollm2_tokenizer, s)
        n = [3, 1, 4, 2][i]
        target = greedy(lm, base.input_ids, n, source.input_ids)
        if i % 2:
            target[-1] = (target[-1] + 1) % 49152
        pairs.append(Pair(base, source, "", target[0], target_tokens=tuple(target) if n > 1 else ()))
    return lm, pairs


def test_teacher_forced_cache_scores_several_tokens_as_a_plain_forward(case):
    lm, pairs = case
    assert len({len(p.base.input_ids) for p in pairs}) == 2  # two groups, padded and cut back
    cache = PairCache.build(lm, pairs, [(HEADS, POSITION)], batch_size=2)
    try:
        with torch.no_grad():
            logits, target = cache.logits(lm, range(4), HEADS, torch.zeros(2), POSITION)  # every head patched
            base_logits, base_target = cache.logits(lm, range(4), HEADS, torch.ones(2), POSITION)  # none
        patched, clean = target_score(logits, target), target_score(base_logits, base_target)
        acc = cache.accuracy(lm, range(4), HEADS, POSITION)
        for i, p in enumerate(pairs):
            tokens = list(p.target_tokens or (p.target_id,))
            want, reached = hf_run(lm, p.base.input_ids, tokens, p.source.input_ids)
            floor_lp, floor = hf_run(lm, p.base.input_ids, tokens, None)
            scale = max(abs(want), abs(floor_lp), 10.0)
            if len(tokens) > 1:  # one token: the paper's loss reads the target's logit, checked in test_dcm.py
                assert_close32(patched[i], want, scale=scale, msg=f"patched {i}")
                assert_close32(clean[i], floor_lp, scale=scale, msg=f"unpatched {i}")
            assert bool(acc[i]) == reached and bool(cache.floor[i]) == floor, i
        assert acc.tolist() == [True, False, True, False]
    finally:
        cache.close()


def test_semantic_patching_reads_the_whole_target(case):
    lm, pairs = case
    (res,) = semantic_patching([lm], HEADS, POSITION, pairs, batch_size=3, progress=False)
    want = [hf_run(lm, p.base.input_ids, list(p.target_tokens or (p.target_id,)), p.source.input_ids)[1] for p in pairs]
    assert res.outcomes == [int(w) for w in want] and np.isclose(res.accuracy.value, np.mean(want))
