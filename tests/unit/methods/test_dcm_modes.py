"""DCM's three pair-cache modes (``mechdiff.methods.dcm_cache.CACHE_MODES``): a scratch file read by suffix runs, the
sources' ``z`` alone in host memory, and sources run again for every batch give the same masks and outcomes, and
each holds what it says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import TINY_FORWARD, assert_close32

import mechdiff.methods.dcm_cache as dcm  # the pair cache and its runs
from mechdiff.common.components import Head
from mechdiff.methods.dcm import DCMConfig, random_pool, run_dcm, split_indices, train_mask
from mechdiff.methods.dcm_cache import CACHE_MODES, PairCache, masked_z_patches, source_z
from mechdiff.patching.core import run
from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors
from unit.methods.planted import CANDIDATES, PLANTED, mixed_pairs, planted_case


@pytest.fixture(scope="module")
def planted(smollm2_tokenizer):
    """:func:`~unit.methods.planted.planted_case` on pairs of two token lengths."""
    return planted_case(smollm2_tokenizer, mixed_pairs(smollm2_tokenizer))


def _build(model, pairs, config, mode):
    sites = [(CANDIDATES, "last"), (random_pool(model, CANDIDATES, config), "last")]
    return PairCache.build(model, pairs, sites, 5, mode=mode)


@pytest.mark.parametrize("mode", ["memory", "recompute"])
def test_every_mode_learns_the_file_modes_mask_and_outcomes(planted, mode):
    """Training (masks, validation accuracies, losses) and evaluation (test, floor, whole group, random draws) in
    ``mode`` equal the scratch file's, but for a forward's float rounding (a full run against a suffix run)."""
    model, pairs = planted
    assert {len(p.base.input_ids) for p in pairs} == {25, 32} and len(pairs) >= 30
    config = DCMConfig(epochs=3, batch_size=8, micro_batch=4, eval_batch=5, eval_every=2, n_random=2)
    file, other = _build(model, pairs, config, "file"), _build(model, pairs, config, mode)
    assert (file.floor == other.floor).all()
    train, val, _ = split_indices(len(pairs), config.split, config.seed)
    got, want = (train_mask(model, CANDIDATES, "last", c, train, val, config, False) for c in (other, file))
    steps = config.epochs * math.ceil(len(train) / config.batch_size)
    assert_close32(got[0], want[0], scale=config.lr * steps, depth=2 * TINY_FORWARD)
    assert got[1] == want[1] and [h["val_accuracy"] for h in got[2]] == [h["val_accuracy"] for h in want[2]]
    assert np.allclose([h["loss"] for h in got[2][1:]], [h["loss"] for h in want[2][1:]], rtol=1e-4)
    a, b = (run_dcm(model, CANDIDATES, "last", pairs, config, progress=False, cache=c) for c in (other, file))
    assert a.selected == b.selected == [PLANTED]
    for name in ("test_accuracy", "floor", "full_group", "random", "mask", "best_step"):
        assert getattr(a, name) == getattr(b, name), name
    file.close()
    other.close()


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_each_mode_holds_what_it_says_and_makes_its_runs(tiny_llama, smollm2_tokenizer, mode, monkeypatch):
    """The file mode stores keys, values, residual streams and the sources' z; memory only the sources' z; recompute
    nothing. Building takes a source and a base run a batch (recompute: the base run only); a patched batch is one
    run (recompute: the source's run first); the patched logits at a position of one token agree across modes."""
    pairs = object_value_pairs(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    heads = [Head(1, 0), Head(2, 3)]
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(dcm, "run", spy)
    cache = PairCache.build(tiny_llama, pairs, [(heads, "query_label")], batch_size=3, mode=mode)
    built = len(calls)
    logits, _ = cache.logits(tiny_llama, range(6), heads, torch.full((2,), 0.25), "query_label")
    monkeypatch.undo()
    held = {"file": {"source/query_label", "resid/1", "keys", "values"}, "memory": {"source/query_label"}}
    assert {n for n in ("source/query_label", "resid/1", "keys", "values") if n in cache.store} == held.get(mode, set())
    assert built == 2 * (1 if mode == "recompute" else 2)  # two batches of three pairs
    assert len(calls) - built == (2 if mode == "recompute" else 1)  # the six pairs are of one length: one batch
    batch = pair_batch_tensors(pairs)
    values = source_z(tiny_llama, batch, [1, 2], "query_label")
    patches = masked_z_patches(
        tiny_llama, heads, torch.full((2,), 0.25), values, batch["base"]["positions"]["query_label"]
    )
    plain = run(tiny_llama, batch["base"]["input_ids"], patches).logits
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-6)
    cache.close()


def test_an_unknown_mode_is_refused(tiny_llama, smollm2_tokenizer):
    pairs = object_value_pairs(smollm2_tokenizer, 3, n_boxes=3, seed=0)
    with pytest.raises(ValueError, match="file, memory, recompute"):
        PairCache.build(tiny_llama, pairs, [([Head(1, 0)], "last")], mode="disk")


@pytest.mark.parametrize("mode", ["memory", "recompute"])
def test_a_position_class_is_patched_alike_in_every_mode(tiny_llama, smollm2_tokenizer, mode):
    """A group at a class of six tokens (entity tracking's other boxes' words) in pairs of two lengths: each mode's
    patched logits and gradient on the mask equal the scratch file's, but for a forward's rounding."""
    pairs = object_value_pairs(smollm2_tokenizer, 10, n_boxes=3, seed=0)
    pairs += object_value_pairs(smollm2_tokenizer, 6, n_boxes=4, seed=1)
    heads, rows = [Head(1, 0), Head(2, 3)], list(range(len(pairs)))[::-1]  # both lengths, in a mixed order
    file, other = (PairCache.build(tiny_llama, pairs, [(heads, "words_other")], 4, mode=m) for m in ("file", mode))
    outs = []
    for cache in (file, other):
        mask = torch.full((2,), 0.4, requires_grad=True)
        logits, _ = cache.logits(tiny_llama, rows, heads, mask, "words_other", grad=True)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
        (logits * weights).sum().backward()
        outs.append((logits.detach(), mask.grad))
    assert_close32(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-6)
    assert outs[0][1][0].abs() > 1e-4  # L1H0 at the class reaches the last token (L2H3 in the last layer cannot)
    file.close()
    other.close()


def test_the_dcm_command_runs_in_the_mode_asked_with_the_same_results(tmp_path, tiny_family, monkeypatch):
    """``mechdiff dcm --cache recompute`` builds every pair cache in that mode, and
    its masks, selections and accuracies are the file mode's."""
    import json

    from mechdiff.circuits.circuit import Circuit
    from mechdiff.cli import main as cli_main

    Circuit("tiny", "entity-tracking", {"A": [Head(1, 0), Head(1, 1)]}, {"A": "last"}).save(tmp_path / "c.json")
    argv = ["dcm", "--model", tiny_family[0], "--semantic", tiny_family[1], "--circuit", str(tmp_path / "c.json")]
    argv += ["--desiderata", "object", "--n", "20", "--n-boxes", "3", "--epochs", "1", "--n-random", "1"]
    modes, build = [], PairCache.build.__func__

    def spy(cls, *args, **kwargs):
        modes.append(kwargs.get("mode", args[5] if len(args) > 5 else "file"))
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(PairCache, "build", classmethod(spy))
    results = {}
    for mode in ("file", "recompute"):
        modes.clear()
        assert cli_main([*argv, "--cache", mode, "--out", str(tmp_path / mode)]) == 0
        assert modes and set(modes) == {mode}
        results[mode] = json.loads((tmp_path / mode / "dcm.json").read_text())
    keys = ("mask", "selected", "test_accuracy", "floor", "full_group", "random", "best_step")
    assert len(results["file"]["results"]) == len(results["recompute"]["results"]) == 1
    for a, b in zip(results["file"]["results"], results["recompute"]["results"]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert results["file"]["semantic"] == results["recompute"]["semantic"]
