"""CMAP on tiny models: z patching reproduces the donor where weights agree, Q/K/V patches touch only
the head / KV group they name, identical models change nothing, and the CLI writes its outputs."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tiny
from tolerances import tol32

from mechdiff.circuits.circuit import Circuit
from mechdiff.cli import main as cli_main
from mechdiff.common.components import Head, all_heads
from mechdiff.common.inference import Interval
from mechdiff.common.metrics import answer_is_top1, answer_prob
from mechdiff.common.outcomes import from_bits
from mechdiff.common.stats import bootstrap, mean_estimate
from mechdiff.methods.cmap import CAPTION, CAPTION_UNISOLATED, CMAPResult, CMAPRow, _result, run_cmap
from mechdiff.methods.cmap_patches import (
    capture_sites,
    cmap_patches,
    isolation_patches,
    parse_kinds,
    random_scope,
    scopes,
)
from mechdiff.patching import core
from mechdiff.patching.core import Patch, run
from mechdiff.report.bars import grouped_bars
from mechdiff.tasks.entity_tracking import batch_tensors, generate

LAYER = 1


def perturb_qkv(model, seed: int = 1):
    """A copy of ``model`` whose Q/K/V projections differ; o_proj, MLPs and embeddings are shared."""
    other = dataclasses.replace(model, name=model.name + "-qkv", model=copy.deepcopy(model.model))
    gen = torch.Generator().manual_seed(seed)
    for layer in range(other.shape.n_layers):
        mods = {id(m): m for m in (other.arch.module(other.model, k, layer) for k in ("q", "k", "v"))}
        for mod in mods.values():
            mod.weight.add_(torch.randn(mod.weight.shape, generator=gen) * 0.5)
    return other


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return batch_tensors(generate(smollm2_tokenizer, 6, n_boxes=3, seed=0))


def test_z_patch_at_every_position_reproduces_donor(tiny_model, prompts):
    donor = perturb_qkv(tiny_model)
    ids = prompts["input_ids"]
    layers = range(tiny_model.shape.n_layers)
    cap = run(donor, ids, capture=[("z", l) for l in layers]).captured
    want = run(donor, ids).logits
    assert not torch.allclose(run(tiny_model, ids).logits, want, atol=1e-4)
    got = run(tiny_model, ids, [Patch("z", l, cap[("z", l)]) for l in layers]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cmap_z_of_every_head_at_last_reproduces_donor_logits(tiny_model, prompts):
    """Attention reaches the last token only through its z, so every head's z at ``last`` suffices."""
    donor = perturb_qkv(tiny_model)
    shape = tiny_model.shape
    scope = [(h, "last") for h in all_heads(shape.n_layers, shape.n_heads)]
    ids = prompts["input_ids"]
    cap = run(donor, ids, capture=[("z", l) for l in range(shape.n_layers)]).captured
    patches = cmap_patches(tiny_model, scope, "z", cap, prompts["positions"], ids.shape[1])
    torch.testing.assert_close(run(tiny_model, ids, patches).logits, run(donor, ids).logits, rtol=1e-5, atol=1e-5)


def _expected(model, kind: str, head: Head, pos: torch.Tensor, base: torch.Tensor, donor: torch.Tensor) -> torch.Tensor:
    """``base`` with the donor's values where a ``kind`` patch of ``head`` at ``pos`` must write."""
    out = base.clone()
    cols = model.arch.columns(kind, head.head, model.shape)
    for b, p in enumerate(pos.tolist()):
        where = slice(p, p + 1) if kind == "q" else slice(0, p + 1)  # K/V: every position up to and including p
        out[b, where, cols] = donor[b, where, cols]
    return out


@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_qkv_patch_touches_only_its_head_or_kv_group(tiny_model, prompts, kind):
    donor = make_tiny(tiny_model.arch.name, seed=7)
    head = Head(LAYER, 3)
    ids, positions = prompts["input_ids"], prompts["positions"]
    pos = positions["query_label"]
    sites = [(k, LAYER) for k in ("q", "k", "v")]
    base_cap = run(tiny_model, ids, capture=sites).captured
    donor_cap = run(donor, ids, capture=sites).captured
    patches = cmap_patches(tiny_model, [(head, "query_label")], kind, donor_cap, positions, ids.shape[1])
    got = run(tiny_model, ids, patches, capture=sites).captured
    want = _expected(tiny_model, kind, head, pos, base_cap[(kind, LAYER)], donor_cap[(kind, LAYER)])
    assert not torch.equal(want, base_cap[(kind, LAYER)])
    torch.testing.assert_close(got[(kind, LAYER)], want, rtol=0, atol=0)  # exact: a copy of the donor's columns
    if tiny_model.arch.qkv_layout == "separate":  # the other projections are untouched
        for other in {"q", "k", "v"} - {kind}:
            assert torch.equal(got[(other, LAYER)], base_cap[(other, LAYER)])


