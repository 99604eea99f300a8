"""DCM on tiny models: the mixing mask's identities, gradients that reach the mask (against finite
differences), and a planted head that DCM must find."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random
import re

import numpy as np
import pytest
import torch
from conftest import make_tiny
from tolerances import TINY_FORWARD, assert_close32

import mechdiff.methods.dcm_cache as dcm  # the pair cache and its runs
from mechdiff.circuits.circuit import Circuit
from mechdiff.cli import main as cli_main
from mechdiff.common.components import Head, all_heads
from mechdiff.common.inference import Interval, proportion
from mechdiff.common.metrics import answer_is_top1, answer_logit
from mechdiff.methods.dcm import (
    DCMConfig,
    DCMResult,
    _Mask,
    dcm_circuit,
    loss_scale,
    random_pool,
    run_dcm,
    split_indices,
    split_pairs,
    train_mask,
)
from mechdiff.methods.dcm_cache import PairCache, masked_z_patches, source_z, target_accuracy
from mechdiff.methods.semantic import SemanticResult, semantic_patching
from mechdiff.patching.core import Patch, head_patch, run
from mechdiff.tasks.base import group_batches, record_order, take
from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors, write_jsonl
from unit.methods.planted import CANDIDATES, PLANTED, mixed_pairs, planted_case


@pytest.fixture(scope="module")
def pairs(smollm2_tokenizer):
    return object_value_pairs(smollm2_tokenizer, 72, n_boxes=3, seed=0)


def _every_head(model):
    return all_heads(model.shape.n_layers, model.shape.n_heads)


def test_all_ones_mask_is_identity(tiny_model, pairs):
    batch = pair_batch_tensors(pairs[:6])
    heads = _every_head(tiny_model)
    values = source_z(tiny_model, batch, range(tiny_model.shape.n_layers), "last")
    patches = masked_z_patches(tiny_model, heads, torch.ones(len(heads)), values, batch["base"]["positions"]["last"])
    ids = batch["base"]["input_ids"]
    assert torch.equal(run(tiny_model, ids, patches).logits, run(tiny_model, ids).logits)


def test_all_zeros_mask_equals_patching(tiny_model, pairs):
    """Mask 0 over every head at every position == overwriting z; a subset == head patches."""
    batch = pair_batch_tensors(pairs[:6])
    ids, src = batch["base"]["input_ids"], batch["source"]["input_ids"]
    layers = range(tiny_model.shape.n_layers)
    cap = run(tiny_model, src, capture=[("z", l) for l in layers]).captured
    mixed = [Patch("z", l, cap[("z", l)], mask=torch.zeros(1)) for l in layers]
    plain = [Patch("z", l, cap[("z", l)]) for l in layers]
    assert torch.equal(run(tiny_model, ids, mixed).logits, run(tiny_model, ids, plain).logits)
    torch.testing.assert_close(run(tiny_model, ids, mixed).logits, run(tiny_model, src).logits)
    heads = [Head(0, 2), Head(2, 1)]
    pos_b, pos_s = batch["base"]["positions"]["last"], batch["source"]["positions"]["last"]
    values = source_z(tiny_model, batch, layers, "last")
    masked = masked_z_patches(tiny_model, heads, torch.zeros(2), values, pos_b)
    rows = torch.arange(ids.shape[0])
    direct = [
        head_patch(tiny_model, "z", h, cap[("z", h.layer)][rows, pos_s][:, h.head * 8 : (h.head + 1) * 8], pos_b)
        for h in heads
    ]
    # exact: a mask of zeros writes source * 1 + clean * 0, the source values themselves
    torch.testing.assert_close(run(tiny_model, ids, masked).logits, run(tiny_model, ids, direct).logits, rtol=0, atol=0)


def _check_gradient(objective, mask: torch.Tensor, eps: float = 1e-3) -> None:
    """Autograd's gradient of ``objective`` in ``mask`` against central finite differences (float64 model;
    eager attention may take its softmax in float32, hence the loose step and tolerance)."""
    objective(mask, True).backward()
    assert mask.grad is not None and mask.grad.abs().sum() > 0
    for i in range(mask.numel()):
        up, down = mask.detach().clone(), mask.detach().clone()
        up.view(-1)[i] += eps
        down.view(-1)[i] -= eps
        with torch.no_grad():
            numeric = (objective(up, False) - objective(down, False)) / (2 * eps)
        assert mask.grad.view(-1)[i].item() == pytest.approx(numeric.item(), rel=3e-2, abs=1e-6)


def test_gradient_reaches_mask_and_matches_finite_differences(tiny_model, pairs):
    tiny_model.model.double()
    batch = pair_batch_tensors(pairs[:4])
    heads = [Head(0, 1), Head(1, 3), Head(2, 0)]
    values = source_z(tiny_model, batch, [0, 1, 2], "last")
    pos = batch["base"]["positions"]["last"]
    ids, target = batch["base"]["input_ids"], batch["target_ids"]

    def objective(mask: torch.Tensor, grad: bool) -> torch.Tensor:
        out = run(tiny_model, ids, masked_z_patches(tiny_model, heads, mask, values, pos), grad=grad)
        return out.logits.gather(1, target[:, None]).sum()

    _check_gradient(objective, torch.tensor([0.3, 0.6, 0.8], dtype=torch.float64, requires_grad=True))
    assert not any(p.requires_grad for p in tiny_model.model.parameters())


def test_gradient_through_mask_at_every_position(tiny_model, pairs):
    """A mask over whole ``"batch pos cols"`` slices (a view of the site, written in place) keeps its graph."""
    tiny_model.model.double()
    batch = pair_batch_tensors(pairs[:3])
    ids, src = batch["base"]["input_ids"], batch["source"]["input_ids"]
    cap = run(tiny_model, src, capture=[("z", 1)]).captured[("z", 1)]

    def objective(mask: torch.Tensor, grad: bool) -> torch.Tensor:
        patch = Patch("z", 1, cap[:, :, 8:16], columns=slice(8, 16), mask=mask[None, :, None])
        return run(tiny_model, ids, [patch], grad=grad).logits[:, :50].sum()

    mask = torch.linspace(0.1, 0.9, ids.shape[1], dtype=torch.float64)[-4:]
    full = torch.ones(ids.shape[1], dtype=torch.float64)

    def padded(m: torch.Tensor, grad: bool) -> torch.Tensor:  # only the last 4 positions are free
        return objective(torch.cat([full[:-4], m]), grad)

    _check_gradient(padded, mask.clone().requires_grad_(True))


@pytest.fixture(scope="module")
def planted(smollm2_tokenizer, pairs):
    """(model, pairs) of :func:`planted_case`, built once for the module (tests do not modify the model)."""
    return planted_case(smollm2_tokenizer, pairs)


@pytest.mark.parametrize("parameterisation", ["continuous", "hard_concrete"])
def test_dcm_finds_planted_head(planted, parameterisation):
    model, planted = planted
    assert len(planted) >= 30, len(planted)
    candidates = CANDIDATES
    config = DCMConfig(parameterisation=parameterisation, epochs=3, batch_size=8, eval_every=3, n_random=2, seed=0)
    res = run_dcm(model, candidates, "last", planted, config, desideratum="planted", progress=False)
    assert PLANTED in res.selected
    assert res.test_accuracy.value >= 0.8
    assert res.floor.value == 0.0  # by construction the unpatched model never says the target
    assert res.test_accuracy.value > res.random.value
    assert sum(res.n_split) == len(planted)
    assert res.history[0]["step"] == 0 and res.best_step >= 0


def test_random_baseline_from_all_heads_equals_direct_patching(planted):
    """With ``random_pool="all"`` the baseline draws heads from every layer (not only the group's) and
    scores them as a plain patched run would; one group of a circuit is enough to need the whole cache."""
    import random as stdlib_random

    from mechdiff.methods.dcm import split_indices
    from mechdiff.methods.dcm_cache import target_accuracy

    model, pairs = planted
    config = DCMConfig(epochs=3, batch_size=8, eval_every=3, n_random=2, random_pool="all", seed=0)
    circuit = Circuit("tiny", "entity-tracking", {"A": [PLANTED]}, {"A": "last"})
    (res,) = dcm_circuit(model, circuit, {"planted": pairs}, config, progress=False)
    assert res.selected == [PLANTED]
    test = split_indices(len(pairs), config.split, config.seed)[2]
    every = all_heads(model.shape.n_layers, model.shape.n_heads)
    rng = stdlib_random.Random(config.seed + 1)
    draws = [rng.sample(every, 1) for _ in range(config.n_random)]
    assert any(d[0].layer != PLANTED.layer for d in draws)  # heads outside the group's layer are drawn
    direct = np.concatenate([target_accuracy(model, [pairs[i] for i in test], d, "last") for d in draws])
    assert res.random.value == pytest.approx(direct.mean())


class _OneBatch:
    """DCM's pair cache as a plain computation, the reference for the streamed one: at each call, the pairs of each
    token length in one batch, their source z from a source run and the patched base run over every layer and
    position (no resume, no stored keys and values, nothing kept between calls)."""

    accuracy = PairCache.accuracy

    def __init__(self, model, pairs):
        self.pairs = list(pairs)
        self.floor = answer_is_top1(*self.logits(model, range(len(self.pairs)), [], None, "last")).numpy()

    def logits(self, model, rows, heads, mask, position, grad=False):
        rows = list(rows)
        groups = group_batches(take(self.pairs, rows))
        outs = [self._run(model, take(rows, g), heads, mask, position, grad) for g in groups]
        back = torch.as_tensor(record_order(groups), dtype=torch.long)
        return torch.cat([o[0] for o in outs])[back], torch.cat([o[1] for o in outs])[back]

    def _run(self, model, rows, heads, mask, position, grad):
        batch = pair_batch_tensors(take(self.pairs, rows))
        patches = []
        if heads:
            values = source_z(model, batch, sorted({h.layer for h in heads}), position)
            patches = masked_z_patches(model, heads, mask, values, batch["base"]["positions"][position])
        return run(model, batch["base"]["input_ids"], patches, grad=grad).logits, batch["target_ids"]


@pytest.fixture(scope="module")
def planted_mixed(smollm2_tokenizer):
    """:func:`planted_case` on pairs of two token lengths (3 and 4 boxes)."""
    return planted_case(smollm2_tokenizer, mixed_pairs(smollm2_tokenizer))


@pytest.mark.parametrize("parameterisation", ["continuous", "hard_concrete"])
def test_streamed_dcm_equals_dcm_on_pairs_run_in_one_batch(planted_mixed, parameterisation):
    """DCM over the streamed cache (batches of 5 pairs written to disk, suffix runs over the stored keys and values)
    learns the mask, losses and validations of DCM computed afresh on every pair at once, and reports the same
    accuracies; pairs of two lengths."""
    model, pairs = planted_mixed
    assert {len(p.base.input_ids) for p in pairs} == {25, 32} and len(pairs) >= 30
    candidates = CANDIDATES
    config = DCMConfig(parameterisation, epochs=3, batch_size=8, micro_batch=4, eval_batch=5, eval_every=2, n_random=2)
    cache = PairCache.build(model, pairs, [(candidates, "last"), (random_pool(model, candidates, config), "last")], 5)
    reference = _OneBatch(model, pairs)
    train, val, test = split_indices(len(pairs), config.split, config.seed)
    got, want = (train_mask(model, candidates, "last", c, train, val, config, False) for c in (cache, reference))
    steps = config.epochs * math.ceil(len(train) / config.batch_size)
    # each Adam step moves the mask by lr at most, in proportion to a gradient that agrees to a forward's roundings
    assert_close32(got[0], want[0], scale=config.lr * steps, depth=2 * TINY_FORWARD)
    assert got[1] == want[1] and [h["val_accuracy"] for h in got[2]] == [h["val_accuracy"] for h in want[2]]
    logit = float(reference.logits(model, train, [], None, "last")[0].abs().max())
    assert_close32([h["loss"] for h in got[2][1:]], [h["loss"] for h in want[2][1:]], scale=logit)
    streamed, one_batch = (
        run_dcm(model, candidates, "last", pairs, config, progress=False, cache=c) for c in (cache, reference)
    )
    assert streamed.selected == one_batch.selected == [PLANTED]
    assert streamed.mask == pytest.approx(one_batch.mask, abs=1e-4)  # rounded to 4 decimals
    for name in ("test_accuracy", "floor", "full_group", "random"):
        assert getattr(streamed, name) == getattr(one_batch, name), name
    assert streamed.test_accuracy.value == 1.0 and streamed.floor.value == 0.0


def test_split_is_seeded_and_disjoint(pairs):
    a = split_pairs(pairs, (0.6, 0.2, 0.2), seed=1)
    b = split_pairs(pairs, (0.6, 0.2, 0.2), seed=1)
    c = split_pairs(pairs, (0.6, 0.2, 0.2), seed=2)
    assert a == b and a != c
    ids = [id(p) for part in a for p in part]
    assert len(ids) == len(set(ids)) == len(pairs)
    with pytest.raises(ValueError, match="split"):
        DCMConfig(split=(0.5, 0.5, 0.5))


def test_semantic_patching_per_model(planted):
    model, planted = planted
    planted = planted[:16]
    other = dataclasses.replace(model, name="other", model=copy.deepcopy(model.model))  # a fresh nnsight wrapper
    other.arch.module(other.model, "z", PLANTED.layer).weight.mul_(0.0)  # the planted head's output is gone
    res = semantic_patching([model, other], [PLANTED], "last", planted, batch_size=8)
    assert [r.model for r in res] == [model.name, "other"]
    assert res[0].accuracy.value == 1.0 and res[0].floor.value == 0.0
    assert res[1].accuracy.value < 1.0
    expected = target_accuracy(other, planted, [PLANTED], "last", 8).mean()
    assert res[1].accuracy.value == pytest.approx(expected)


def test_a_desideratums_selections_share_one_pair_cache_per_model(planted, monkeypatch):
    """The DCM stage's semantic patching builds one pair cache per desideratum and model (two forwards a test pair),
    not one per selection; each selection's records are what `semantic_patching` gives it alone, bit for bit."""
    from types import SimpleNamespace

    from mechdiff.studies.circuits.stages.dcm import semantic_records

    model, planted = planted
    other = dataclasses.replace(model, name="other", model=copy.deepcopy(model.model))
    other.arch.module(other.model, "z", PLANTED.layer).weight.mul_(0.5)

    class Models(dict):
        names = property(lambda self: list(self))

    models = Models({model.name: model, "other": other})
    desiderata = {"planted": planted[:24], "again": planted[8:32]}
    chosen = [("A", "planted", [PLANTED, Head(1, 2)]), ("B", "planted", [Head(0, 1)]), ("C", "planted", [])]
    chosen.append(("A", "again", [Head(2, 0), Head(1, 3)]))
    results = [SimpleNamespace(group=g, desideratum=d, position="last", selected=hs) for g, d, hs in chosen]
    config = DCMConfig(split=(0.5, 0.25, 0.25), n_random=2, eval_batch=8, seed=0)
    builds = []
    build = PairCache.build.__func__
    monkeypatch.setattr(PairCache, "build", classmethod(lambda cls, *a, **k: builds.append(1) or build(cls, *a, **k)))
    got = semantic_records(models, results, desiderata, config, "file")
    assert len(builds) == 2 * 2  # two desiderata in two models (one a selection: 3 * 2)
    want = []
    for r in results[:2] + results[3:]:
        test = split_pairs(desiderata[r.desideratum], config.split, config.seed)[2]
        sems = semantic_patching([model, other], r.selected, "last", test, 8, False, n_random=2, seed=1)
        heads = [h.name for h in r.selected]
        want += [{"group": r.group, "desideratum": r.desideratum, "heads": heads, **s.to_dict()} for s in sems]
    assert got == want and [g["model"] for g in got] == [model.name, "other"] * 3


def test_cli_dcm_with_user_desideratum(tmp_path, smollm2_tokenizer, pairs):
    model, planted = planted_case(smollm2_tokenizer, pairs[:32])
    model.model.save_pretrained(tmp_path / "m")
    smollm2_tokenizer.save_pretrained(tmp_path / "m")
    write_jsonl(planted, tmp_path / "planted.jsonl")
    circuit = Circuit("tiny", "entity-tracking", {"A": [PLANTED, Head(2, 0)]}, {"A": "last"})
    circuit.save(tmp_path / "c.json")
    out = tmp_path / "out"
    rc = cli_main(
        [
            "dcm",
            "--model",
            str(tmp_path / "m"),
            "--circuit",
            str(tmp_path / "c.json"),
            "--desiderata",
            str(tmp_path / "planted.jsonl"),
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--n-random",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    for name in ("dcm.md", "dcm.csv", "dcm.json", "dcm.png"):
        assert (out / name).is_file(), name


def test_dcm_circuit_rejects_unknown_group(tiny_llama, pairs):
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0)]}, {"A": "last"})
    with pytest.raises(ValueError, match="not in the circuit"):
        dcm_circuit(tiny_llama, circuit, {"object": pairs}, groups=["B"])


