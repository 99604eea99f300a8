"""Exact ACDC made affordable (issue 18): incremental + batched + dead-node ACDC equals the plain
algorithm, the EAP pre-filter equals full ACDC when it keeps every edge ACDC keeps, the metrics.

Tiny random llamas (3 layers, 4 query heads, 2 KV groups: 190 edges); seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny

from mechdiff.methods.knowledge.acdc import acdc
from mechdiff.methods.knowledge.discovery import attribution_scores
from mechdiff.methods.knowledge.forward import Ablation, EdgeResume, edge_forward, mean_ablation
from mechdiff.methods.knowledge.graph import EdgeCircuit, Graph


class _FB:
    """A fact batch: prompts and answer tokens."""

    def __init__(self, ids, answers):
        self.ids, self.answers = ids, answers

    def __len__(self) -> int:
        return len(self.answers)


@pytest.fixture(scope="module")
def setup():
    model = make_tiny("llama", None, seed=3)
    g = Graph.for_model(model)
    gen = torch.Generator().manual_seed(4)
    bs = []
    for n_pos in (5, 7):  # two fact batches of different lengths, as the relations give
        ids = torch.randint(0, 2000, (3, n_pos), generator=gen)
        with torch.no_grad():
            answers = model.model(ids).logits[:, -1].argmax(-1)
        bs.append(_FB(ids, answers))
    return model, g, bs


def _plain(model, g, bs, tau, ablation=Ablation(), metric="match_nll"):
    return acdc(model, g, bs, tau, ablation, metric, incremental=False, batch=1, skip_dead=False, progress=False)


@pytest.mark.parametrize("ablation", ["zero", "mean-keep-first"])
def test_stacked_resumed_forward_equals_one_circuit_at_a_time(setup, ablation):
    model, g, bs = setup
    b = bs[0]
    abl = Ablation()
    if ablation != "zero":
        abl = mean_ablation(model, g, bs)
        abl.keep_first = True
    with torch.no_grad():
        start = edge_forward(model, g, b.ids, None, abl, keep_outputs=True)
        off = next(o for k, l, o, r, s in g.blocks if k == "attn" and l == 1)
        masks = np.ones((3, g.n_edges), dtype=bool)
        rng = np.random.default_rng(0)
        for c in range(3):
            masks[c, off + rng.choice(g.n_edges - off, 30, replace=False)] = False
        stacked = edge_forward(model, g, b.ids, masks, abl, resume=EdgeResume(1, start.outputs)).logits
        for c in range(3):
            alone = edge_forward(model, g, b.ids, masks[c], abl).logits
            assert not torch.allclose(alone, start.logits, atol=1e-3)  # the removals matter
            torch.testing.assert_close(stacked[3 * c : 3 * c + 3], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_fast_acdc_equals_plain_acdc(setup, ablation):
    model, g, bs = setup
    abl = mean_ablation(model, g, bs) if ablation == "mean" else Ablation()
    tau = 0.002  # a random tiny model's effects are small: 14 of 190 edges kept
    plain = _plain(model, g, bs, tau, abl)
    assert 0 < plain.mask.sum() < g.n_edges * 0.8  # a real circuit: some edges kept, most removed
    assert plain.trials == g.n_edges and plain.forwards == g.n_edges  # one full forward per edge
    kept_tries = int((plain.effect >= tau).sum())
    assert kept_tries >= 3  # kept edges interrupt the speculative batches
    for kw in (
        dict(incremental=True, batch=1, skip_dead=False),
        dict(incremental=False, batch=6, skip_dead=False),
        dict(incremental=True, batch=6, skip_dead=True),
    ):
        fast = acdc(model, g, bs, tau, abl, progress=False, **kw)
        np.testing.assert_array_equal(fast.mask, plain.mask, err_msg=str(kw))
        np.testing.assert_allclose(fast.effect, plain.effect, atol=1e-5, err_msg=str(kw))
        assert fast.metric_final == pytest.approx(plain.metric_final, abs=1e-5)
        # batching saves forwards (redone tries cost copies); incremental runs compute fewer blocks
        assert fast.forwards < plain.forwards if kw["batch"] > 1 else fast.cost < plain.cost
    assert fast.skipped > 0 and fast.trials + fast.skipped == g.n_edges  # dead nodes were skipped
    assert fast.forwards < g.n_edges / 3


def test_prefilter_equals_full_acdc_when_it_keeps_acdc_edges(setup):
    model, g, bs = setup
    tau = 0.002  # a random tiny model's effects are small: 14 of 190 edges kept
    full = acdc(model, g, bs, tau, progress=False)
    scores = attribution_scores(model, g, bs, "eap", progress=False)
    rank = np.empty(g.n_edges, dtype=int)
    rank[np.argsort(-np.abs(scores), kind="stable")] = np.arange(g.n_edges)
    need = int(rank[full.mask].max()) + 1  # the top-`need` edges by |EAP| contain every edge ACDC keeps
    fraction = need / g.n_edges
    assert need < g.n_edges  # the pre-filter removes something
    pre = acdc(model, g, bs, tau, scores=scores, prefilter=fraction, progress=False)
    assert pre.prefilter == fraction and pre.n_candidates == int(math.ceil(fraction * g.n_edges))
    np.testing.assert_array_equal(pre.mask, full.mask)
    outside = pre.effect[rank >= need]
    assert (np.isnan(outside) | (outside == 0)).all()  # never tried (0: removed as edges into dead nodes)
    assert pre.trials < full.trials
    assert pre.cost < full.cost
    # a pre-filter that drops an edge ACDC keeps cannot keep it
    small = acdc(model, g, bs, tau, scores=scores, prefilter=(need - 1) / g.n_edges, progress=False)
    assert not small.mask[np.flatnonzero(rank == need - 1)].any()


def test_metrics_against_the_model():
    model = make_tiny("llama", None, seed=5, n_layers=1)
    g = Graph.for_model(model)
    ids = torch.randint(0, 2000, (6, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = model.model(ids).logits[:, -1].float()
    answers = logits.argmax(-1)
    answers[::2] = 7  # half the facts: an answer that is not the model's top-1 token
    logp = torch.log_softmax(logits, -1)
    top1 = logits.argmax(-1) == answers
    assert 0 < int(top1.sum()) < 6
    nll = -logp[torch.arange(6), answers]
    b = _FB(ids, answers)
    for metric, want in (("match_nll", nll[top1].mean()), ("nll", nll.mean()), ("kl", 0.0)):
        r = acdc(model, g, [b], 0.01, metric=metric, max_trials=0, progress=False)
        assert r.metric_full == pytest.approx(float(want), abs=1e-5), metric
    empty = np.zeros(g.n_edges, dtype=bool)
    with torch.no_grad():
        lq = torch.log_softmax(edge_forward(model, g, ids, empty).logits.float(), -1)
    kl = float((logp.exp() * (logp - lq)).sum(-1).mean())
    r = acdc(model, g, [b], 1e6, metric="kl", progress=False)  # tau huge: every edge removed
    assert not r.mask.any() and r.metric_final == pytest.approx(kl, rel=1e-4)
    with pytest.raises(ValueError, match="top-1"):
        acdc(model, g, [_FB(ids, torch.full((6,), 7))], 0.01, progress=False)


def test_pipeline_runs_prefiltered_acdc(tmp_path, smollm2_tokenizer):
    from mechdiff.studies.knowledge.results import run_model
    from mechdiff.studies.knowledge.settings import KnowledgeSettings
    from mechdiff.tasks.relation_data import Relation, batches, build_facts

    model = make_tiny("llama", smollm2_tokenizer, seed=3, n_layers=2)
    facts = build_facts(smollm2_tokenizer, Relation.load("country_language"))[:4]
    settings = KnowledgeSettings(
        method="acdc", ablation="zero", tau=0.002, acdc_metric="nll", acdc_prefilter=0.5, n_random=1, k=10
    )
    res = run_model(model, facts, settings, tmp_path, progress=False)
    g = Graph.for_model(model)
    scores = attribution_scores(model, g, batches(facts, settings.batch_size), "eap", progress=False)
    top = np.argsort(-np.abs(scores), kind="stable")[: g.n_edges // 2]
    kept = np.flatnonzero(EdgeCircuit.load(tmp_path / "circuit.json").mask())
    assert res["acdc"]["prefilter"] == 0.5 and res["acdc"]["n_edges"] == res["circuit_edges"] == len(kept) > 0
    assert set(kept) <= set(top)  # only pre-filtered edges can be kept
    assert (tmp_path / "report.md").read_text().count("ACDC") >= 1