def test_gqa_kv_patch_covers_whole_group_only(tiny_llama, prompts):
    """Head 3 reads KV group 1 (heads 2, 3): group 0's columns never change."""
    donor = make_tiny("llama", seed=5)
    ids, positions = prompts["input_ids"], prompts["positions"]
    sites = [("q", LAYER), ("k", LAYER), ("v", LAYER)]
    cap = run(donor, ids, capture=sites).captured
    base = run(tiny_llama, ids, capture=sites).captured
    patches = cmap_patches(
        tiny_llama, [(Head(LAYER, 3), "last"), (Head(LAYER, 2), "last")], "qkv", cap, positions, ids.shape[1]
    )
    assert sum(p.kind == "k" for p in patches) == 1  # heads 2 and 3 share one KV group: one K patch
    got = run(tiny_llama, ids, patches, capture=[("k", LAYER), ("v", LAYER)]).captured
    for kind in ("k", "v"):
        assert torch.equal(got[(kind, LAYER)][..., :8], base[(kind, LAYER)][..., :8])
        assert torch.equal(got[(kind, LAYER)][..., 8:16], cap[(kind, LAYER)][..., 8:16])


def test_cmap_identical_models_changes_nothing(tiny_llama, smollm2_tokenizer):
    records = generate(smollm2_tokenizer, 4, n_boxes=3, seed=1)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]}, {"A": "last", "C": "query_label"}
    )
    twin = dataclasses.replace(tiny_llama, name="twin", model=copy.deepcopy(tiny_llama.model))
    res = run_cmap(tiny_llama, twin, circuit, records, kinds=("z", "q", "qkv"), batch_size=4, progress=False)
    assert res.base_accuracy == res.finetune_accuracy
    assert {r.scope for r in res.rows} == {"A", "C", "circuit"}
    assert {r.kind for r in res.rows} == {"z", "q", "qkv"}
    for r in res.rows:
        assert r.accuracy == res.base_accuracy
        # a probability's relative rounding is its logits' absolute rounding (the tiny model's logits: < 1)
        assert r.answer_prob.value == pytest.approx(res.base_answer_prob.value, rel=tol32(1))


def test_parse_kinds_rejects_unknown():
    with pytest.raises(ValueError, match="unknown CMAP kinds"):
        parse_kinds("z,o")