def test_pair_cache_matches_uncached_patching(tiny_llama, pairs):
    """The cache's resumed, precomputed-source evaluation equals patching the heads in a plain run,
    and its floor is the unpatched base's accuracy."""
    from mechdiff.methods.dcm_cache import PairCache

    subset = pairs[:10]
    heads = [Head(1, 0), Head(2, 3)]
    cache = PairCache.build(tiny_llama, subset, [(heads, "last")], batch_size=4)
    assert cache.starts == [1] and cache.sites == {"last": [1, 2]}
    batch = pair_batch_tensors(subset)
    values = source_z(tiny_llama, batch, [1, 2], "last")
    plain = run(
        tiny_llama,
        batch["base"]["input_ids"],
        masked_z_patches(tiny_llama, heads, torch.zeros(2), values, batch["base"]["positions"]["last"]),
    )
    logits, target = cache.logits(tiny_llama, range(10), heads, torch.zeros(2), "last")
    torch.testing.assert_close(logits, plain.logits, rtol=1e-5, atol=1e-6)
    assert (
        cache.accuracy(tiny_llama, range(10), heads, "last", 3)
        == (plain.logits.argmax(-1) == batch["target_ids"]).numpy()
    ).all()
    unpatched = run(tiny_llama, batch["base"]["input_ids"]).logits.argmax(-1) == batch["target_ids"]
    assert (cache.floor == unpatched.numpy()).all()


