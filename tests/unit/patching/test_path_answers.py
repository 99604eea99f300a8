"""Path patching and the activation scans of answers of several tokens (#40 item 2), against an independent
computation: one plain HF forward per example of prompt + answer (its last token dropped) with torch hooks replacing
the same activations at the prompt's positions, log_softmax summed over the answer's tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import answer_records
from tolerances import tol32

from mechdiff.common.components import Head
from mechdiff.common.metrics import logit_diff
from mechdiff.patching.attribution import attribution_scores
from mechdiff.patching.core import run
from mechdiff.patching.path import Receivers, eligible_senders, path_patch
from mechdiff.patching.path_pairs import prepare
from mechdiff.patching.scan import scan_pairs
from mechdiff.tasks.base import Pair

ANSWERS = [[5, 6, 7], [8, 9], [10], [11, 12, 13]]  # 1 to 3 tokens, right-padded in one batch
ALTERNATIVES = [[1, 2], [3], [4, 14, 15], [16, 17]]


def long_pairs(tokenizer) -> list[Pair]:
    """Pairs of prompts of one length (``num``: the country's number, ``last``), targets of 1 to 3 tokens and one
    alternative each; each source is the next prompt."""
    recs = answer_records(tokenizer, ANSWERS, ALTERNATIVES)
    recs = [dataclasses.replace(r, positions={"num": len(r.input_ids) - 2, "last": len(r.input_ids) - 1}) for r in recs]
    return [
        Pair(r, recs[(i + 1) % len(recs)], "", a[0], target_tokens=tuple(a) if len(a) > 1 else ())
        for i, (r, a) in enumerate(zip(recs, ANSWERS))
    ]


def _z_module(lm, layer):
    return lm.arch.module(lm.model, "z", layer)


def _forward(lm, ids: list[int], pre_hooks=(), hooks=()) -> torch.Tensor:
    """Logits ``"pos vocab"`` of one example, a plain HF forward with torch hooks ``(module, fn)``."""
    handles = [m.register_forward_pre_hook(f) for m, f in pre_hooks] + [m.register_forward_hook(f) for m, f in hooks]
    try:
        with torch.no_grad():
            return lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()


def _logprob(logits: torch.Tensor, prompt_length: int, answer: list[int]) -> float:
    """The answer's summed log-probability from a teacher-forced forward's logits."""
    rows = logits[prompt_length - 1 : prompt_length - 1 + len(answer)].log_softmax(-1)
    return float(rows[torch.arange(len(answer)), torch.tensor(answer)].sum())


def _zs(lm, ids: list[int]) -> dict[int, torch.Tensor]:
    """Every layer's z (``"pos cols"``) of one plain forward."""
    zs: dict[int, torch.Tensor] = {}
    hooks = [
        (_z_module(lm, l), (lambda l: lambda m, a: zs.__setitem__(l, a[0][0].clone()))(l))
        for l in range(lm.shape.n_layers)
    ]
    _forward(lm, ids, hooks)
    return zs


def _freeze(lm, clean_z, source_z, sender: Head, pos: int):
    """o_proj pre-hooks: every head's z at every position = clean (answer positions included), the sender's slice
    at the prompt position ``pos`` = the source's."""
    d = lm.shape.d_head

    def make(layer):
        def hook(module, args):
            z = clean_z[layer].clone()[None]
            if layer == sender.layer:
                z[0, pos, sender.head * d : (sender.head + 1) * d] = source_z[layer][
                    pos, sender.head * d : (sender.head + 1) * d
                ]
            return (z,)

        return hook

    return [(_z_module(lm, l), make(l)) for l in range(lm.shape.n_layers)]


def _patched_logprob(
    lm, pair: Pair, answer: list[int], sender: Head, spos: str, receivers, shift
) -> tuple[float, float]:
    """Clean and path-patched summed log-probability of ``answer`` after ``pair.base``'s prompt (hooks only); the
    sender's counterfactual value is the source prompt's z plus ``shift`` (layer -> ``"pos cols"``)."""
    prompt, n = list(pair.base.input_ids), len(pair.base.input_ids)
    ids = prompt + answer[:-1]
    clean_z = _zs(lm, ids)
    source_z = {l: z + shift[l] for l, z in _zs(lm, list(pair.source.input_ids)).items()}
    freeze = _freeze(lm, clean_z, source_z, sender, pair.base.positions[spos])
    clean = _logprob(_forward(lm, ids), n, answer)
    if receivers is None:
        return clean, _logprob(_forward(lm, ids, freeze), n, answer)
    rpos, (head,) = pair.base.positions[receivers.position], receivers.heads
    kind = receivers.kind
    proj, cols = lm.arch.module(lm.model, kind, head.layer), lm.arch.columns(kind, head.head, lm.shape)
    got = {}
    _forward(lm, ids, freeze, [(proj, lambda m, a, out: got.__setitem__(kind, out[0, rpos, cols].clone()))])

    def write(m, a, out):
        out = out.clone()
        out[0, rpos, cols] = got[kind]
        return out

    return clean, _logprob(_forward(lm, ids, hooks=[(proj, write)]), n, answer)


def _reference(lm, pairs, sender, spos, receivers, metric, shift):
    """Per pair, the clean and patched metric: ``prob`` (exp of the summed log-probability) or ``logit_diff``
    (the answer's summed log-probability minus its alternative's), and the largest |log-probability| involved."""
    clean, patched, scale = [], [], 1.0
    for i, (pair, answer, alternative) in enumerate(zip(pairs, ANSWERS, ALTERNATIVES)):
        row = {l: v[i] for l, v in shift.items()}
        c, p = _patched_logprob(lm, pair, answer, sender, spos, receivers, row)
        if metric == "logit_diff":
            c_alt, p_alt = _patched_logprob(lm, pair, alternative, sender, spos, receivers, row)
            scale = max(scale, abs(c_alt), abs(p_alt))
            c, p = c - c_alt, p - p_alt
        else:
            c, p = np.exp(c), np.exp(p)
        clean.append(c)
        patched.append(p)
        scale = max(scale, abs(np.log(c)) if metric == "prob" else abs(c))
    return np.array(clean), np.array(patched), scale


# (sender position, receivers, full-length runs): step A at the last position (the frozen point run, and the frozen
# run of every position), a receiver's V at last and at an earlier position (the answer reads it through
# attention)
CASES = [
    ("last", None, False),
    ("last", None, True),
    ("last", Receivers((Head(2, 1),), "v", "last"), False),
    ("num", Receivers((Head(2, 1),), "v", "num"), False),
    ("num", Receivers((Head(2, 1),), "v", "num"), True),
]


@pytest.mark.parametrize("metric", ["prob", "logit_diff"])
@pytest.mark.parametrize("score", ["ratio_of_means", "mean_of_ratios"])
@pytest.mark.parametrize("spos,receivers,full", CASES)
def test_path_patching_scores_several_tokens_as_hooked_forwards(
    tiny_llama, smollm2_tokenizer, metric, score, spos, receivers, full
):
    lm, pairs = tiny_llama, long_pairs(smollm2_tokenizer)
    batch = prepare(lm, pairs, metric)
    assert batch.forced is not None and batch.pairs == len(pairs)
    if full:
        batch.clean_kv = None  # full-length runs (as on a model without suffix runs), no point run
    g = torch.Generator().manual_seed(0)  # a source far from clean: scores far above float32 rounding
    shift = {l: 10 * torch.randn(z[: len(pairs)].shape, generator=g) for l, z in batch.source_z.items()}
    batch.source_z = {l: z + batch.forced.stack(shift[l]) for l, z in batch.source_z.items()}  # every answer's row
    senders = [Head(0, 1), Head(1, 2)] + ([Head(2, 3)] if receivers is None else [])
    scores = path_patch(lm, batch, senders, spos, receivers, senders_per_pass=2, progress=False, score=score)
    bounds = []
    for s in senders:
        clean, patched, scale = _reference(lm, pairs, s, spos, receivers, metric, shift)
        if score == "mean_of_ratios":
            want = float(((patched - clean) / clean).mean())
        else:
            want = float((patched.mean() - clean.mean()) / clean.mean())
        # prob: the relative change of exp(S) errs by the error of the summed log-probability S, whose operands are
        # of size |S| (scale); logit_diff: a ratio of differences of such sums, over the clean difference
        denom = 1.0 if metric == "prob" else float(np.abs(clean).min())
        bounds.append(tol32((1 + abs(want)) * scale / denom))
        assert abs(scores[s] - want) <= bounds[-1], (s, scores[s], want, bounds[-1])
    # not vacuous: some sender moves its score far beyond the tolerance
    assert max(abs(v) for v in scores.values()) > 10 * max(bounds)


@pytest.mark.parametrize(
    "spos,receivers",
    [("last", None), ("num", None), ("num", Receivers((Head(2, 1),), "q", "last"))] + [c[:2] for c in CASES[2:4]],
)
def test_a_sender_equal_to_its_clean_value_changes_nothing(tiny_llama, smollm2_tokenizer, spos, receivers):
    """Pairs whose counterfactual is the clean prompt: every sender's score stays at zero change."""
    lm = tiny_llama
    pairs = [dataclasses.replace(p, source=p.base) for p in long_pairs(smollm2_tokenizer)]
    batch = prepare(lm, pairs, "logit_diff")
    scores = path_patch(lm, batch, eligible_senders(lm, receivers), spos, receivers, 5, progress=False)
    assert len(scores) == len(eligible_senders(lm, receivers))
    clean = batch.p_clean.abs()
    # a relative change of float32 log-probability sums of size <= 40 (their operands), over the clean difference
    assert max(abs(v) for v in scores.values()) <= tol32(40 / float(clean.min()))


def test_one_token_pairs_keep_the_one_token_batch(tiny_llama, smollm2_tokenizer):
    """Targets and alternatives of one token: no teacher forcing, the prompts alone read at their last position and
    the metric the one-token one, bitwise (the same run and functions as before answers of several tokens)."""
    recs = answer_records(smollm2_tokenizer, [[5], [7]], [[13], [17]])
    pairs = [Pair(recs[0], recs[1], "", 5), Pair(recs[1], recs[0], "", 7)]
    batch = prepare(tiny_llama, pairs, "logit_diff")
    assert batch.forced is None and batch.pairs == 2 and batch.clean_ids.shape[1] == len(recs[0].input_ids)
    logits = run(tiny_llama, batch.clean_ids).logits
    assert torch.equal(batch.p_clean, logit_diff(logits, torch.tensor([5, 7]), torch.tensor([[13], [17]])))


def test_the_attribution_screen_tracks_exact_scores_of_several_tokens(tiny_llama, smollm2_tokenizer):
    lm = tiny_llama
    batch = prepare(lm, long_pairs(smollm2_tokenizer), "prob")
    for position, receivers in (("last", None), ("last", Receivers((Head(2, 1), Head(2, 2)), "q", "last"))):
        senders = eligible_senders(lm, receivers)
        exact = path_patch(lm, batch, senders, position, receivers, senders_per_pass=6, progress=False)
        approx = attribution_scores(lm, batch, position, receivers)
        e, a = np.array([exact[h] for h in senders]), np.array([approx[h] for h in senders])
        assert np.corrcoef(e, a)[0, 1] > 0.95


def _writer(where: list[int], value: torch.Tensor, cols=slice(None)):
    """A forward pre-hook (with kwargs) writing ``value`` (``"pos cols"``) into a module's first input at the
    prompt positions ``where`` (its ``hidden_states`` where passed by keyword)."""

    def pre(m, a, kw):
        x = (a[0] if a else kw["hidden_states"]).clone()
        x[0, where, cols] = value[where, cols]
        return ((x, *a[1:]), kw) if a else (a, {**kw, "hidden_states": x})

    return pre


def _input_of(lm, module, ids: list[int]) -> torch.Tensor:
    """The first input (``"pos cols"``) of ``module`` in a plain forward."""
    got = {}

    def grab(m, a, kw):
        got["x"] = (a[0] if a else kw["hidden_states"])[0].clone()

    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _forward(lm, ids)
    finally:
        handle.remove()
    return got["x"]


def _scan_reference(lm, pairs, module, where, cols, metric: str) -> tuple[float, float]:
    """The change of the mean metric when ``module``'s input at the prompt positions ``where(pair)`` (``cols``) is
    the source prompt's, each answer teacher-forced in a plain forward with hooks; and the size of its operands: the
    largest |summed log-prob| (logit_diff), times the largest probability (prob: exp of such sums)."""
    clean, patched, scale = [], [], 1.0
    for pair, answer, alternative in zip(pairs, ANSWERS, ALTERNATIVES):
        n, c, p = len(pair.base.input_ids), [], []
        for tokens in [answer] + ([alternative] if metric == "logit_diff" else []):
            ids = list(pair.base.input_ids) + tokens[:-1]
            source = _input_of(lm, module, list(pair.source.input_ids) + tokens[:-1])
            c.append(_logprob(_forward(lm, ids), n, tokens))
            handle = module.register_forward_pre_hook(_writer(where(pair), source, cols), with_kwargs=True)
            try:
                p.append(_logprob(_forward(lm, ids), n, tokens))
            finally:
                handle.remove()
            scale = max(scale, abs(c[-1]), abs(p[-1]))
        clean.append(c[0] - c[1] if metric == "logit_diff" else np.exp(c[0]))
        patched.append(p[0] - p[1] if metric == "logit_diff" else np.exp(p[0]))
    size = 1.0 if metric == "logit_diff" else max(max(clean), max(patched))
    return float(np.mean(patched) - np.mean(clean)), scale * size


@pytest.mark.parametrize("metric", ["prob", "logit_diff"])
@pytest.mark.parametrize("site,position", [("z", "last"), ("z", None), ("resid", "num")])
def test_scans_score_several_tokens_as_hooked_forwards(tiny_llama, smollm2_tokenizer, metric, site, position):
    """Head scans (at the last position, at every prompt position) and a residual scan, each cell against plain
    forwards of prompt + answer with the component's input at the prompt's positions taken from the source."""
    lm, pairs = tiny_llama, long_pairs(smollm2_tokenizer)
    result = scan_pairs(lm, pairs, site=site, position=position, metric=metric, per_pass=5)
    assert result.forced
    assert ("summed log-probability" if metric == "logit_diff" else "product of its tokens") in result.label
    want, scales = torch.zeros_like(result.effects, dtype=torch.float64), []
    d = lm.shape.d_head
    for layer in range(lm.shape.n_layers):
        if site == "resid":
            for j, p in enumerate(result.positions):
                block = lm.arch.block(lm.model, layer)  # its input: the embedding output at layer 0
                want[layer, j], scale = _scan_reference(lm, pairs, block, lambda pair: [p], slice(None), metric)
                scales.append(scale)
            continue
        for head in range(lm.shape.n_heads):
            where = (lambda pair: list(range(len(pair.base.input_ids)))) if position is None else None
            where = where or (lambda pair: [pair.base.positions[position]])
            cols = slice(head * d, (head + 1) * d)
            want[layer, head], scale = _scan_reference(lm, pairs, _z_module(lm, layer), where, cols, metric)
            scales.append(scale)
    # logit_diff: sums of log-probabilities of size <= |S|; prob: exp(S) errs relatively by the error of S
    bound = tol32(max(scales))
    assert float((result.effects.double() - want).abs().max()) <= bound
    assert float(want.abs().max()) > 5 * bound  # not vacuous: the patches move the metric beyond the tolerance


def test_discovery_runs_a_plan_on_answers_of_several_tokens(tiny_llama, smollm2_tokenizer):
    """A two-step plan (senders -> logits at last, senders at num -> A's V at num) on teacher-forced pairs: each
    step's selection is the most negative of its exact scores, and the circuit records the clean metric per pair."""
    from mechdiff.circuits.discovery import DiscoverySettings, discover
    from mechdiff.tasks.plan import Plan, PlanStep

    lm, pairs = tiny_llama, long_pairs(smollm2_tokenizer)
    plan = Plan("two", (PlanStep("A", "last", 2), PlanStep("B", "num", 1, receiver="A", site="v")))
    circuit, results = discover(lm, pairs, DiscoverySettings(n_prompts=len(pairs)), "long", False, plan=plan)
    batch = prepare(lm, pairs)
    assert circuit.meta["p_clean"] == float(batch.p_clean.mean())  # the same clean runs: exact
    assert len(batch.p_clean) == len(pairs)
    for step, result in results.items():
        ranked = sorted(result.exact, key=lambda h: (result.exact[h], h))
        assert result.selected == ranked[: len(result.selected)] and circuit.groups[step] == result.selected
    assert results["B"].receivers.heads == tuple(results["A"].selected)


def _metric(lm, prompt: list[int], answer: list[int], alternative: list[int], metric: str) -> float:
    """One prompt's metric by plain teacher-forced forwards."""
    logp = _logprob(_forward(lm, prompt + answer[:-1]), len(prompt), answer)
    if metric == "prob":
        return float(np.exp(logp))
    return logp - _logprob(_forward(lm, prompt + alternative[:-1]), len(prompt), alternative)


@pytest.mark.parametrize("metric", ["prob", "logit_diff"])
def test_a_scan_of_several_tokens_reports_clean_and_source_and_refuses_answer_logit(
    tiny_llama, smollm2_tokenizer, metric
):
    """The scan's clean and source values: the mean metric of the clean prompts and of the source prompts followed
    by the same answers; answer_logit, a one-token measure, is refused for such answers before any run."""
    lm, pairs = tiny_llama, long_pairs(smollm2_tokenizer)
    result = scan_pairs(lm, pairs, site="z", position="last", metric=metric, per_pass=12)
    for got, which in ((result.clean, "base"), (result.source, "source")):
        values = [
            _metric(lm, list(getattr(p, which).input_ids), a, alt, metric)
            for p, a, alt in zip(pairs, ANSWERS, ALTERNATIVES)
        ]
        scale = 40.0 * (max(values) if metric == "prob" else 1.0)  # summed log-probabilities of size <= 40
        assert abs(got - float(np.mean(values))) <= tol32(scale), (which, got, np.mean(values))
    assert result.clean != pytest.approx(result.source, rel=1e-3)  # the two differ: the check is not vacuous
    with pytest.raises(ValueError, match="answers of several tokens are scanned under prob or logit_diff"):
        scan_pairs(None, pairs, metric="answer_logit")  # no model needed: refused first


def test_a_pairs_answers_share_its_random_source_draws(tiny_llama, smollm2_tokenizer):
    """A sender read at a random index of a position class draws once per pair: every answer's row of a pair reads
    the same index, the one a one-token batch of the same prompts draws (same seed, same table)."""
    from mechdiff.patching.path import source_indices

    def with_class(pairs):
        def add(r):
            return dataclasses.replace(r, positions={**r.positions, "both": (r.positions["num"], r.positions["last"])})

        return [dataclasses.replace(p, base=add(p.base), source=add(p.source)) for p in pairs]

    pairs = with_class(long_pairs(smollm2_tokenizer))
    one_token = [
        dataclasses.replace(
            p, target_tokens=(), base=dataclasses.replace(p.base, answer_tokens=(), alternative_tokens=())
        )
        for p in pairs
    ]
    forced, plain = prepare(tiny_llama, pairs, "logit_diff"), prepare(tiny_llama, one_token)
    assert forced.forced.count == 2 and plain.forced is None
    senders = eligible_senders(tiny_llama, None)
    drawn = source_indices(tiny_llama, forced, senders, "both", "7")
    want = source_indices(tiny_llama, plain, senders, "both", "7")
    n = len(pairs)
    assert torch.equal(drawn[:, :n], want) and torch.equal(drawn[:, n:], want)
    assert len(set(want.flatten().tolist())) == 2  # both indices drawn: the draw is not constant