def test_grouped_bars_writes_png(tmp_path):
    est = Interval(0.5, 0.4, 0.6, 10, 10, "test")
    path = grouped_bars(tmp_path / "b.png", ["A", "B"], {"z": [est, None], "q": [est, est]}, references={"base": est})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_cli_cmap_writes_tables_and_figure(tmp_path, smollm2_tokenizer):
    base = make_tiny("llama", smollm2_tokenizer)
    ft = perturb_qkv(base)
    for m, d in ((base, "base"), (ft, "ft")):
        m.model.save_pretrained(tmp_path / d)
        smollm2_tokenizer.save_pretrained(tmp_path / d)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0)], "C": [Head(1, 1)]}, {"A": "last", "C": "query_label"}
    ).save(tmp_path / "circuit.json")
    out = tmp_path / "out"
    rc = cli_main(
        [
            "cmap",
            "--base",
            str(tmp_path / "base"),
            "--finetune",
            str(tmp_path / "ft"),
            "--circuit",
            str(circuit),
            "--n",
            "6",
            "--n-boxes",
            "3",
            "--batch-size",
            "3",
            "--kinds",
            "z,qkv",
            "--out",
            str(out),
        ]
    )
    assert rc in (0, None)
    for name in ("cmap.md", "cmap.csv", "cmap.json", "cmap.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "cmap.json").read_text())
    assert "o_proj" in data["caption"] and "KV group" in data["caption"]
    assert len(data["rows"]) == 3 * 2


def _isolated_logits(base, donor, scope, kind, ids, positions):
    from mechdiff.methods.cmap_patches import isolation_patches

    shape = base.shape
    sites = [(k, l) for l in range(shape.n_layers) for k in ("q", "k", "v", "z")]
    cap = run(donor, ids, capture=sites).captured
    base_z = {l: t for (k, l), t in run(base, ids, capture=sites).captured.items() if k == "z"}
    patches = cmap_patches(base, scope, kind, cap, positions, ids.shape[1])
    patches += isolation_patches(base, scope, kind, base_z, positions, ids.shape[1])
    return run(base, ids, patches).logits, cap


@pytest.mark.parametrize("kind", ["q", "k", "v", "qkv"])
def test_isolated_qkv_changes_only_the_heads_own_reading(tiny_llama, prompts, kind):
    """Isolated CMAP of one GQA head at ``last`` equals writing, into the plain base, only that head's z at
    ``last`` as computed with the donor's Q/K/V (run unisolated): its KV-group partner reads nothing new."""
    donor = make_tiny("llama", seed=5)
    ids, positions = prompts["input_ids"], prompts["positions"]
    head = Head(LAYER, 3)  # KV group 1 = heads 2 and 3
    scope = [(head, "last")]
    got, cap = _isolated_logits(tiny_llama, donor, scope, kind, ids, positions)
    loose = run(
        tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1]), capture=[("z", LAYER)]
    ).captured[("z", LAYER)]
    cols = tiny_llama.arch.columns("z", head.head, tiny_llama.shape)
    rows = torch.arange(ids.shape[0])
    value = loose[rows, positions["last"], cols]
    want = run(tiny_llama, ids, [Patch("z", LAYER, value, positions["last"], cols)]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind in ("k", "v", "qkv"):  # unisolated, head 2 reads the patched K/V too: a different result
        unisolated = run(tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1])).logits
        assert not torch.allclose(unisolated, got, atol=1e-4)


def test_isolated_cmap_leaves_other_positions_at_the_base(tiny_llama, prompts):
    """A K/V patch of a head at ``query_label``: every position other than it and ``last`` keeps the base's
    residual stream in every layer."""
    donor = make_tiny("llama", seed=5)
    ids, positions = prompts["input_ids"], prompts["positions"]
    from mechdiff.methods.cmap_patches import isolation_patches

    shape = tiny_llama.shape
    scope = [(Head(LAYER, 1), "query_label")]
    sites = [(k, l) for l in range(shape.n_layers) for k in ("q", "k", "v", "z")]
    cap = run(donor, ids, capture=sites).captured
    plain = run(tiny_llama, ids, capture=sites + [("resid", l) for l in range(shape.n_layers)]).captured
    base_z = {l: plain[("z", l)] for l in range(shape.n_layers)}
    patches = cmap_patches(tiny_llama, scope, "qkv", cap, positions, ids.shape[1])
    patches += isolation_patches(tiny_llama, scope, "qkv", base_z, positions, ids.shape[1])
    got = run(tiny_llama, ids, patches, capture=[("resid", l) for l in range(shape.n_layers)]).captured
    rows = torch.arange(ids.shape[0])
    other = torch.ones(ids.shape, dtype=torch.bool)
    other[rows, positions["last"]] = False
    other[rows, positions["query_label"]] = False
    changed = False
    for l in range(shape.n_layers):
        torch.testing.assert_close(got[("resid", l)][other], plain[("resid", l)][other], rtol=0, atol=1e-6)
        changed |= not torch.allclose(got[("resid", l)][~other], plain[("resid", l)][~other], atol=1e-5)
    assert changed  # the patch did reach the free positions