def test_pair_cache_runs_each_source_once_for_every_position(tiny_llama, pairs, monkeypatch):
    """Groups at two positions cost two forwards a batch (one source run for both, one base run), and each
    position's stored z is what a source run of that position alone gives."""
    from mechdiff.methods.dcm_cache import PairCache

    subset, groups = pairs[:6], [([Head(1, 0)], "last"), ([Head(2, 3)], "query_label")]
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(dcm, "run", spy)
    cache = PairCache.build(tiny_llama, subset, groups, batch_size=3)
    monkeypatch.undo()
    assert len(calls) == 2 * 2  # two batches of three pairs
    batch = pair_batch_tensors(subset)
    for position, layer in (("last", 1), ("query_label", 2)):
        alone = source_z(tiny_llama, batch, [layer], position)[layer]
        stored = cache.store.read(f"source/{position}", range(6))[:, 0]
        torch.testing.assert_close(stored, alone, rtol=0, atol=0)


def test_pair_cache_suffix_gradients_equal_full_runs(tiny_llama, pairs):
    """DCM's training pass on the cache (resumed, only the positions from the patched one on, over the base
    run's keys/values) gives the full run's logits and the same gradient on the mask."""
    from mechdiff.methods.dcm_cache import PairCache

    subset, heads = pairs[:6], [Head(1, 0), Head(2, 3)]
    cache = PairCache.build(tiny_llama, subset, [(heads, "query_label")], batch_size=3)
    assert cache.suffix and cache.store.read("keys", range(6)).shape[0] == 6
    batch = pair_batch_tensors(subset)
    values = source_z(tiny_llama, batch, [1, 2], "query_label")
    weights = torch.randn(6, tiny_llama.shape.vocab_size, generator=torch.Generator().manual_seed(0))
    grads = []
    for full in (False, True):
        mask = torch.full((2,), 0.3, requires_grad=True)
        if full:
            out = run(
                tiny_llama,
                batch["base"]["input_ids"],
                masked_z_patches(tiny_llama, heads, mask, values, batch["base"]["positions"]["query_label"]),
                grad=True,
            ).logits
        else:
            out, _ = cache.logits(tiny_llama, range(6), heads, mask, "query_label", grad=True)
        (out * weights).sum().backward()
        grads.append((out.detach(), mask.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)
    assert grads[1][1][0].abs() > 1e-4  # L1H0 reaches the last position through layer 2


def test_command_defaults_are_the_configs():
    from mechdiff.cli import build_parser
    from mechdiff.commands.dcm import config_from_args

    args = build_parser().parse_args(["dcm", "--circuit", "c.json"])
    assert config_from_args(args) == DCMConfig()
    args = build_parser().parse_args(["dcm", "--circuit", "c.json", "--epochs", "7", "--lam", "0.5"])
    assert config_from_args(args) == dataclasses.replace(DCMConfig(), epochs=7, lam=0.5)


def _no_weights(monkeypatch):
    """Any model's weights loading fails the test (``ModelSet`` and the commands' loader)."""
    import mechdiff.commands._options as options
    import mechdiff.models.modelset as modelset

    def refuse(*args, **kwargs):
        raise AssertionError("model weights loaded before the desiderata were checked")

    monkeypatch.setattr(modelset, "load_model", refuse)
    monkeypatch.setattr(options, "load_model", refuse)


@pytest.mark.parametrize("case", ["unknown name", "missing file", "not pairs"])
def test_cli_dcm_checks_desiderata_before_any_weights(
    case, tmp_path, tiny_family, smollm2_tokenizer, monkeypatch, capsys
):
    from mechdiff.tasks.entity_tracking import generate

    Circuit("tiny", "entity-tracking", {"A": [Head(1, 0)]}, {"A": "last"}).save(tmp_path / "c.json")
    write_jsonl(generate(smollm2_tokenizer, 2, n_boxes=3, seed=0), tmp_path / "examples.jsonl")
    desiderata, message = {
        "unknown name": ("object,nonsense", "unknown desideratum 'nonsense'"),
        "missing file": (str(tmp_path / "absent.jsonl"), "absent.jsonl"),
        "not pairs": (str(tmp_path / "examples.jsonl"), "must hold counterfactual pairs"),
    }[case]
    _no_weights(monkeypatch)
    rc = cli_main(
        [
            "dcm",
            "--model",
            tiny_family[0],
            "--circuit",
            str(tmp_path / "c.json"),
            "--desiderata",
            desiderata,
            "--n",
            "8",
            "--n-boxes",
            "3",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 2
    assert message in capsys.readouterr().err


def test_load_desiderata_reads_and_generates_the_pairs(tmp_path, smollm2_tokenizer, pairs):
    """The desiderata reader beside entity tracking's data: names generate the task's pairs, a ``.jsonl`` file
    gives back the pairs written (named by its stem), in the order given."""
    from mechdiff.tasks.desiderata import desideratum_pairs
    from mechdiff.tasks.entity_tracking.desiderata import load_desiderata, read_desideratum

    write_jsonl(pairs[:5], tmp_path / "mine.jsonl")
    got = load_desiderata(f" label, {tmp_path / 'mine.jsonl'} ,object", smollm2_tokenizer, 12, 3, 4)
    assert list(got) == ["label", "mine", "object"]
    assert got["mine"] == pairs[:5] == read_desideratum(tmp_path / "mine.jsonl")
    for name in ("label", "object"):
        assert got[name] == desideratum_pairs(name, smollm2_tokenizer, 12, n_boxes=3, seed=4)
    with pytest.raises(ValueError, match="no desiderata given"):
        load_desiderata(" , ", smollm2_tokenizer, 12, 3, 4)


def test_cli_dcm_prints_the_dcm_table_before_semantic_patching(tmp_path, tiny_family, monkeypatch, capsys):
    """The DCM table reaches stdout as soon as it is ready, before semantic patching (which loads the other
    models); a full run prints each table once."""
    import mechdiff.studies.circuits.dcm as study

    Circuit("tiny", "entity-tracking", {"A": [Head(1, 0), Head(1, 1)]}, {"A": "last"}).save(tmp_path / "c.json")
    argv = [
        "dcm",
        "--model",
        tiny_family[0],
        "--semantic",
        tiny_family[1],
        "--circuit",
        str(tmp_path / "c.json"),
        "--desiderata",
        "object",
        "--n",
        "20",
        "--n-boxes",
        "3",
        "--epochs",
        "1",
        "--n-random",
        "1",
    ]

    def refuse(*args, **kwargs):
        raise RuntimeError("semantic patching ran")

    with monkeypatch.context() as m:
        m.setattr(study, "_semantic", refuse)
        with pytest.raises(RuntimeError, match="semantic patching ran"):
            cli_main([*argv, "--out", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert "| group" in out and "object" in out
    assert (tmp_path / "a" / "dcm.md").is_file()
    assert cli_main([*argv, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.count("| group") == 1 + ("semantic patching skipped" not in out)


HEADS = [Head(1, 0), Head(2, 1), Head(2, 3)]


@pytest.fixture(scope="module")
def model(smollm2_tokenizer):
    return make_tiny("llama", smollm2_tokenizer, seed=5)


@pytest.fixture(scope="module")
def dcm_pairs(smollm2_tokenizer):
    return object_value_pairs(smollm2_tokenizer, 20, n_boxes=3, seed=4)


def _exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"parameterisation": "l0"}, "parameterisation must be one of ('continuous', 'hard_concrete'), got 'l0'"),
        ({"lam_scale": "relative"}, "lam_scale must be 'loss' or 'absolute', got 'relative'"),
        ({"random_pool": "heads"}, "random_pool must be one of ('layer', 'all', 'group'), got 'heads'"),
        ({"split": (0.0, 0.5, 0.5)}, "split must be three positive fractions summing to 1, got (0.0, 0.5, 0.5)"),
        ({"split": (0.5, 0.5)}, "split must be three positive fractions summing to 1, got (0.5, 0.5)"),
        ({"split": (0.6, 0.2, 0.3)}, "split must be three positive fractions summing to 1, got (0.6, 0.2, 0.3)"),
        ({"batch_size": 0}, "batch_size, micro_batch and eval_batch must be at least 1"),
        ({"micro_batch": 0}, "batch_size, micro_batch and eval_batch must be at least 1"),
        ({"eval_batch": 0}, "batch_size, micro_batch and eval_batch must be at least 1"),
    ],
)
def test_config_refusals_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=_exactly(message)):
        DCMConfig(**settings)
    DCMConfig(split=(0.98, 0.01, 0.01), batch_size=1, micro_batch=1, eval_batch=1)  # the edges are accepted


def test_split_indices_are_the_seeded_shuffle_cut_by_the_fractions():
    order = list(range(10))
    random.Random(7).shuffle(order)
    assert split_indices(10, (0.6, 0.2, 0.2), 7) == (order[:6], order[6:8], order[8:])
    assert [len(p) for p in split_indices(3, (0.9, 0.05, 0.05), 0)] == [1, 1, 1]
    assert [len(p) for p in split_indices(5, (0.2, 0.6, 0.2), 0)] == [1, 3, 1]
    with pytest.raises(ValueError, match=_exactly("DCM needs at least 3 pairs (train/validation/test), got 2")):
        split_indices(2, (0.6, 0.2, 0.2), 0)


@pytest.mark.parametrize("seed", range(20))
def test_dcm_splits_share_no_item(seed):
    """Pairs repeated within items (one clean prompt, several counterfactuals): train, validation and test share no
    item, hold every pair once, each is non-empty and within one item's rows of its share; pairs of distinct items
    split exactly as the plain seeded split."""
    rng = random.Random(seed)
    items = [i for i in range(rng.randint(3, 30)) for _ in range(rng.randint(1, 6))]
    n = len(items)
    parts = split_indices(n, (0.6, 0.2, 0.2), seed, items)
    held = [{items[i] for i in p} for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(n)) and all(parts)
    assert not held[0] & held[1] and not held[0] & held[2] and not held[1] & held[2]
    plain = split_indices(n, (0.6, 0.2, 0.2), seed)
    for got, want in zip(parts[:2], plain[:2]):
        assert len(got) >= len(want) or len(held[2]) + len(held[1]) <= 2  # cut short only to leave the later splits
        assert len(got) < len(want) + 6
    assert split_indices(n, (0.6, 0.2, 0.2), seed, [f"p{i}" for i in range(n)]) == plain
    with pytest.raises(ValueError, match="at least 3 items"):
        split_indices(6, (0.6, 0.2, 0.2), seed, [0, 0, 0, 1, 1, 1])


def _estimate(v: float) -> Interval:
    return Interval(v, v - 0.1, v + 0.1, 10, 10, "test")


def test_result_and_semantic_records_field_by_field():
    result = DCMResult(
        "object",
        "last",
        [Head(1, 0), Head(2, 1)],
        [0.9, 0.1],
        [Head(2, 1)],
        _estimate(0.6),
        _estimate(0.2),
        _estimate(0.7),
        None,
        (6, 2, 3),
        4,
        [{"step": 0}],
        "A",
        {"lr": 0.1},
    )
    assert result.to_dict() == {
        "group": "A",
        "desideratum": "object",
        "position": "last",
        "heads": ["L1H0", "L2H1"],
        "mask": [0.9, 0.1],
        "selected": ["L2H1"],
        "test_accuracy": _estimate(0.6).to_dict(),
        "floor": _estimate(0.2).to_dict(),
        "full_group": _estimate(0.7).to_dict(),
        "random": None,
        "n_train": 6,
        "n_val": 2,
        "n_test": 3,
        "best_step": 4,
        "history": [{"step": 0}],
        "config": {"lr": 0.1},
        "random_heads": [],
        "random_outcomes": [],
    }
    assert dataclasses.replace(result, random=_estimate(0.3)).to_dict()["random"] == _estimate(0.3).to_dict()
    assert SemanticResult("m", _estimate(0.5), _estimate(0.25)).to_dict() == {
        "model": "m",
        "accuracy": _estimate(0.5).to_dict(),
        "floor": _estimate(0.25).to_dict(),
    }


def _mean_target_logit(model, dcm_pairs, heads, mask, absolute: bool = False) -> float:
    """Mean target logit (or mean |target logit|) of full-length runs with ``heads`` mixed under ``mask``
    (no cache, no suffix run)."""
    batch = pair_batch_tensors(dcm_pairs)
    values = source_z(model, batch, sorted({h.layer for h in heads}), "last")
    patches = masked_z_patches(model, heads, mask, values, batch["base"]["positions"]["last"])
    with torch.no_grad():
        logits = run(model, batch["base"]["input_ids"], patches).logits
    logit = answer_logit(logits, batch["target_ids"])
    return float((logit.abs() if absolute else logit).mean())


def test_loss_scale_is_the_unpatched_mean_absolute_target_logit_of_the_first_micro_batch(model, dcm_pairs):
    cache = PairCache.build(model, dcm_pairs, [(HEADS, "last")])
    train = [5, 2, 9, 11, 0]
    config = DCMConfig(micro_batch=3)
    expected = _mean_target_logit(model, [dcm_pairs[i] for i in train[:3]], HEADS, torch.ones(3), absolute=True)
    assert loss_scale(model, HEADS, "last", cache, train, config) == pytest.approx(expected, rel=1e-5)
    assert loss_scale(model, HEADS, "last", cache, train, dataclasses.replace(config, lam_scale="absolute")) == 1.0
    assert loss_scale(model, HEADS, "last", cache, [], config) == 1.0


@pytest.mark.parametrize("lam_scale", ["absolute", "loss"])
def test_one_step_reports_its_loss_and_history_its_validation(model, dcm_pairs, lam_scale):
    """One optimiser step on every training pair: the history's loss is -(mean target logit) + lam * scale *
    sum(1 - m) at the initial mask, computed here from full-length runs; each validation's accuracy and
    selection are those of the mask it validated; the mask moves by Adam's first step, lr * sign(gradient)."""
    cache = PairCache.build(model, dcm_pairs, [(HEADS, "last")])
    train, val = list(range(8)), list(range(8, 14))
    config = DCMConfig(
        lam=0.5, lam_scale=lam_scale, lr=0.3, epochs=1, batch_size=8, micro_batch=3, eval_every=1, init=0.8
    )
    init = torch.full((3,), 0.8)
    scale = (
        1.0
        if lam_scale == "absolute"
        else _mean_target_logit(model, [dcm_pairs[i] for i in train[:3]], HEADS, torch.ones(3), absolute=True)
    )
    lam = 0.5 * scale
    expected_loss = -_mean_target_logit(model, [dcm_pairs[i] for i in train], HEADS, init) + lam * float(
        (1 - init).sum()
    )
    mask = init.clone().requires_grad_()
    objective = -_mean_target_logit_grad(model, [dcm_pairs[i] for i in train], HEADS, mask) + lam * (1 - mask).sum()
    (grad,) = torch.autograd.grad(objective, mask)
    values, best_step, history = train_mask(model, HEADS, "last", cache, train, val, config, progress=False)
    assert [h["step"] for h in history] == [0, 1]
    assert np.isnan(history[0]["loss"]) and history[1]["loss"] == pytest.approx(expected_loss, rel=1e-4)
    moved = (init - 0.3 * torch.sign(grad)).clamp(0, 1)
    for entry, m in zip(history, [init, moved]):
        chosen = [h for h, v in zip(HEADS, m.tolist()) if v < 0.5]
        assert entry["n_selected"] == len(chosen)
        direct = target_accuracy(model, [dcm_pairs[i] for i in val], chosen, "last") if chosen else cache.floor[val]
        assert entry["val_accuracy"] == pytest.approx(float(np.mean(direct)))
    best = max(range(2), key=lambda i: (history[i]["val_accuracy"], history[i]["n_selected"], -i))
    assert best_step == best
    torch.testing.assert_close(values, [init, moved][best], atol=1e-4, rtol=0)


def _mean_target_logit_grad(model, dcm_pairs, heads, mask) -> torch.Tensor:
    batch = pair_batch_tensors(dcm_pairs)
    values = source_z(model, batch, sorted({h.layer for h in heads}), "last")
    patches = masked_z_patches(model, heads, mask, values, batch["base"]["positions"]["last"])
    logits = run(model, batch["base"]["input_ids"], patches, grad=True).logits
    return answer_logit(logits, batch["target_ids"]).mean()


def test_run_dcm_reports_the_accuracies_of_what_it_selected(model, dcm_pairs):
    config = DCMConfig(
        lam=0.0, lr=0.5, epochs=2, batch_size=4, eval_every=4, init=0.4, n_random=2, random_pool="group", seed=3
    )
    res = run_dcm(model, HEADS, "last", dcm_pairs, config, desideratum="object", group="B", progress=False)
    train, val, test = split_indices(len(dcm_pairs), config.split, config.seed)
    tested = [dcm_pairs[i] for i in test]
    assert res.n_split == (len(train), len(val), len(test)) == (12, 4, 4)
    assert [h["step"] for h in res.history] == [0, 4, 6]  # every eval_every steps, and the last (3 an epoch)
    assert res.selected == [h for h, m in zip(HEADS, res.mask) if m < 0.5] and res.selected
    assert res.mask == [round(m, 4) for m in res.mask]
    assert res.test_accuracy.value == pytest.approx(target_accuracy(model, tested, res.selected, "last").mean())
    assert res.full_group.value == pytest.approx(target_accuracy(model, tested, HEADS, "last").mean())
    assert res.test_accuracy.n_rows == res.floor.n_rows == res.full_group.n_rows == len(test)
    unpatched = [_mean_target_logit_top1(model, p) for p in tested]
    assert res.floor.value == pytest.approx(np.mean(unpatched))
    rng = random.Random(config.seed + 1)
    draws = [target_accuracy(model, tested, rng.sample(HEADS, len(res.selected)), "last") for _ in range(2)]
    assert res.random.value == pytest.approx(np.mean(draws))
    assert (res.desideratum, res.group, res.position, res.heads) == ("object", "B", "last", HEADS)
    assert res.config == dataclasses.asdict(config)
    assert res.test_accuracy == proportion(target_accuracy(model, tested, res.selected, "last"))
    with pytest.raises(ValueError, match=_exactly("DCM needs at least one head")):
        run_dcm(model, [], "last", dcm_pairs, config)


def _mean_target_logit_top1(model, pair) -> float:
    batch = pair_batch_tensors([pair])
    with torch.no_grad():
        logits = run(model, batch["base"]["input_ids"]).logits
    return float(logits.argmax(-1).item() == batch["target_ids"].item())


def test_random_pool_and_no_baseline(model):
    config = DCMConfig(random_pool="all")
    assert random_pool(model, HEADS, config) == all_heads(model.shape.n_layers, model.shape.n_heads)
    assert random_pool(model, HEADS, dataclasses.replace(config, random_pool="group")) == HEADS
    assert random_pool(model, HEADS, DCMConfig()) == HEADS  # layer-matched draws: the group's layers are cached
    assert random_pool(model, HEADS, dataclasses.replace(config, n_random=0)) == HEADS


def test_patched_runs_resume_at_the_group_and_read_the_base_keys_and_values(model, dcm_pairs, monkeypatch):
    """The cache's patched runs skip the blocks below the group's first layer and the positions before the
    patched one (cost, not values: the values are checked against full runs in test_dcm.py)."""
    cache = PairCache.build(model, dcm_pairs[:4], [(HEADS, "last")])
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(dcm, "run", spy)
    cache.logits(model, [0, 2], HEADS, torch.ones(3), "last")
    (kwargs,) = calls
    assert kwargs["resume"].layer == 1 and kwargs["resume"].hidden.shape[0] == 2
    assert kwargs["prefix"] is not None and kwargs["prefix"].keys[0].shape[0] == 2
    assert kwargs["grad"] is False


def test_a_circuit_builds_one_cache_per_desideratum(model, dcm_pairs, monkeypatch, caplog):
    built = []
    original = PairCache.build

    def count(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(PairCache, "build", count)
    circuit = Circuit(
        "tiny",
        "entity-tracking",
        {"A": [Head(1, 0)], "B": [Head(2, 1)], "C": []},
        {"A": "last", "B": "last", "C": "last"},
    )
    config = DCMConfig(epochs=1, batch_size=8, eval_every=1, n_random=1)
    with caplog.at_level(logging.INFO, logger="mechdiff.methods.dcm"):
        results = dcm_circuit(model, circuit, {"one": dcm_pairs[:8], "two": dcm_pairs[8:16]}, config, progress=False)
    assert len(built) == 2
    assert "DCM group B (1 heads at last), desideratum two" in caplog.messages
    assert [(r.group, r.desideratum) for r in results] == [("A", "one"), ("A", "two"), ("B", "one"), ("B", "two")]
    with pytest.raises(ValueError, match=_exactly("group 'D' is not in the circuit (groups: ['A', 'B', 'C'])")):
        dcm_circuit(model, circuit, {"one": dcm_pairs[:8]}, config, groups=["D"], progress=False)


def test_a_circuit_holds_one_desideratum_cache_at_a_time(model, dcm_pairs, monkeypatch):
    """Each desideratum's cache file (every layer's keys and values of its pairs: about 17 GB for the paper-form
    study's 2000 SmolLM2 pairs) is deleted before the next is built, and so is the last one's when DCM is done."""
    on_disk_at_build, files = [], []
    original = PairCache.build

    def build(*args, **kwargs):
        on_disk_at_build.append(sum(path.exists() for path in files))
        cache = original(*args, **kwargs)
        files.append(cache.store.path)
        return cache

    monkeypatch.setattr(PairCache, "build", build)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(1, 0)]}, {"A": "last"})
    config = DCMConfig(epochs=1, batch_size=8, eval_every=1, n_random=1)
    dcm_circuit(
        model, circuit, {"one": dcm_pairs[:8], "two": dcm_pairs[8:16], "three": dcm_pairs[:8]}, config, progress=False
    )
    assert on_disk_at_build == [0, 0, 0]
    assert len(files) == 3 and not any(path.parent.exists() for path in files)


