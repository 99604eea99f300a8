"""DCM on tiny models: the mixing mask's identities, gradients that reach the mask (against finite
differences), and a planted head that DCM must find."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from conftest import make_tiny
from mechdiff.circuits.circuit import Circuit
from mechdiff.cli import main as cli_main
from mechdiff.common.components import Head, all_heads
from mechdiff.methods.dcm import (DCMConfig, dcm_circuit, masked_z_patches, run_dcm, semantic_patching, source_z,
                          split_pairs, target_accuracy)
from mechdiff.patching.core import Patch, head_patch, run
from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors, write_jsonl

PLANTED = Head(2, 1)


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
    direct = [head_patch(tiny_model, "z", h, cap[("z", h.layer)][rows, pos_s][:, h.head * 8:(h.head + 1) * 8], pos_b)
              for h in heads]
    # exact: a mask of zeros writes source * 1 + clean * 0, the source values themselves
    torch.testing.assert_close(run(tiny_model, ids, masked).logits, run(tiny_model, ids, direct).logits,
                               rtol=0, atol=0)


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


def planted_case(tokenizer, pairs):
    """A tiny llama whose head ``PLANTED`` dominates the last layer, and pairs whose target is the
    answer the model gives when exactly that head's z at ``last`` comes from the source."""
    model = make_tiny("llama", tokenizer, seed=3)
    o_proj = model.arch.module(model.model, "z", PLANTED.layer)
    d = model.shape.d_head
    o_proj.weight[:, PLANTED.head * d:(PLANTED.head + 1) * d] *= 40
    patched = []
    for chunk in range(0, len(pairs), 16):
        part = pairs[chunk:chunk + 16]
        batch = pair_batch_tensors(part)
        values = source_z(model, batch, [PLANTED.layer], "last")
        patches = masked_z_patches(model, [PLANTED], torch.zeros(1), values, batch["base"]["positions"]["last"])
        with torch.no_grad():
            new = run(model, batch["base"]["input_ids"], patches).logits.argmax(-1)
            old = run(model, batch["base"]["input_ids"]).logits.argmax(-1)
        patched += [dataclasses.replace(p, target_id=int(t), kind="planted")
                    for p, t, o in zip(part, new.tolist(), old.tolist()) if t != o]
    return model, patched


@pytest.mark.parametrize("parameterisation", ["continuous", "hard_concrete"])
def test_dcm_finds_planted_head(planted, parameterisation):
    model, planted = planted
    assert len(planted) >= 30, len(planted)
    candidates = [Head(2, h) for h in range(4)] + [Head(1, 0), Head(1, 2)]
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

    from mechdiff.methods.dcm import split_indices, target_accuracy

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


def test_cli_dcm_with_user_desideratum(tmp_path, smollm2_tokenizer, pairs):
    model, planted = planted_case(smollm2_tokenizer, pairs[:32])
    model.model.save_pretrained(tmp_path / "m")
    smollm2_tokenizer.save_pretrained(tmp_path / "m")
    write_jsonl(planted, tmp_path / "planted.jsonl")
    circuit = Circuit("tiny", "entity-tracking", {"A": [PLANTED, Head(2, 0)]}, {"A": "last"})
    circuit.save(tmp_path / "c.json")
    out = tmp_path / "out"
    rc = cli_main(["dcm", "--model", str(tmp_path / "m"), "--circuit", str(tmp_path / "c.json"),
                   "--desiderata", str(tmp_path / "planted.jsonl"), "--epochs", "1", "--batch-size", "8",
                   "--n-random", "1", "--out", str(out)])
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
    from mechdiff.methods.dcm import PairCache

    subset = pairs[:10]
    heads = [Head(1, 0), Head(2, 3)]
    cache = PairCache.build(tiny_llama, subset, [(heads, "last")], batch_size=4)
    assert set(cache.prefix) == {1}
    batch = pair_batch_tensors(subset)
    values = source_z(tiny_llama, batch, [1, 2], "last")
    plain = run(tiny_llama, batch["base"]["input_ids"],
                masked_z_patches(tiny_llama, heads, torch.zeros(2), values, batch["base"]["positions"]["last"]))
    logits, target = cache.logits(tiny_llama, range(10), heads, torch.zeros(2), "last")
    torch.testing.assert_close(logits, plain.logits, rtol=1e-5, atol=1e-6)
    assert (cache.accuracy(tiny_llama, range(10), heads, "last", 3) ==
            (plain.logits.argmax(-1) == batch["target_ids"]).numpy()).all()
    unpatched = run(tiny_llama, batch["base"]["input_ids"]).logits.argmax(-1) == batch["target_ids"]
    assert (cache.floor == unpatched.numpy()).all()


def test_pair_cache_suffix_gradients_equal_full_runs(tiny_llama, pairs):
    """DCM's training pass on the cache (resumed, only the positions from the patched one on, over the base
    run's keys/values) gives the full run's logits and the same gradient on the mask."""
    from mechdiff.methods.dcm import PairCache

    subset, heads = pairs[:6], [Head(1, 0), Head(2, 3)]
    cache = PairCache.build(tiny_llama, subset, [(heads, "query_label")], batch_size=3)
    assert cache.kv is not None and cache.kv.batch == 6
    batch = pair_batch_tensors(subset)
    values = source_z(tiny_llama, batch, [1, 2], "query_label")
    weights = torch.randn(6, tiny_llama.shape.vocab_size, generator=torch.Generator().manual_seed(0))
    grads = []
    for full in (False, True):
        mask = torch.full((2,), 0.3, requires_grad=True)
        if full:
            out = run(tiny_llama, batch["base"]["input_ids"], masked_z_patches(
                tiny_llama, heads, mask, values, batch["base"]["positions"]["query_label"]), grad=True).logits
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
def test_cli_dcm_checks_desiderata_before_any_weights(case, tmp_path, tiny_family, smollm2_tokenizer, monkeypatch,
                                                       capsys):
    from mechdiff.tasks.entity_tracking import generate

    Circuit("tiny", "entity-tracking", {"A": [Head(1, 0)]}, {"A": "last"}).save(tmp_path / "c.json")
    write_jsonl(generate(smollm2_tokenizer, 2, n_boxes=3, seed=0), tmp_path / "examples.jsonl")
    desiderata, message = {"unknown name": ("object,nonsense", "unknown desideratum 'nonsense'"),
                           "missing file": (str(tmp_path / "absent.jsonl"), "absent.jsonl"),
                           "not pairs": (str(tmp_path / "examples.jsonl"), "must hold counterfactual pairs")}[case]
    _no_weights(monkeypatch)
    rc = cli_main(["dcm", "--model", tiny_family[0], "--circuit", str(tmp_path / "c.json"), "--desiderata",
                   desiderata, "--n", "8", "--n-boxes", "3", "--out", str(tmp_path / "out")])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_load_desiderata_reads_and_generates_the_pairs(tmp_path, smollm2_tokenizer, pairs):
    """The desiderata reader beside entity tracking's data: names generate the task's pairs, a ``.jsonl`` file
    gives back the pairs written (named by its stem), in the order given."""
    from mechdiff.methods.dcm import desideratum_pairs
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
    import mechdiff.studies.dcm as study

    Circuit("tiny", "entity-tracking", {"A": [Head(1, 0), Head(1, 1)]}, {"A": "last"}).save(tmp_path / "c.json")
    argv = ["dcm", "--model", tiny_family[0], "--semantic", tiny_family[1], "--circuit", str(tmp_path / "c.json"),
            "--desiderata", "object", "--n", "20", "--n-boxes", "3", "--epochs", "1", "--n-random", "1"]

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