def test_cmap_random_control_and_paired_differences(tiny_llama, smollm2_tokenizer):
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=1)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]}, {"A": "last", "C": "query_label"}
    )
    donor = perturb_qkv(tiny_llama)
    res = run_cmap(
        tiny_llama, donor, circuit, records, kinds=("z", "v"), batch_size=3, progress=False, n_random=2, seed=0
    )
    assert {r.scope for r in res.random_rows} == {"random:A", "random:C"}
    assert len(res.outcomes["A/z"]) == 6 and set(res.outcomes) >= {"base", "finetune", "A/v", "circuit/z"}
    d = res.paired("A/z", "base").interval
    assert d.value == pytest.approx(sum(res.outcomes["A/z"]) / 6 - sum(res.outcomes["base"]) / 6)
    assert d.low <= d.value <= d.high
    with pytest.raises(KeyError, match="no outcomes"):
        res.paired("A/qk", "base")
    assert res.settings["isolate"] is True and res.to_dict()["random_rows"]


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
    width = {
        "q": shape.n_heads * shape.d_head,
        "z": shape.n_heads * shape.d_head,
        "k": shape.n_kv_heads * shape.d_head,
        "v": shape.n_kv_heads * shape.d_head,
    }
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
                keep[b, :, g * shape.group_size : (g + 1) * shape.group_size] = 0
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
    return {
        "base": ([arr(1, 0), arr(0, 1)], [arr(0.6, 0.2), arr(0.1, 0.7)]),
        "finetune": ([arr(1, 1), arr(1, 0)], [arr(0.8, 0.9), arr(0.7, 0.3)]),
        ("A", "z"): ([arr(1, 1), arr(0, 0)], [arr(0.9, 0.6), arr(0.2, 0.1)]),
        ("A", "q"): ([arr(1, 1), arr(1, 1)], [arr(0.9, 0.8), arr(0.7, 0.6)]),
        ("random:A", "z"): ([arr(0.5, 1), arr(0, 0)], [arr(0.4, 0.5), arr(0.3, 0.2)]),
    }


def _circuit() -> Circuit:
    return Circuit("c", "t", {"A": [Head(0, 1)], "E": []}, {"A": "last", "E": "query_label"})


def test_result_rows_recovered_shares_and_outcomes():
    scores = _scores()
    names = SimpleNamespace(name="base-model"), SimpleNamespace(name="ft-model")
    res = _result(*names, _circuit(), scores, {"A": None}, ["z", "q"])
    assert (res.base, res.finetune) == ("base-model", "ft-model")
    assert res.base_accuracy == mean_estimate([1, 0, 0, 1]) and res.finetune_accuracy == mean_estimate([1, 1, 1, 0])
    assert res.base_answer_prob == bootstrap([0.6, 0.2, 0.1, 0.7])
    assert res.finetune_answer_prob == bootstrap([0.8, 0.9, 0.7, 0.3])
    assert res.positions == {"A": "last", "E": "query_label"}
    assert [(r.scope, r.kind) for r in res.rows] == [("A", "z"), ("A", "q")]
    assert [(r.scope, r.kind) for r in res.random_rows] == [("random:A", "z")]
    # recovered = (patched - base) / (fine-tune - base): (0.5 - 0.5) / 0.25, (1 - 0.5) / 0.25, (0.375 - 0.5) / 0.25
    assert [r.recovered for r in res.rows] == [0.0, 2.0] and res.random_rows[0].recovered == pytest.approx(-0.5)
    assert res.rows[1].accuracy == mean_estimate([1, 1, 1, 1])
    assert res.rows[1].answer_prob == bootstrap([0.9, 0.8, 0.7, 0.6])
    assert res.random_rows[0].accuracy == mean_estimate([0.5, 1, 0, 0])
    # outcomes: 0/1 ints, and a random scope's share of right draws kept as is (the JSON shows which)
    assert json.dumps(res.outcomes) == json.dumps(
        {
            "base": [1, 0, 0, 1],
            "finetune": [1, 1, 1, 0],
            "A/z": [1, 1, 0, 0],
            "A/q": [1, 1, 1, 1],
            "random:A/z": [0.5, 1.0, 0.0, 0.0],
        }
    )
    tied = dict(scores, finetune=scores["base"])
    assert all(np.isnan(r.recovered) for r in _result(*names, _circuit(), tied, {"A": None}, ["z", "q"]).rows)


def test_result_to_dict_is_its_json_form():
    e = lambda v: Interval(v, v - 0.1, v + 0.1, 4, 4, "test")  # noqa: E731
    row = CMAPRow("A", "qk", e(0.5), e(0.25), 0.75)
    rnd = CMAPRow("random:A", "qk", e(0.3), e(0.2), -0.25)
    res = CMAPResult(
        "b", "f", e(0.4), e(0.9), [row], e(0.1), e(0.6), {"A": "last"}, "cap", [rnd], {"base": [1, 0]}, {"seed": 3}
    )
    est = lambda v: {"value": v, "low": v - 0.1, "high": v + 0.1, "n": 4}  # noqa: E731
    assert row.to_dict() == {
        "scope": "A",
        "kind": "qk",
        "accuracy": est(0.5),
        "answer_prob": est(0.25),
        "recovered": 0.75,
    }
    assert res.to_dict() == {
        "base": "b",
        "finetune": "f",
        "caption": "cap",
        "base_accuracy": est(0.4),
        "finetune_accuracy": est(0.9),
        "base_answer_prob": est(0.1),
        "finetune_answer_prob": est(0.6),
        "positions": {"A": "last"},
        "rows": [row.to_dict()],
        "random_rows": [rnd.to_dict()],
        "outcomes": {"base": [1, 0]},
        "settings": {"seed": 3},
        "random_outcomes": {},
        "random_heads": {},
    }
    no_probs = CMAPResult("b", "f", e(0.4), e(0.9), [row]).to_dict()
    assert "base_answer_prob" not in no_probs and "finetune_answer_prob" not in no_probs
    assert no_probs["caption"] == CAPTION and no_probs["random_rows"] == [] and no_probs["settings"] == {}