def test_semantic_patching_refuses_an_empty_selection(model, dcm_pairs):
    with pytest.raises(
        ValueError, match=_exactly("semantic patching needs at least one head (the DCM selection was empty)")
    ):
        semantic_patching([model], [], "last", dcm_pairs)
    (res,) = semantic_patching([model], [Head(2, 1)], "last", dcm_pairs[:6], batch_size=4)
    assert res.accuracy.value == pytest.approx(target_accuracy(model, dcm_pairs[:6], [Head(2, 1)], "last").mean())
    assert res.floor.value == pytest.approx(np.mean([_mean_target_logit_top1(model, p) for p in dcm_pairs[:6]]))


def test_a_mask_at_one_half_selects_nothing(model, dcm_pairs):
    """Selected heads are those with m < 0.5: a mask that never leaves 0.5 (learning rate 0) selects none, so
    the test accuracy is the floor and there is no random baseline of size 0."""
    config = DCMConfig(lr=0.0, init=0.5, epochs=1, batch_size=12, eval_every=1, n_random=2)
    res = run_dcm(model, HEADS, "last", dcm_pairs, config, progress=False)
    assert res.mask == [0.5, 0.5, 0.5] and res.selected == [] and res.random is None
    assert res.test_accuracy == res.floor
    assert [h["n_selected"] for h in res.history] == [0, 0]


