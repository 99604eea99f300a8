"""CMAP on tiny models: z patching reproduces the donor where weights agree, Q/K/V patches touch only
the head / KV group they name, identical models change nothing, and the CLI writes its outputs."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from conftest import make_tiny
from tolerances import tol32
from mechdiff.circuits.circuit import Circuit
from mechdiff.cli import main as cli_main
from mechdiff.methods.cmap import cmap_patches, parse_kinds, run_cmap
from mechdiff.common.components import Head, all_heads
from mechdiff.patching.core import Patch, run
from mechdiff.report.bars import grouped_bars
from mechdiff.common.stats import Estimate
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
    patches = cmap_patches(tiny_llama, [(Head(LAYER, 3), "last"), (Head(LAYER, 2), "last")], "qkv", cap,
                           positions, ids.shape[1])
    assert sum(p.kind == "k" for p in patches) == 1  # heads 2 and 3 share one KV group: one K patch
    got = run(tiny_llama, ids, patches, capture=[("k", LAYER), ("v", LAYER)]).captured
    for kind in ("k", "v"):
        assert torch.equal(got[(kind, LAYER)][..., :8], base[(kind, LAYER)][..., :8])
        assert torch.equal(got[(kind, LAYER)][..., 8:16], cap[(kind, LAYER)][..., 8:16])


def test_cmap_identical_models_changes_nothing(tiny_llama, smollm2_tokenizer):
    records = generate(smollm2_tokenizer, 4, n_boxes=3, seed=1)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]},
                      {"A": "last", "C": "query_label"})
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
    est = Estimate(0.5, 0.4, 0.6, 10)
    path = grouped_bars(tmp_path / "b.png", ["A", "B"], {"z": [est, None], "q": [est, est]},
                        references={"base": est})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_cli_cmap_writes_tables_and_figure(tmp_path, smollm2_tokenizer):
    base = make_tiny("llama", smollm2_tokenizer)
    ft = perturb_qkv(base)
    for m, d in ((base, "base"), (ft, "ft")):
        m.model.save_pretrained(tmp_path / d)
        smollm2_tokenizer.save_pretrained(tmp_path / d)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0)], "C": [Head(1, 1)]},
                      {"A": "last", "C": "query_label"}).save(tmp_path / "circuit.json")
    out = tmp_path / "out"
    rc = cli_main(["cmap", "--base", str(tmp_path / "base"), "--finetune", str(tmp_path / "ft"),
                   "--circuit", str(circuit), "--n", "6", "--n-boxes", "3", "--batch-size", "3",
                   "--kinds", "z,qkv", "--out", str(out)])
    assert rc in (0, None)
    for name in ("cmap.md", "cmap.csv", "cmap.json", "cmap.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "cmap.json").read_text())
    assert "o_proj" in data["caption"] and "KV group" in data["caption"]
    assert len(data["rows"]) == 3 * 2


def _isolated_logits(base, donor, scope, kind, ids, positions):
    from mechdiff.methods.cmap import isolation_patches

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
    loose = run(tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1]),
                capture=[("z", LAYER)]).captured[("z", LAYER)]
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
    from mechdiff.methods.cmap import isolation_patches

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
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 3)], "C": [Head(0, 1)]},
                      {"A": "last", "C": "query_label"})
    donor = perturb_qkv(tiny_llama)
    res = run_cmap(tiny_llama, donor, circuit, records, kinds=("z", "v"), batch_size=3, progress=False,
                   n_random=2, seed=0)
    assert {r.scope for r in res.random_rows} == {"random:A", "random:C"}
    assert len(res.outcomes["A/z"]) == 6 and set(res.outcomes) >= {"base", "finetune", "A/v", "circuit/z"}
    d = res.paired("A/z", "base")
    assert d.value == pytest.approx(sum(res.outcomes["A/z"]) / 6 - sum(res.outcomes["base"]) / 6)
    assert d.low <= d.value <= d.high
    with pytest.raises(KeyError, match="no outcomes"):
        res.paired("A/qk", "base")
    assert res.settings["isolate"] is True and res.to_dict()["random_rows"]