def _expected_outcomes(base, donor, records, circuit, scope_items, kinds, isolate: bool, batch_size: int) -> dict:
    """Per prompt ``(correct, answer prob)`` per key, from full patched runs of each batch."""
    heads = circuit.heads()
    out: dict = {}
    for i in range(0, len(records), batch_size):
        batch = batch_tensors(records[i : i + batch_size])
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
                out.setdefault((key, kind), []).append(
                    (torch.stack([r[0] for r in runs]).mean(0), torch.stack([r[1] for r in runs]).mean(0))
                )
        for key, lg in logits.items():
            out.setdefault(key, []).append((answer_is_top1(lg, answer).float(), answer_prob(lg, answer)))
    return {
        k: (torch.cat([v[0] for v in vs]).tolist(), torch.cat([v[1] for v in vs]).tolist()) for k, vs in out.items()
    }


def _check_outcomes(res, want: dict) -> None:
    for key, (correct, prob) in want.items():
        name = key if isinstance(key, str) else "/".join(key)
        assert res.outcomes[name] == pytest.approx(correct), name
        got = {"base": res.base_answer_prob, "finetune": res.finetune_answer_prob}.get(name) or next(
            r.answer_prob for r in res.rows + res.random_rows if (r.scope, r.kind) == key
        )
        assert got.value == pytest.approx(float(np.mean(prob)), rel=1e-5), name
        assert got.n_rows == len(prob), name


def test_run_cmap_against_full_patched_runs(tiny_llama, smollm2_tokenizer, monkeypatch, capsys):
    """Groups chosen, a seeded random control, isolation on and off: each row's per-prompt outcomes and mean
    answer probability equal the full patched runs'; the patched runs resume at their scope's first layer
    from the plain run's residual and read its keys and values; nothing is printed with ``progress=False``."""
    base, donor = tiny_llama, perturb_qkv(tiny_llama)
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=1)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]}, {"A": "last", "C": "query_label"}
    )
    calls: list = []

    def spy(model, ids, patches=(), **kw):
        out = core.run(model, ids, patches, **kw)
        calls.append((model.name, list(patches), kw, out))
        return out

    monkeypatch.setattr("mechdiff.methods.cmap.run", spy)
    res = run_cmap(
        base, donor, circuit, records, kinds=("v",), batch_size=3, groups=["A"], progress=False, n_random=2, seed=3
    )
    rng = random.Random(3)
    draws = [random_scope(scopes(circuit)["A"], base.shape.n_heads, rng) for _ in range(2)]
    assert draws[0] != draws[1]
    _check_outcomes(
        res,
        _expected_outcomes(
            base, donor, records, circuit, [(("A"), [scopes(circuit)["A"]]), ("random:A", draws)], ["v"], True, 3
        ),
    )
    assert [(r.scope, r.kind) for r in res.rows] == [("A", "v")]
    assert [(r.scope, r.kind) for r in res.random_rows] == [("random:A", "v")]
    assert res.caption == CAPTION
    assert res.settings == {"isolate": True, "n_random": 2, "seed": 3, "n_prompts": 6}
    assert res.positions == {"A": "last", "C": "query_label"}
    # each draw's own outcomes are kept: each is the full patched run of that draw alone
    assert res.random_heads == {"random:A": [[h.name for h, _ in d] for d in draws]}
    for i, drawn in enumerate(draws):
        alone = _expected_outcomes(base, donor, records, circuit, [("random:A", [drawn])], ["v"], True, 3)
        assert from_bits(res.random_outcomes["random:A/v"][i]).tolist() == alone[("random:A", "v")][0]
    shares = np.mean([from_bits(b) for b in res.random_outcomes["random:A/v"]], 0)
    assert res.outcomes["random:A/v"] == pytest.approx(shares.tolist())
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
    _check_outcomes(
        loose,
        _expected_outcomes(
            base, donor, records, circuit, [(g, [sc[g]]) for g in ("A", "C", "circuit")], ["q"], False, 6
        ),
    )
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