def test_a_position_absent_from_a_source_prompt_is_refused(model, dcm_pairs):
    batch = pair_batch_tensors(dcm_pairs[:2])
    batch["source"]["positions"]["last"] = torch.tensor([5, -1])
    with pytest.raises(
        ValueError,
        match=_exactly(
            "position 'last' is absent from some source prompts (e.g. path-patching sources); DCM needs the "
            "group's position in both prompts of every pair"
        ),
    ):
        source_z(model, batch, [1], "last")


def test_a_quiet_dcm_prints_nothing(model, dcm_pairs, capsys, monkeypatch):
    """``progress=False``: no bar from the cache, training, validation or evaluation, even on a terminal."""
    from mechdiff.common import progress

    monkeypatch.setattr(progress, "interactive", lambda stream=None: True)  # bars drawn as on a terminal
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(1, 0), Head(2, 1)]}, {"A": "last"})
    dcm_circuit(
        model,
        circuit,
        {"one": dcm_pairs[:9]},
        DCMConfig(epochs=1, batch_size=3, eval_every=1, n_random=1),
        progress=False,
    )
    semantic_patching([model], [Head(2, 1)], "last", dcm_pairs[:3], progress=False)
    assert capsys.readouterr().err == ""
    semantic_patching([model], [Head(2, 1)], "last", dcm_pairs[:3])  # the default shows its bars
    assert "dcm cache" in capsys.readouterr().err


BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1  # Louizos et al. (2018), written out independently of mechdiff.methods.dcm


def _hard_concrete(n: int, log_alpha: float, init: float = 1.0) -> _Mask:
    mask = _Mask(n, DCMConfig(parameterisation="hard_concrete", init=init), torch.device("cpu"))
    with torch.no_grad():
        mask.param.fill_(log_alpha)
    return mask


@pytest.mark.parametrize("log_alpha", [-3.0, -0.7, 0.0, 1.2, 3.0])
def test_hard_concrete_penalty_is_the_expected_number_of_open_gates(log_alpha):
    """L0 penalty = sum of P(gate > 0), measured on 200k sampled gates (4.5 standard errors of tolerance)."""
    n = 200_000
    mask = _hard_concrete(n, log_alpha)
    torch.manual_seed(0)
    gate = 1 - mask.sample()
    assert float(mask.penalty()) / n == pytest.approx(float((gate > 0).float().mean()), abs=0.005)
    # and the closed form: P(s > -gamma / (zeta - gamma)) with s a binary concrete of temperature beta
    t = -GAMMA / (ZETA - GAMMA)
    closed = 1 / (1 + math.exp(-(log_alpha - BETA * math.log(t / (1 - t)))))
    assert float(mask.penalty()) / n == pytest.approx(closed, rel=1e-5)


