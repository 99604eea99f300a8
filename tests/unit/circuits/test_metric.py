"""The task's metric sets every continuous score (#40 item 2): on a ``logit_diff`` task the scorer's continuous
faithfulness, the curve's measure and the attribution ranking are the logit difference (answer minus the mean
alternative; summed log-probabilities for answers of several tokens), each checked against a plain HF forward with
the mean ablation written by a torch hook; a ``prob`` task keeps its keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import answer_records
from einops import rearrange
from tolerances import assert_close32

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.curve import faithfulness_curve, prompt_attribution
from mechdiff.circuits.measures import faithfulness
from mechdiff.circuits.scoring import EVERY_POSITION, Scorer
from mechdiff.common.components import Head
from mechdiff.tasks.base import Example

KEPT = Head(1, 2)  # the one head a test circuit keeps (at every position)


CASES = {
    "one token": ([[5], [7], [11], [13]], [[17], [19], [23], [29]]),
    "several tokens": ([[5, 6, 7], [8, 9], [10], [12, 13, 14]], [[1, 2], [3], [4, 5, 6], [15, 16]]),
}


def kept_circuit() -> Circuit:
    """A circuit of :data:`KEPT` at every position (as ``full_circuit`` builds one: ``"*"`` is set after init)."""
    circuit = Circuit("tiny", "t", {"g": [KEPT]}, {"g": "last"}, names={"g": ""})
    circuit.positions = {"g": EVERY_POSITION}
    return circuit


def ablation_hooks(lm, scorer: Scorer, n: int, kept: tuple[Head, ...]):
    """Forward pre-hooks on every layer's ``o_proj`` writing the mean of every head but ``kept`` at the prompt's
    ``n`` positions (what ``Scorer.keep(kept at every position)`` does), as ``(module, fn)`` pairs."""
    hooks = []
    for layer in range(lm.shape.n_layers):
        means = rearrange(scorer.means[layer], "p (h d) -> p h d", h=lm.shape.n_heads)

        def ablate(module, args, layer=layer, means=means):
            x = rearrange(args[0].clone(), "b p (h d) -> b p h d", h=lm.shape.n_heads)
            for h in range(lm.shape.n_heads):
                if Head(layer, h) not in kept:
                    x[:, :n, h] = means[:, h]
            return (rearrange(x, "b p h d -> b p (h d)"),)

        hooks.append((lm.model.model.layers[layer].self_attn.o_proj, ablate))
    return hooks


def hf_logprob(lm, prompt: tuple, answer: list[int], hooks=()) -> float:
    """The summed log-probability of ``answer`` after ``prompt``: one plain HF forward of prompt + answer."""
    handles = [m.register_forward_pre_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([list(prompt) + answer]), use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].log_softmax(-1)
    return float(rows[torch.arange(len(answer)), torch.tensor(answer)].sum())


def hf_logit_diffs(lm, recs, answers, alternatives, hooks=()) -> np.ndarray:
    return np.array(
        [
            hf_logprob(lm, r.input_ids, a, hooks) - hf_logprob(lm, r.input_ids, alt, hooks)
            for r, a, alt in zip(recs, answers, alternatives)
        ]
    )


@pytest.mark.parametrize("case", list(CASES))
def test_logit_diff_faithfulness_is_the_ratio_of_hooked_logit_differences(tiny_llama, smollm2_tokenizer, case):
    answers, alternatives = CASES[case]
    recs = answer_records(smollm2_tokenizer, answers, alternatives)
    lm = tiny_llama
    scorer = Scorer.build(lm, recs, recs, batch_size=4, progress=False, metric="logit_diff")
    circuit = kept_circuit()
    res = faithfulness(scorer, circuit)
    full = hf_logit_diffs(lm, recs, answers, alternatives)
    kept = hf_logit_diffs(lm, recs, answers, alternatives, ablation_hooks(lm, scorer, len(recs[0].input_ids), (KEPT,)))
    scale = max(np.abs(full).max(), np.abs(kept).max(), 10.0)
    assert_close32(res["full"]["logit_diff"]["value"], full.mean(), scale=scale)
    assert_close32(res["circuit"]["logit_diff"]["value"], kept.mean(), scale=scale)
    want = kept.mean() / full.mean()
    got = res["circuit"]["faithfulness_logit_diff"]["value"]
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)
    assert "faithfulness_prob" not in res["circuit"]
    assert abs(want - np.exp(kept).mean() / np.exp(full).mean()) > 1e-3  # the measures differ: a prob would fail


def test_a_prob_task_keeps_its_keys(tiny_llama, smollm2_tokenizer):
    recs = answer_records(smollm2_tokenizer, *CASES["one token"])
    scorer = Scorer.build(tiny_llama, recs, recs, batch_size=4, progress=False)
    circuit = kept_circuit()
    res = faithfulness(scorer, circuit)
    assert sorted(res["circuit"]) == [
        "accuracy", "answer_prob", "faithfulness", "faithfulness_normalised", "faithfulness_normalised_prob",
        "faithfulness_prob",
    ]  # fmt: skip
    curve = faithfulness_curve(scorer, [(KEPT, EVERY_POSITION)], sizes=(1.0,))
    assert {"cpr_prob", "cmd_prob", "full_prob", "empty_prob"} <= set(curve)
    assert "faithfulness_prob" in curve["rows"][0] and "normalised_prob" in curve["rows"][0]


def test_logit_diff_needs_alternatives(tiny_llama, smollm2_tokenizer):
    recs = [
        Example("", r.input_ids, "", r.answer_id, r.positions, ("",))
        for r in answer_records(smollm2_tokenizer, [[5]], [[7]])
    ]
    with pytest.raises(ValueError, match="logit_diff needs records with alternative answers"):
        Scorer.build(tiny_llama, recs, recs, progress=False, metric="logit_diff")


def test_logit_diff_curve_measures_the_logit_difference(tiny_llama, smollm2_tokenizer):
    answers, alternatives = CASES["several tokens"]
    recs = answer_records(smollm2_tokenizer, answers, alternatives)
    scorer = Scorer.build(tiny_llama, recs, recs, batch_size=4, progress=False, metric="logit_diff")
    curve = faithfulness_curve(scorer, [(KEPT, EVERY_POSITION)], sizes=(1.0,))
    full = hf_logit_diffs(tiny_llama, recs, answers, alternatives)
    assert_close32(curve["full_logit_diff"], full.mean(), scale=max(np.abs(full).max(), 10.0))
    assert {"cpr_logit_diff", "cmd_logit_diff", "empty_logit_diff"} <= set(curve) and "cpr_prob" not in curve


@pytest.mark.parametrize("case", list(CASES))
def test_logit_diff_attribution_against_hooked_gradients(tiny_llama, smollm2_tokenizer, case):
    """``(mean z - z) . grad`` of the logit difference at every prompt position, summed per head at ``last`` and
    over all positions, against torch hooks on ``o_proj`` inputs of plain HF forwards (one per answer)."""
    answers, alternatives = CASES[case]
    lm = tiny_llama
    recs = answer_records(smollm2_tokenizer, answers, alternatives)
    scorer = Scorer.build(lm, recs, recs, batch_size=4, progress=False, metric="logit_diff")
    got = prompt_attribution(scorer, ["last"])  # "prompt class layer head"
    n, H = len(recs[0].input_ids), lm.shape.n_heads
    want = torch.zeros_like(got)
    for i, (r, a, alt) in enumerate(zip(recs, answers, alternatives)):
        for tokens, weight in ((a, 1.0), (alt, -1.0)):
            zs = {}

            def keep_z(module, args, layer):
                args[0].retain_grad()
                zs[layer] = args[0]

            handles = [
                lm.model.model.layers[L].self_attn.o_proj.register_forward_pre_hook(
                    lambda m, args, L=L: keep_z(m, args, L)
                )
                for L in range(lm.shape.n_layers)
            ]
            try:
                ids = torch.tensor([list(r.input_ids) + tokens[:-1]])
                emb = lm.model.get_input_embeddings()(ids).detach().requires_grad_()  # weights may be frozen
                logits = lm.model(inputs_embeds=emb, use_cache=False).logits[0, n - 1 :].float()
                logits.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)].sum().backward()
            finally:
                for h in handles:
                    h.remove()
            for L, z in zs.items():
                delta = scorer.means[L][None] - z.detach()[:, :n]
                prod = rearrange(delta * z.grad[:, :n], "b p (h d) -> b p h d", h=H).sum(-1)[0]  # "pos head"
                want[i, 0, L] += weight * prod[n - 1].double()
        lm.model.zero_grad(set_to_none=True)
    assert_close32(got, want, scale=max(float(want.abs().max()), 1.0), depth=4 * 40)
    assert float(want.abs().max()) > 1e-4