N_BOXES = 3


@pytest.fixture
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)


def _paper_cmap_by_hand(base, donor, heads, kind, ids, last):
    """Last-position logits of the base with the donor's Q/K/V (``kind``) of ``heads`` (a group at the last
    position) patched as the paper: plain HF forwards with hooks. K/V at positions strictly before ``last``, Q at
    it; from the first patched layer on, every head's o_proj input at every position but the last is the base's
    clean one, and at the last the KV-group partners of patched K/V heads are the base's too (GQA)."""
    import torch

    d, group = base.shape.d_head, base.shape.group_size
    rows = torch.arange(ids.shape[0])
    layers_of = lambda lm: lm.model.model.layers  # noqa: E731
    captured: dict = {}

    def grab(store, key, pre=False):
        def hook(mod, args, out=None):
            store[key] = (args[0] if pre else out).detach().clone()

        return hook

    handles = []
    for l in {h.layer for h in heads}:
        for site in ("q", "k", "v"):
            handles.append(
                getattr(layers_of(donor)[l].self_attn, f"{site}_proj").register_forward_hook(grab(captured, (site, l)))
            )
    with torch.no_grad():
        donor.model(input_ids=ids, use_cache=False)
    clean: dict = {}
    for l in range(base.shape.n_layers):
        handles.append(layers_of(base)[l].self_attn.o_proj.register_forward_pre_hook(grab(clean, l, pre=True)))
    with torch.no_grad():
        base.model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    before = torch.arange(ids.shape[1])[None, :] < last[:, None]  # strictly before the group's position

    def patch_site(site, l):
        def hook(mod, args, out):
            out = out.clone()
            for h in (h for h in heads if h.layer == l):
                cols = (
                    slice(h.head * d, (h.head + 1) * d)
                    if site == "q"
                    else slice(h.head // group * d, (h.head // group + 1) * d)
                )
                if site == "q":
                    out[rows, last, cols] = captured[(site, l)][rows, last, cols]
                else:
                    out[:, :, cols] = torch.where(before[..., None], captured[(site, l)][:, :, cols], out[:, :, cols])
            return out

        return hook

    first = min(h.layer for h in heads)

    def isolate(l):
        def pre(mod, args):
            x = args[0].clone()
            keep = torch.zeros(ids.shape, dtype=torch.bool)
            keep[rows, last] = True
            x[~keep] = clean[l][~keep]
            if set(kind) & {"k", "v"}:
                ours = {h.head for h in heads if h.layer == l}
                for partner in range(base.shape.n_heads):
                    if partner not in ours and any(partner // group == o // group for o in ours):
                        x[rows, last, partner * d : (partner + 1) * d] = clean[l][
                            rows, last, partner * d : (partner + 1) * d
                        ]
            return (x,)

        return pre

    handles = [
        getattr(layers_of(base)[l].self_attn, f"{site}_proj").register_forward_hook(patch_site(site, l))
        for site in set(kind)
        for l in {h.layer for h in heads}
    ]
    handles += [
        layers_of(base)[l].self_attn.o_proj.register_forward_pre_hook(isolate(l))
        for l in range(first, base.shape.n_layers)
    ]
    with torch.no_grad():
        logits = base.model(input_ids=ids, use_cache=False).logits[rows, last]
    for h in handles:
        h.remove()
    return logits


@pytest.mark.parametrize("kind", ["q", "k", "v", "qkv"])
def test_paper_cmap_patches_and_restores_the_paper_sites(tiny_llama, smollm2_tokenizer, kind):
    import torch
    from conftest import make_tiny

    from mechdiff.methods.cmap_patches import cmap_patches, paper_isolation_patches
    from mechdiff.patching.core import run
    from mechdiff.tasks.entity_tracking import batch_tensors

    donor = make_tiny("llama", seed=5)
    batch = batch_tensors(generate(smollm2_tokenizer, 6, n_boxes=3, seed=0))
    ids, positions = batch["input_ids"], batch["positions"]
    heads = [Head(1, 3), Head(2, 0)]  # KV partners: L1H2, L2H1
    scope = [(h, "last") for h in heads]
    shape = tiny_llama.shape
    sites = [(k, l) for l in range(shape.n_layers) for k in ("q", "k", "v", "z")]
    cap = run(donor, ids, capture=sites).captured
    base_z = {l: t for (k, l), t in run(tiny_llama, ids, capture=sites).captured.items() if k == "z"}
    isolation = paper_isolation_patches(tiny_llama, scope, kind, base_z, positions, ids.shape[1])
    got = run(
        tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1], strict=True) + isolation
    ).logits  # the read-out: the last position
    want = _paper_cmap_by_hand(tiny_llama, donor, heads, kind, ids, positions["last"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    if set(kind) & {"k", "v"}:  # K/V also at the group's own position (mechdiff's base rule) is another run
        loose = run(
            tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1]) + isolation
        ).logits
        assert not torch.allclose(loose, got, atol=1e-4)


