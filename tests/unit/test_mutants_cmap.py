"""Tests added from mutmut's survivors in ``mechdiff/methods/cmap.py`` (see benchmarks/mutation.md): the patch
builders' exact patches and isolation masks, the result's rows, recovered shares and per-prompt outcomes
from hand-made scores, its JSON form, and ``run_cmap`` against patched runs computed here (full runs, no
suffix runs), with its group filter, random control, settings and the suffix runs it asks for."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mechdiff.circuits.circuit import Circuit
from mechdiff.methods.cmap import (CAPTION, CAPTION_UNISOLATED, CMAPResult, CMAPRow, _result, capture_sites, cmap_patches,
                           isolation_patches, parse_kinds, random_scope, run_cmap, scopes)
from mechdiff.common.components import Head
from mechdiff.common.metrics import answer_is_top1, answer_prob
from mechdiff.patching import core
from mechdiff.common.stats import Estimate, bootstrap, mean_estimate
from mechdiff.tasks.entity_tracking import batch_tensors, generate


def test_parse_kinds_names_the_bad_kinds_and_the_choices():
    assert parse_kinds(" Z, qkv ,") == ["z", "qkv"]
    with pytest.raises(ValueError) as err:
        parse_kinds("z,o")
    assert str(err.value) == "unknown CMAP kinds ['o']; choose from z, q, k, v, qk, qkv"
    with pytest.raises(ValueError) as err:
        parse_kinds(" , ")
    assert str(err.value) == "unknown CMAP kinds []; choose from z, q, k, v, qk, qkv"


# ------------------------------------------------------------------------------------------ patch builders
N, L = 3, 5  # prompts, positions


def _captured(model) -> dict:
    gen = torch.Generator().manual_seed(0)
    shape = model.shape
    width = {"q": shape.n_heads * shape.d_head, "z": shape.n_heads * shape.d_head,
             "k": shape.n_kv_heads * shape.d_head, "v": shape.n_kv_heads * shape.d_head}
    return {(c, l): torch.randn(N, L, w, generator=gen) for c, w in width.items() for l in range(shape.n_layers)}


def test_cmap_patches_one_per_head_for_z_q_and_one_per_kv_group_for_k_v(tiny_llama):
    """z/q: one position-indexed patch per (head, position); k/v: one masked patch per (KV group, position),
    kept from every position after it; a position 0 is a position, -1 (absent) is refused."""
    model, cap = tiny_llama, _captured(tiny_llama)
    assert model.shape.group_size == 2
    positions = {"p": torch.tensor([0, 2, 4]), "last": torch.tensor([4, 4, 4])}
    # heads 2 and 3 of layer 1 share KV group 1; a head of layer 2 and a second position come after them
    scope = [(Head(1, 2), "p"), (Head(1, 3), "p"), (Head(2, 0), "p"), (Head(1, 2), "last")]
    rows = torch.arange(N)
    for kind in ("z", "q"):
        patches = cmap_patches(model, scope, kind, cap, positions, L)
        assert len(patches) == len(scope)
        for p, (head, pos) in zip(patches, scope):
            cols = model.arch.columns(kind, head.head, model.shape)
            assert (p.kind, p.layer, p.columns, p.mask) == (kind, head.layer, cols, None)
            assert torch.equal(p.positions, positions[pos])
            assert torch.equal(p.value, cap[(kind, head.layer)][rows, positions[pos], cols])
    for kind in ("k", "v"):
        patches = cmap_patches(model, scope, kind, cap, positions, L)
        want = [(1, 1, "p"), (2, 0, "p"), (1, 1, "last")]  # (layer, KV group, position)
        assert len(patches) == len(want)
        for p, (layer, group, pos) in zip(patches, want):
            cols = model.arch.columns(kind, 2 * group, model.shape)
            assert (p.kind, p.layer, p.columns, p.positions) == (kind, layer, cols, None)
            assert torch.equal(p.value, cap[(kind, layer)][:, :, cols])
            after = torch.tensor([[float(t > int(positions[pos][b])) for t in range(L)] for b in range(N)])
            assert torch.equal(p.mask, after[..., None])
    both = cmap_patches(model, scope, "qk", cap, positions, L)
    assert [p.kind for p in both] == ["q"] * 4 + ["k"] * 3
    with pytest.raises(ValueError) as err:
        cmap_patches(model, scope, "q", cap, {"p": torch.tensor([1, -1, 2]), "last": positions["last"]}, L)
    assert str(err.value) == "position 'p' is absent from some prompts; CMAP needs it in every prompt"


def _isolation_masks(shape, scope, kind: str, positions: dict, layer: int) -> torch.Tensor:
    """The documented rule, example by example: 1 (keep the patched run) at the read-out and the scope's
    positions; in a layer whose K/V are patched, the patched KV groups' heads only at their own position."""
    keep = torch.zeros(N, L, shape.n_heads)
    for b in range(N):
        free = {int(positions["last"][b])} | {int(positions[p][b]) for _, p in scope}
        for t in free:
            keep[b, t, :] = 1
        ours = [(h.head, int(positions[p][b])) for h, p in scope if h.layer == layer]
        if set(kind) & {"k", "v"} and ours:
            for g in {h // shape.group_size for h, _ in ours}:
                keep[b, :, g * shape.group_size:(g + 1) * shape.group_size] = 0
            for h, t in ours:
                keep[b, t, h] = 1
    return keep.repeat_interleave(shape.d_head, dim=2)


@pytest.mark.parametrize("kind", ["q", "k", "v", "qkv"])
def test_isolation_patches_masks(tiny_llama, kind):
    model, shape = tiny_llama, tiny_llama.shape
    base_z = {l: torch.randn(N, L, shape.n_heads * shape.d_head) for l in range(shape.n_layers)}
    positions = {"p": torch.tensor([0, 2, 3]), "last": torch.tensor([4, 4, 4])}
    scope = [(Head(1, 3), "p")]  # KV group 1: heads 2 and 3
    patches = isolation_patches(model, scope, kind, base_z, positions, L)
    assert [p.layer for p in patches] == [1, 2]  # from the scope's first layer on
    for p in patches:
        assert (p.kind, p.positions, p.columns) == ("z", None, None) and p.value is base_z[p.layer]
        assert torch.equal(p.mask, _isolation_masks(shape, scope, kind, positions, p.layer))
    d = shape.d_head
    head = lambda h: slice(h * d, (h + 1) * d)  # noqa: E731
    m1 = patches[0].mask
    assert bool((m1[:, 4, head(0)] == 1).all()) and bool((m1[:, 1, head(0)] == 0).all())
    kv = set(kind) & {"k", "v"}
    # heads 2 and 3 at the read-out: restored where K/V are patched, free for a Q patch
    assert bool((m1[:, 4, head(2)] == (0 if kv else 1)).all()) and bool((m1[:, 4, head(3)] == (0 if kv else 1)).all())
    assert bool((m1[torch.arange(N), positions["p"]][:, head(3)] == 1).all())
    assert bool((patches[1].mask[:, 4, head(3)] == 1).all())  # layer 2 has no patched K/V
    assert isolation_patches(model, scope, "z", base_z, positions, L) == []


# ------------------------------------------------------------------------------------------------- result
def _scores() -> dict:
    arr = lambda *x: np.array(x, dtype=float)  # noqa: E731
    return {"base": ([arr(1, 0), arr(0, 1)], [arr(.6, .2), arr(.1, .7)]),
            "finetune": ([arr(1, 1), arr(1, 0)], [arr(.8, .9), arr(.7, .3)]),
            ("A", "z"): ([arr(1, 1), arr(0, 0)], [arr(.9, .6), arr(.2, .1)]),
            ("A", "q"): ([arr(1, 1), arr(1, 1)], [arr(.9, .8), arr(.7, .6)]),
            ("random:A", "z"): ([arr(.5, 1), arr(0, 0)], [arr(.4, .5), arr(.3, .2)])}


def _circuit() -> Circuit:
    return Circuit("c", "t", {"A": [Head(0, 1)], "E": []}, {"A": "last", "E": "query_label"})


def test_result_rows_recovered_shares_and_outcomes():
    scores = _scores()
    names = SimpleNamespace(name="base-model"), SimpleNamespace(name="ft-model")
    res = _result(*names, _circuit(), scores, {"A": None}, ["z", "q"])
    assert (res.base, res.finetune) == ("base-model", "ft-model")
    assert res.base_accuracy == mean_estimate([1, 0, 0, 1]) and res.finetune_accuracy == mean_estimate([1, 1, 1, 0])
    assert res.base_answer_prob == bootstrap([.6, .2, .1, .7])
    assert res.finetune_answer_prob == bootstrap([.8, .9, .7, .3])
    assert res.positions == {"A": "last", "E": "query_label"}
    assert [(r.scope, r.kind) for r in res.rows] == [("A", "z"), ("A", "q")]
    assert [(r.scope, r.kind) for r in res.random_rows] == [("random:A", "z")]
    # recovered = (patched - base) / (fine-tune - base): (0.5 - 0.5) / 0.25, (1 - 0.5) / 0.25, (0.375 - 0.5) / 0.25
    assert [r.recovered for r in res.rows] == [0.0, 2.0] and res.random_rows[0].recovered == pytest.approx(-0.5)
    assert res.rows[1].accuracy == mean_estimate([1, 1, 1, 1])
    assert res.rows[1].answer_prob == bootstrap([.9, .8, .7, .6])
    assert res.random_rows[0].accuracy == mean_estimate([.5, 1, 0, 0])
    # outcomes: 0/1 ints, and a random scope's share of right draws kept as is (the JSON shows which)
    assert json.dumps(res.outcomes) == json.dumps({"base": [1, 0, 0, 1], "finetune": [1, 1, 1, 0], "A/z": [1, 1, 0, 0],
                                                   "A/q": [1, 1, 1, 1], "random:A/z": [0.5, 1.0, 0.0, 0.0]})
    tied = dict(scores, finetune=scores["base"])
    assert all(np.isnan(r.recovered) for r in _result(*names, _circuit(), tied, {"A": None}, ["z", "q"]).rows)


def test_result_to_dict_is_its_json_form():
    e = lambda v: Estimate(v, v - .1, v + .1, 4)  # noqa: E731
    row = CMAPRow("A", "qk", e(.5), e(.25), 0.75)
    rnd = CMAPRow("random:A", "qk", e(.3), e(.2), -0.25)
    res = CMAPResult("b", "f", e(.4), e(.9), [row], e(.1), e(.6), {"A": "last"}, "cap", [rnd], {"base": [1, 0]},
                     {"seed": 3})
    est = lambda v: {"value": v, "low": v - .1, "high": v + .1, "n": 4}  # noqa: E731
    assert row.to_dict() == {"scope": "A", "kind": "qk", "accuracy": est(.5), "answer_prob": est(.25), "recovered": 0.75}
    assert res.to_dict() == {
        "base": "b", "finetune": "f", "caption": "cap", "base_accuracy": est(.4), "finetune_accuracy": est(.9),
        "base_answer_prob": est(.1), "finetune_answer_prob": est(.6), "positions": {"A": "last"},
        "rows": [row.to_dict()], "random_rows": [rnd.to_dict()], "outcomes": {"base": [1, 0]}, "settings": {"seed": 3}}
    no_probs = CMAPResult("b", "f", e(.4), e(.9), [row]).to_dict()
    assert "base_answer_prob" not in no_probs and "finetune_answer_prob" not in no_probs
    assert no_probs["caption"] == CAPTION and no_probs["random_rows"] == [] and no_probs["settings"] == {}


# ----------------------------------------------------------------------------------------------- run_cmap
def perturb_qkv(model, seed: int = 1):
    """A copy of ``model`` whose Q/K/V projections differ (as in test_cmap.py)."""
    other = dataclasses.replace(model, name=model.name + "-qkv", model=copy.deepcopy(model.model))
    gen = torch.Generator().manual_seed(seed)
    for layer in range(other.shape.n_layers):
        for mod in {id(m): m for m in (other.arch.module(other.model, k, layer) for k in ("q", "k", "v"))}.values():
            mod.weight.add_(torch.randn(mod.weight.shape, generator=gen) * 0.5)
    return other


def _expected(base, donor, records, circuit, scope_items, kinds, isolate: bool, batch_size: int) -> dict:
    """Per prompt ``(correct, answer prob)`` per key, from full patched runs of each batch."""
    heads = circuit.heads()
    out: dict = {}
    for i in range(0, len(records), batch_size):
        batch = batch_tensors(records[i:i + batch_size])
        ids, answer, positions = batch["input_ids"], batch["answer_ids"], batch["positions"]
        cap = core.run(donor, ids, capture=capture_sites(heads)).captured
        plain = core.run(base, ids, capture=[("z", l) for l in range(base.shape.n_layers)])
        base_z = {l: t for (_, l), t in plain.captured.items()}
        logits = {"base": plain.logits, "finetune": core.run(donor, ids).logits}
        for key, draws in scope_items:
            for kind in kinds:
                runs = []
                for pairs in draws:
                    patches = cmap_patches(base, pairs, kind, cap, positions, ids.shape[1])
                    if isolate:
                        patches += isolation_patches(base, pairs, kind, base_z, positions, ids.shape[1])
                    lg = core.run(base, ids, patches).logits
                    runs.append((answer_is_top1(lg, answer).float(), answer_prob(lg, answer)))
                out.setdefault((key, kind), []).append((torch.stack([r[0] for r in runs]).mean(0),
                                                        torch.stack([r[1] for r in runs]).mean(0)))
        for key, lg in logits.items():
            out.setdefault(key, []).append((answer_is_top1(lg, answer).float(), answer_prob(lg, answer)))
    return {k: (torch.cat([v[0] for v in vs]).tolist(), torch.cat([v[1] for v in vs]).tolist()) for k, vs in out.items()}


def _check(res, want: dict) -> None:
    for key, (correct, prob) in want.items():
        name = key if isinstance(key, str) else "/".join(key)
        assert res.outcomes[name] == pytest.approx(correct), name
        got = {"base": res.base_answer_prob, "finetune": res.finetune_answer_prob}.get(name) or next(
            r.answer_prob for r in res.rows + res.random_rows if (r.scope, r.kind) == key)
        assert got.value == pytest.approx(float(np.mean(prob)), rel=1e-5), name
        assert got.n == len(prob), name


def test_run_cmap_against_full_patched_runs(tiny_llama, smollm2_tokenizer, monkeypatch, capsys):
    """Groups chosen, a seeded random control, isolation on and off: each row's per-prompt outcomes and mean
    answer probability equal the full patched runs'; the patched runs resume at their scope's first layer
    from the plain run's residual and read its keys and values; nothing is printed with ``progress=False``."""
    base, donor = tiny_llama, perturb_qkv(tiny_llama)
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=1)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]},
                      {"A": "last", "C": "query_label"})
    calls: list = []

    def spy(model, ids, patches=(), **kw):
        out = core.run(model, ids, patches, **kw)
        calls.append((model.name, list(patches), kw, out))
        return out

    monkeypatch.setattr("mechdiff.methods.cmap.run", spy)
    res = run_cmap(base, donor, circuit, records, kinds=("v",), batch_size=3, groups=["A"], progress=False,
                   n_random=2, seed=3)
    rng = random.Random(3)
    draws = [random_scope(scopes(circuit)["A"], base.shape.n_heads, rng) for _ in range(2)]
    assert draws[0] != draws[1]
    _check(res, _expected(base, donor, records, circuit, [(("A"), [scopes(circuit)["A"]]), ("random:A", draws)],
                          ["v"], True, 3))
    assert [(r.scope, r.kind) for r in res.rows] == [("A", "v")]
    assert [(r.scope, r.kind) for r in res.random_rows] == [("random:A", "v")]
    assert res.caption == CAPTION
    assert res.settings == {"isolate": True, "n_random": 2, "seed": 3, "n_prompts": 6}
    assert res.positions == {"A": "last", "C": "query_label"}
    # per batch: the donor, the plain base (residual before layer 1, z from layer 1, keys and values), 3 patched
    plain = [c for c in calls if c[0] == base.name and not c[1]]
    patched = [c for c in calls if c[1]]
    assert len(plain) == 2 and len(patched) == 6 and len(calls) == 10
    for _, _, kw, _ in plain:
        assert kw == {"capture": [("resid", 0), ("z", 1), ("z", 2)], "keep_kv": True}
    for i, (_, _, kw, _) in enumerate(patched):
        assert kw["resume"].layer == 1 and kw["prefix"] is plain[i // 3][3].kv and kw["prefix"] is not None
        assert torch.equal(kw["resume"].hidden, plain[i // 3][3].captured[("resid", 0)])
    assert capsys.readouterr().err == ""

    calls.clear()
    loose = run_cmap(base, donor, circuit, records, kinds=("q",), batch_size=6, isolate=False, progress=False)
    sc = scopes(circuit)
    _check(loose, _expected(base, donor, records, circuit, [(g, [sc[g]]) for g in ("A", "C", "circuit")], ["q"],
                            False, 6))
    assert loose.caption == CAPTION_UNISOLATED and loose.random_rows == []
    assert loose.settings == {"isolate": False, "n_random": 0, "seed": 0, "n_prompts": 6}
    assert [c[2] for c in calls if c[0] == base.name and not c[1]] == [{"capture": [("resid", 0)], "keep_kv": True}]
    assert [c[2]["resume"] is None for c in calls if c[1]] == [False, True, True]  # A at layer 1; C, circuit at 0
    one = run_cmap(base, donor, circuit, records, kinds=("z",), batch_size=6, groups=["C"], progress=False, n_random=1)
    assert [(r.scope, r.kind) for r in one.random_rows] == [("random:C", "z")]  # a single draw is a control too
    assert capsys.readouterr().err == ""


def test_run_cmap_refuses_empty_circuits_and_unknown_groups(tiny_llama, smollm2_tokenizer):
    records = generate(smollm2_tokenizer, 2, n_boxes=3, seed=1)
    empty = Circuit("tiny", "entity-tracking", {"A": []}, {"A": "last"})
    with pytest.raises(ValueError) as err:
        run_cmap(tiny_llama, tiny_llama, empty, records, progress=False)
    assert str(err.value) == "the circuit has no heads; nothing to patch"
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(0, 1)], "C": []}, {"A": "last", "C": "last"})
    with pytest.raises(ValueError) as err:
        run_cmap(tiny_llama, tiny_llama, circuit, records, groups=["A", "C", "Z"], progress=False)
    assert str(err.value) == "groups ['C', 'Z'] are not in the circuit or empty (groups: ['A', 'C'])"