@pytest.mark.parametrize("log_alpha", [-1.0, 0.5, 2.0])
def test_hard_concrete_sample_is_the_stretched_binary_concrete(log_alpha):
    """P(gate = 1) and P(gate = 0) of the stretched, clipped binary concrete, and the gate's mean."""
    n = 200_000
    mask = _hard_concrete(n, log_alpha)
    torch.manual_seed(1)
    gate = 1 - mask.sample()
    assert float(gate.min()) >= 0 and float(gate.max()) <= 1

    def p_s_above(x: float) -> float:  # s = sigmoid((logit(u) + log_alpha) / beta), u ~ U(0, 1)
        return 1 / (1 + math.exp(-(log_alpha - BETA * math.log(x / (1 - x)))))

    assert float((gate == 1).float().mean()) == pytest.approx(p_s_above((1 - GAMMA) / (ZETA - GAMMA)), abs=0.005)
    assert float((gate == 0).float().mean()) == pytest.approx(1 - p_s_above(-GAMMA / (ZETA - GAMMA)), abs=0.005)
    u = torch.rand(n, generator=torch.Generator().manual_seed(2)).clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((torch.log(u / (1 - u)) + log_alpha) / BETA)
    direct = (s * (ZETA - GAMMA) + GAMMA).clamp(0, 1)
    assert float(gate.mean()) == pytest.approx(float(direct.mean()), abs=0.005)


def test_hard_concrete_penalty_gradient_opens_gates():
    mask = _hard_concrete(3, 0.0)
    mask.penalty().backward()
    grad = mask.param.grad
    p = 1 / (1 + math.exp(BETA * math.log(-GAMMA / ZETA)))
    assert torch.allclose(grad, torch.full((3,), p * (1 - p)), atol=1e-6)


@pytest.mark.parametrize("init,expected", [(1.0, 0.5), (0.2, 0.2), (0.0, 0.05), (0.4, 0.4)])
def test_hard_concrete_starts_at_the_configured_mask(init, expected):
    """The deterministic mask starts at ``init``, with the gate at least half and at most 0.95 open."""
    mask = _Mask(4, DCMConfig(parameterisation="hard_concrete", init=init), torch.device("cpu"))
    torch.testing.assert_close(mask.values(), torch.full((4,), expected), atol=1e-6, rtol=0)
    la = float(mask.param[0])
    assert float(mask.values()[0]) == pytest.approx(
        1 - min(1, max(0, (1 / (1 + math.exp(-la))) * (ZETA - GAMMA) + GAMMA)), abs=1e-6
    )


def test_continuous_mask_penalty_values_and_clamp():
    mask = _Mask(3, DCMConfig(parameterisation="continuous", init=0.7), torch.device("cpu"))
    assert float(mask.penalty()) == pytest.approx(3 * 0.3)
    assert mask.sample() is mask.param
    with torch.no_grad():
        mask.param.copy_(torch.tensor([-0.5, 0.4, 1.5]))
    mask.after_step()
    torch.testing.assert_close(mask.values(), torch.tensor([0.0, 0.4, 1.0]))
    assert not mask.values().requires_grad


def test_hard_concrete_after_step_leaves_log_alpha_unclamped():
    mask = _hard_concrete(2, 4.0)
    mask.after_step()
    assert torch.equal(mask.param.detach(), torch.full((2,), 4.0))


def test_hard_concrete_mask_lives_on_the_asked_device():
    for kind in ("continuous", "hard_concrete"):
        mask = _Mask(2, DCMConfig(parameterisation=kind), torch.device("meta"))
        assert mask.param.device.type == "meta" and mask.param.requires_grad


@pytest.mark.parametrize("log_alpha,expected", [(-6.0, 1.0), (6.0, 0.0)])
def test_hard_concrete_values_are_clipped_to_the_unit_interval(log_alpha, expected):
    """A nearly closed gate gives mask 1 exactly, a nearly open one 0: the stretched sigmoid is clipped."""
    assert torch.equal(_hard_concrete(3, log_alpha).values(), torch.full((3,), expected))