def test_paper_cmap_runs_qkv_only_for_last_token_groups(tiny_llama, smollm2_tokenizer):
    from conftest import make_tiny

    from mechdiff.common.metrics import answer_prob
    from mechdiff.methods.cmap import run_cmap
    from mechdiff.methods.cmap_patches import CMAP_KINDS
    from mechdiff.tasks.entity_tracking import batch_tensors

    donor = make_tiny("llama", seed=5)
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    circuit = Circuit(
        "tiny", "et", {"A": [Head(1, 3), Head(2, 0)], "C": [Head(1, 1)]}, {"A": "last", "C": "query_label"}
    )
    res = run_cmap(tiny_llama, donor, circuit, records, CMAP_KINDS, batch_size=6, progress=False, rule="paper")
    kinds = {(r.scope, r.kind) for r in res.rows}
    assert kinds == {("A", k) for k in CMAP_KINDS} | {("C", "z"), ("circuit", "z")}
    assert res.settings["rule"] == "paper" and "strictly before" in res.caption
    batch = batch_tensors(records)
    for kind in ("k", "v"):
        logits = _paper_cmap_by_hand(
            tiny_llama, donor, circuit.groups["A"], kind, batch["input_ids"], batch["positions"]["last"]
        )
        want = float(answer_prob(logits, batch["answer_ids"]).mean())
        row = next(r for r in res.rows if (r.scope, r.kind) == ("A", kind))
        assert row.answer_prob.value == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="isolate"):
        run_cmap(tiny_llama, donor, circuit, records, ["z"], rule="paper", isolate=False, progress=False)


def test_dcm_cut_keeps_each_groups_selected_heads():
    from mechdiff.methods.cmap_patches import dcm_cut

    circuit = Circuit(
        "ft",
        "et",
        {"A": [Head(2, 0), Head(1, 0)], "B": [Head(1, 1)], "D": [Head(0, 2), Head(0, 3)]},
        {"A": "last", "B": "last", "D": "query_label_context"},
    )
    dcm = [
        {"group": "A", "desideratum": "object_value", "selected": ["L1H0"]},
        {"group": "A", "desideratum": "positional", "selected": ["L2H0"]},
        {"group": "B", "desideratum": "positional", "selected": []},
    ]
    cut = dcm_cut(circuit, dcm, {"A": "object", "B": "positional"})  # aliases: object == object_value
    assert cut.groups == {"A": [Head(1, 0)], "B": [], "D": [Head(0, 2), Head(0, 3)]}
    with pytest.raises(ValueError, match="no DCM result"):
        dcm_cut(circuit, dcm, {"D": "positional"})