def test_dcm_loss_at_an_explicit_mask_with_absolute_lambda(tiny_llama, smollm2_tokenizer):
    import torch

    from mechdiff.methods.dcm import DCMConfig, _Mask, _step, loss_scale
    from mechdiff.methods.dcm_cache import PairCache
    from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors

    model, pairs = tiny_llama, object_value_pairs(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    heads, m = [Head(0, 1), Head(1, 2), Head(2, 0)], torch.tensor([0.25, 1.0, 0.6])
    config = DCMConfig.paper(micro_batch=4)  # two micro-batches (4 + 2) accumulate one step
    cache = PairCache.build(model, pairs, [(heads, "last")], 6)
    rows = list(range(6))
    assert loss_scale(model, heads, "last", cache, rows, config) == 1.0  # absolute: lambda as given
    mask = _Mask(len(heads), config, model.device)
    mask.param.data = m.clone()
    got = _step(model, heads, "last", cache, rows, mask, torch.optim.Adam([mask.param], lr=0.0), config)

    # direct: plain HF forwards; the o_proj input of each head at "last" mixed m * base + (1 - m) * source
    batch = pair_batch_tensors(pairs)
    d = model.shape.d_head
    layers = model.model.model.layers
    source: dict = {}
    hooks = [
        layers[h.layer].self_attn.o_proj.register_forward_pre_hook(
            lambda mod, args, layer=h.layer: source.__setitem__(layer, args[0].detach().clone())
        )
        for h in heads
    ]
    with torch.no_grad():
        model.model(input_ids=batch["source"]["input_ids"], use_cache=False)
    for hook in hooks:
        hook.remove()
    rows_t = torch.arange(len(pairs))
    pb, ps = batch["base"]["positions"]["last"], batch["source"]["positions"]["last"]

    def mix(layer):
        def pre(mod, args):
            x = args[0].clone()
            for h, value in zip(heads, m.tolist()):
                if h.layer == layer:
                    cols = slice(h.head * d, (h.head + 1) * d)
                    x[rows_t, pb, cols] = value * x[rows_t, pb, cols] + (1 - value) * source[layer][rows_t, ps, cols]
            return (x,)

        return pre

    hooks = [layers[l].self_attn.o_proj.register_forward_pre_hook(mix(l)) for l in {h.layer for h in heads}]
    with torch.no_grad():
        logits = model.model(input_ids=batch["base"]["input_ids"], use_cache=False).logits
    for hook in hooks:
        hook.remove()
    target_logit = logits[rows_t, pb, batch["target_ids"]]
    # sum(1 - m) = 0.75 + 0 + 0.4 = 1.15; lambda = 0.01 absolute: the sparsity term is 0.0115
    expected = -float(target_logit.mean()) + 0.01 * 1.15
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-4 * float(target_logit.abs().mean()))
    # mechdiff's default scales lambda by the unpatched mean |logit(target)|, so the same mask costs more
    scaled = DCMConfig(micro_batch=4)
    factor = loss_scale(model, heads, "last", cache, rows, scaled)
    assert factor != 1.0
    mask.param.data = m.clone()
    got_scaled = _step(model, heads, "last", cache, rows, mask, torch.optim.Adam([mask.param], lr=0.0), scaled, factor)
    assert got_scaled - got == pytest.approx(0.01 * 1.15 * (factor - 1), rel=1e-3, abs=1e-5)


def test_dcm_paper_preset_and_validation_schedule(tiny_llama, smollm2_tokenizer):
    from mechdiff.methods.dcm import DCMConfig, train_mask, validates
    from mechdiff.methods.dcm_cache import PairCache
    from mechdiff.tasks.entity_tracking import object_value_pairs

    paper = DCMConfig.paper()
    assert (paper.lam, paper.lam_scale, paper.lr, paper.epochs, paper.batch_size, paper.split, paper.shuffle) == (
        0.01,
        "absolute",
        0.1,
        2,
        32,
        (0.5, 0.25, 0.25),
        False,
    )
    # the paper validates after batches 0, 4, 8, ... of each epoch; mechdiff every eval_every steps and the last
    assert [b for b in range(10) if validates(paper, 1, b, 20)] == [0, 4, 8]
    mine = DCMConfig(eval_every=4)
    assert [s for s in range(1, 11) if validates(mine, s, 0, 10)] == [4, 8, 10]
    pairs = object_value_pairs(smollm2_tokenizer, 12, n_boxes=3, seed=0)
    heads = [Head(2, 1), Head(1, 0)]
    cache = PairCache.build(tiny_llama, pairs, [(heads, "last")], 12)
    config = DCMConfig.paper(batch_size=1)  # 10 training pairs: 10 batches per epoch
    _, _, history = train_mask(tiny_llama, heads, "last", cache, list(range(10)), [10, 11], config, progress=False)
    assert [h["step"] for h in history] == [1, 5, 9, 11, 15, 19]
    _, _, history = train_mask(
        tiny_llama,
        heads,
        "last",
        cache,
        list(range(10)),
        [10, 11],
        DCMConfig(batch_size=1, eval_every=4, epochs=2),
        progress=False,
    )
    assert [h["step"] for h in history] == [0, 4, 8, 12, 16, 20]


def test_dcm_command_preset_paper():
    from mechdiff.cli import build_parser
    from mechdiff.commands.dcm import config_from_args
    from mechdiff.methods.dcm import DCMConfig

    args = build_parser().parse_args(["dcm", "--circuit", "c.json", "--preset", "paper", "--micro-batch", "8"])
    assert config_from_args(args) == DCMConfig.paper(
        micro_batch=8, eval_batch=32, n_random=20, random_pool="layer", seed=0
    )
    args = build_parser().parse_args(["dcm", "--circuit", "c.json", "--preset", "paper", "--epochs", "3"])
    with pytest.raises(SystemExit, match="--epochs"):
        config_from_args(args)


N_BOXES = 3


@pytest.fixture
def pair_cache(tiny_llama, smollm2_tokenizer):
    pairs = object_value_pairs(smollm2_tokenizer, 12, n_boxes=N_BOXES, seed=0)
    heads = [Head(2, h) for h in range(4)]
    return tiny_llama, heads, pairs, PairCache.build(tiny_llama, pairs, [(heads, "last")], 12, False)


def test_lambda_scale_is_the_unpatched_target_logit(pair_cache):
    model, heads, pairs, cache = pair_cache
    batch = pair_batch_tensors(pairs[:4])
    with torch.no_grad():
        logits = run(model, batch["base"]["input_ids"]).logits
    expected = logits.gather(1, batch["target_ids"][:, None]).abs().mean().item()
    config = DCMConfig(micro_batch=4)
    assert loss_scale(model, heads, "last", cache, [0, 1, 2, 3], config) == pytest.approx(expected, rel=1e-5)
    assert loss_scale(model, heads, "last", cache, [0, 1], DCMConfig(lam_scale="absolute")) == 1.0
    with pytest.raises(ValueError, match="lam_scale"):
        DCMConfig(lam_scale="relative")


def test_validation_ties_go_to_the_larger_head_set(pair_cache, monkeypatch):
    """With every validation accuracy equal, the best step is the one that patches the most heads."""
    model, heads, pairs, cache = pair_cache
    monkeypatch.setattr(PairCache, "accuracy", lambda self, *a, **k: np.ones(3))
    config = DCMConfig(epochs=4, batch_size=4, eval_every=1, lam=0.0, lr=0.5, seed=0)
    values, best_step, history = train_mask(
        model, heads, "last", cache, list(range(8)), [8, 9, 10], config, progress=False
    )
    most = max(h["n_selected"] for h in history)
    assert most > 0  # the target-logit gradient opened some heads during training
    chosen = next(h for h in history if h["step"] == best_step)
    assert chosen["n_selected"] == most
    assert int((values < 0.5).sum()) == most