def test_cli_cmap_and_prune_with_the_paper_rules(tmp_path, smollm2_tokenizer):
    import json

    from conftest import make_tiny

    from mechdiff.cli import main as cli_main

    for seed, d in ((0, "base"), (5, "ft")):
        m = make_tiny("llama", smollm2_tokenizer, seed=seed)
        m.model.save_pretrained(tmp_path / d)
        smollm2_tokenizer.save_pretrained(tmp_path / d)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 2)], "C": [Head(1, 1)]}, {"A": "last", "C": "query_label"}
    ).save(tmp_path / "circuit.json")
    out = tmp_path / "cmap"
    assert cli_main(
        [
            "cmap",
            "--base",
            str(tmp_path / "base"),
            "--finetune",
            str(tmp_path / "ft"),
            "--circuit",
            str(circuit),
            "--n",
            "6",
            "--n-boxes",
            "3",
            "--batch-size",
            "3",
            "--kinds",
            "z,k",
            "--rule",
            "paper",
            "--out",
            str(out),
        ]
    ) in (0, None)
    data = json.loads((out / "cmap.json").read_text())
    assert {(r["scope"], r["kind"]) for r in data["rows"]} == {("A", "z"), ("A", "k"), ("C", "z"), ("circuit", "z")}
    assert (out / "cmap.png").is_file() and data["settings"]["rule"] == "paper"
    pruned = tmp_path / "pruned.json"
    assert cli_main(
        [
            "prune",
            "--model",
            str(tmp_path / "base"),
            "--circuit",
            str(circuit),
            "--out",
            str(pruned),
            "--rule",
            "paper",
            "--metric",
            "prob",
            "--n",
            "6",
            "--n-boxes",
            "3",
        ]
    ) in (0, None)
    meta = json.loads(pruned.read_text())["meta"]["pruned"]
    assert meta["rule"] == "paper" and meta["share"] == 0.3 and meta["metric"] == "prob"
    table = (tmp_path / "pruned.minimality.md").read_text()
    assert "F(C\\K)" in table and "score" in table


def test_cmap_paired_rows_are_the_exact_test_and_the_sign_flip_against_the_draws():
    """A part against the base: the exact binomial test on the discordant prompts (4 against 0: p = 0.125, where a
    percentile bootstrap interval excludes 0); against its random control's per-prompt share: the sign-flip test."""
    from scipy import stats as sps

    from mechdiff.common.inference import sign_flip
    from mechdiff.common.stats import paired_difference
    from mechdiff.report.rows import cmap_paired_rows

    base = [0] * 20 + [1] * 20
    part = [1] * 4 + [0] * 16 + [1] * 20
    share = [0.5] * 10 + [0.0] * 10 + [1.0] * 20
    result = {"rows": [{"scope": "A", "kind": "z"}], "outcomes": {"base": base, "A/z": part, "random:A/z": share}}
    vs_base, vs_random = cmap_paired_rows(result)
    assert (vs_base["first"], vs_base["second"]) == ("A/z", "base")
    assert vs_base["p"] == pytest.approx(sps.binomtest(4, 4, 0.5).pvalue) == pytest.approx(0.125)
    assert vs_base["difference_low"] <= 0 < paired_difference(part, base).low  # the old interval excluded 0
    want = sign_flip(np.subtract(part, share))
    assert vs_random["second"] == "random:A/z" and vs_random["p"] == want.p
    assert vs_random["difference"] == pytest.approx(np.mean(part) - np.mean(share))


def test_random_draws_on_a_subset_of_the_prompts_are_the_full_runs_there(tiny_llama, smollm2_tokenizer):
    """Draws on ``random_prompts`` only (a pass of their own): each draw's outcomes are those the draws give on
    every prompt, at those prompts; every group's outcomes are unchanged; a part is paired with its control on
    those prompts."""
    from mechdiff.report.rows import cmap_paired_rows

    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=1)
    circuit = Circuit(
        "tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]}, {"A": "last", "C": "query_label"}
    )
    donor = perturb_qkv(tiny_llama)
    kw = dict(kinds=("z",), batch_size=3, progress=False, n_random=3, seed=4)
    whole = run_cmap(tiny_llama, donor, circuit, records, **kw)
    part = run_cmap(tiny_llama, donor, circuit, records, random_prompts=[4, 0, 2], **kw)
    assert part.random_prompts == [0, 2, 4] and whole.random_prompts == []
    assert part.random_heads == whole.random_heads
    for key, draws in whole.random_outcomes.items():
        assert part.random_outcomes[key] == ["".join(d[i] for i in (0, 2, 4)) for d in draws]
    assert {k: v for k, v in part.outcomes.items() if not k.startswith("random:")} == {
        k: v for k, v in whole.outcomes.items() if not k.startswith("random:")
    }
    rows = {(r["first"], r["second"]): r for r in cmap_paired_rows(part.to_dict())}
    d = rows[("A/z", "random:A/z")]
    share = np.mean([from_bits(b) for b in part.random_outcomes["random:A/z"]], 0)
    assert d["difference"] == pytest.approx(np.mean([part.outcomes["A/z"][i] for i in (0, 2, 4)]) - share.mean())
    assert part.paired("A/z", "random:A/z").interval.n_rows == 3
