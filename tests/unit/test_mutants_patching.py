"""Path patching, attribution, activation patching and scans against properties a correct run must have
(causality, identities, hand-computed sums). Written from the survivors of mutation testing
(benchmarks/mutation.md); each test takes a second or two on the tiny models."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from mechdiff.common.components import Head
from mechdiff.patching.path import Receivers, path_patch, prepare
from mechdiff.tasks.entity_tracking import path_patching_pairs


@pytest.fixture
def pairs(smollm2_tokenizer):
    return path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=5)


def test_senders_after_the_receivers_position_change_nothing(tiny_llama, pairs):
    """Causal attention: a sender at the last token cannot reach receivers' V at the earlier query label,
    so every score is 0 (up to rounding); the same senders at the query label do move the answer."""
    batch = prepare(tiny_llama, pairs)
    receivers = Receivers((Head(2, 1), Head(2, 2)), "v", "query_label")
    senders = [Head(0, h) for h in range(4)] + [Head(1, h) for h in range(4)]
    late = path_patch(tiny_llama, batch, senders, "last", receivers, progress=False)
    assert max(abs(v) for v in late.values()) < 1e-5
    early = path_patch(tiny_llama, batch, senders, "query_label", receivers, progress=False)
    assert max(abs(v) for v in early.values()) > 1e-4


def test_step_a_from_an_earlier_sender_position_resumes_above_layer_0(tiny_llama, pairs):
    """Senders at the query label, read at the last token (the frozen run is not a one-position run), all
    above layer 0 (the run resumes from the clean stream). With every other head frozen nothing carries the
    change to the last token, so each score is 0, as in full-length runs without resuming."""
    batch = prepare(tiny_llama, pairs)
    g = torch.Generator().manual_seed(1)
    batch.source_z = {l: z + torch.randn(z.shape, generator=g) for l, z in batch.source_z.items()}
    senders = [Head(1, 0), Head(1, 3), Head(2, 2)]
    full = dataclasses.replace(batch, clean_resid=None, clean_kv=None)
    plain = path_patch(tiny_llama, full, senders, "query_label", None, senders_per_pass=2, progress=False)
    got = path_patch(tiny_llama, batch, senders, "query_label", None, senders_per_pass=2, progress=False)
    for s in senders:
        assert got[s] == pytest.approx(plain[s], rel=1e-4, abs=1e-6)
    assert max(map(abs, got.values())) < 1e-6
    batch.positions = {**batch.positions, "penultimate": torch.full((len(batch),), batch.clean_ids.shape[1] - 2)}
    assert max(map(abs, path_patch(tiny_llama, batch, senders, "penultimate", None, progress=False).values())) < 1e-6
    assert max(map(abs, path_patch(tiny_llama, batch, senders, "last", None, progress=False).values())) > 1e-4


def test_receivers_sharing_a_kv_group_are_one_site_and_logged(tiny_llama, caplog):
    """GQA (2 query heads per KV group): V receivers of one group are one site, said in the log."""
    from mechdiff.patching.path import receiver_sites

    with caplog.at_level(logging.INFO, logger="mechdiff.patching.path"):
        sites = receiver_sites(tiny_llama, Receivers((Head(2, 0), Head(2, 1), Head(1, 2)), "v", "last"))
    d = tiny_llama.shape.d_head
    assert sites == [(2, slice(0, d)), (1, slice(d, 2 * d))]
    assert caplog.messages == ["GQA: 1 receiver heads share KV groups; patching V patches whole groups (2 sites)"]
    assert len(receiver_sites(tiny_llama, Receivers((Head(2, 0), Head(2, 1)), "q", "last"))) == 2


def test_scan_positions_as_an_int_a_name_or_a_tensor_and_the_record(tiny_llama, smollm2_tokenizer):
    """One int is that position in every example (the same scan as the tensor of it); ``"last"`` is the last
    position; the result records each example's position, the clean and source metrics and its fields."""
    from mechdiff.common.metrics import answer_prob
    from mechdiff.patching.scan import scan
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(path_patching_pairs(smollm2_tokenizer, 2, n_boxes=3, seed=7))
    clean, answers = t["base"]["input_ids"], t["target_ids"]
    source = torch.randint(0, 5000, clean.shape, generator=torch.Generator().manual_seed(0))
    n, length = clean.shape
    at = scan(tiny_llama, clean, source, answers, site="z", positions=length - 3, per_pass=5)
    same = scan(tiny_llama, clean, source, answers, site="z", positions=torch.full((n,), length - 3), per_pass=5)
    torch.testing.assert_close(at.effects, same.effects, rtol=0, atol=0)  # exact: one position given two ways
    assert at.positions == [length - 3] * n
    last = scan(tiny_llama, clean, source, answers, site="z", positions="last", per_pass=5)
    assert last.positions == [length - 1] * n
    assert scan(tiny_llama, clean, source, answers, site="z", positions=None, per_pass=12).positions == []
    with torch.no_grad():
        p_source = answer_prob(tiny_llama.model(source).logits[:, -1], answers).mean()
    assert last.source == pytest.approx(float(p_source), abs=1e-6)
    assert last.to_dict() == {"site": "z", "metric": "prob", "axes": ["layer", "head"],
                              "label": "change in probability of the answer (prob)",
                              "clean": last.clean, "source": last.source, "positions": [length - 1] * n,
                              "effects": last.effects.tolist()}
    with pytest.raises(ValueError, match="^per_pass must be at least 1$"):
        scan(tiny_llama, clean, source, answers, per_pass=0)
    for bad, message in (("first", "positions must be 'last', an int, a LongTensor [batch] or None, not 'first'"),
                         (length, f"positions must give one position in [0, {length}) per example"),
                         (torch.tensor([1]), f"positions must give one position in [0, {length}) per example")):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            scan(tiny_llama, clean, source, answers, site="z", positions=bad)


def test_an_unknown_or_missing_position_is_refused_with_the_known_ones(tiny_llama, pairs):
    from mechdiff.patching.path import batch_position

    batch = prepare(tiny_llama, pairs)
    known = sorted(batch.positions)
    with pytest.raises(ValueError, match="^" + re.escape(f"unknown position 'box'; the dataset records {known}") + "$"):
        path_patch(tiny_llama, batch, [Head(0, 0)], "box", None, progress=False)
    batch.positions = {**batch.positions, "gone": torch.full((len(batch),), -1)}
    with pytest.raises(ValueError, match="^" + re.escape(
            "position 'gone' is missing (-1) or not one per example in some clean prompts") + "$"):
        batch_position(batch, "gone")


def _scan_prompts(tokenizer, n: int = 2):
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(path_patching_pairs(tokenizer, n, n_boxes=3, seed=7))
    clean = t["base"]["input_ids"]
    return clean, torch.randint(0, 5000, clean.shape, generator=torch.Generator().manual_seed(0)), t["target_ids"]


def test_scan_logit_difference_is_the_difference_of_the_answer_logit_scans(tiny_llama, smollm2_tokenizer):
    """The effect on logit(a) - logit(o) is the effect on logit(a) minus the effect on logit(o): the
    alternative answers are stacked with the copies like the answers."""
    from mechdiff.patching.scan import scan

    clean, source, answers = _scan_prompts(smollm2_tokenizer)
    other = answers.roll(1) + 7
    diff = scan(tiny_llama, clean, source, answers, site="z", metric="logit_diff", other_ids=other, per_pass=5)
    a = scan(tiny_llama, clean, source, answers, site="z", metric="answer_logit", per_pass=5)
    o = scan(tiny_llama, clean, source, other, site="z", metric="answer_logit", per_pass=5)
    torch.testing.assert_close(diff.effects, a.effects - o.effects, rtol=1e-4, atol=1e-5)
    assert float(diff.effects.abs().max()) > 1e-3


def test_resid_scan_does_not_depend_on_how_positions_are_grouped(tiny_llama, smollm2_tokenizer):
    """Positions scanned two per pass (three passes, the last one short) or all in one pass, given as a list
    or a tensor: the same grid."""
    from mechdiff.patching.scan import scan

    clean, source, answers = _scan_prompts(smollm2_tokenizer)
    positions = [0, 3, 6, 9, clean.shape[1] - 1]
    two = scan(tiny_llama, clean, source, answers, site="resid", positions=positions, per_pass=2)
    one = scan(tiny_llama, clean, source, answers, site="resid", positions=positions, per_pass=8)
    torch.testing.assert_close(two.effects, one.effects, rtol=1e-4, atol=1e-6)
    as_tensor = scan(tiny_llama, clean, source, answers, site="resid", positions=torch.tensor(positions), per_pass=8)
    assert as_tensor.positions == positions
    torch.testing.assert_close(as_tensor.effects, one.effects, rtol=0, atol=0)  # exact: the same positions
    every = scan(tiny_llama, clean, source, answers, site="resid", positions=None, per_pass=32)
    assert every.positions == list(range(clean.shape[1]))
    torch.testing.assert_close(every.effects[:, positions], one.effects, rtol=1e-4, atol=1e-6)
    assert scan(tiny_llama, clean, source, answers, site="resid", positions="all", per_pass=32).positions == \
        every.positions
    with pytest.raises(ValueError, match="^" + re.escape(f"resid scan positions must lie in [0, {clean.shape[1]})") + "$"):
        scan(tiny_llama, clean, source, answers, site="resid", positions=[0, clean.shape[1]])
    assert bool((one.effects[:, -1] != 0).all())  # the last position moves the answer at every layer


def test_receivers_refuse_a_bad_kind_or_no_heads():
    with pytest.raises(ValueError, match="^" + re.escape("receiver kind must be q, k or v, not 'z'") + "$"):
        Receivers((Head(1, 0),), "z", "last")
    with pytest.raises(ValueError, match="^no receiver heads: path patching to receivers needs at least one$"):
        Receivers((), "q", "last")


def test_activation_patch_of_heads_apart_in_one_layer_is_their_column_patches(tiny_llama, pairs):
    """Two heads of one layer that are not neighbours (one patch with the other columns restored by a mask)
    and the embedding: what separate column patches of each give."""
    from mechdiff.patching.activation import activation_patch, capture_sources
    from mechdiff.patching.core import EMB_LAYER, Patch, head_patch, run
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(pairs)
    clean, source = t["base"]["input_ids"], t["source"]["input_ids"]
    heads = [Head(1, 0), Head(1, 2), Head(2, 3)]
    at = t["base"]["positions"]["query_label"]
    got = activation_patch(tiny_llama, clean, source, [*heads, "EMB"], positions=at)
    captured = capture_sources(tiny_llama, source, [*heads, "EMB"])
    rows = torch.arange(len(at))
    d = tiny_llama.shape.d_head
    patches = [head_patch(tiny_llama, "z", h, captured[("z", h.layer)][rows, at, h.head * d:(h.head + 1) * d], at)
               for h in heads]
    patches.append(Patch("emb", EMB_LAYER, captured[("emb", EMB_LAYER)][rows, at], at))
    want = run(tiny_llama, clean, patches).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, run(tiny_llama, clean).logits, atol=1e-4)


def test_site_means_default_to_every_layers_z_quietly(tiny_llama, capsys):
    """Without ``kind`` the means are of ``z``, over every prompt of every batch, and no bar is shown."""
    from mechdiff.patching.ablation import site_means
    from mechdiff.patching.core import run

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 500, (2, 5), generator=g), torch.randint(0, 500, (3, 5), generator=g)]
    got = site_means(tiny_llama, batches)
    layers = range(tiny_llama.shape.n_layers)
    z = [torch.cat([run(tiny_llama, ids, capture=[("z", l)]).captured[("z", l)] for ids in batches]) for l in layers]
    torch.testing.assert_close(got, torch.stack([t.mean(0) for t in z]), rtol=1e-5, atol=1e-6)
    assert capsys.readouterr().err == ""


def _spy(module, monkeypatch) -> list[tuple[tuple, dict]]:
    """Record every ``run`` call ``module`` makes (arguments and keywords), still running it."""
    calls, original = [], module.run

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "run", recorded)
    return calls


def test_path_patching_runs_compute_only_what_a_sender_changes(tiny_llama, pairs, monkeypatch):
    """Cost, not values (the values are checked against full runs above and in test_path_patching.py): the
    frozen and receiver runs resume above the layers no sender or receiver sits in and read the clean keys and
    values before the first position they write; step A at the last token computes that one token."""
    import mechdiff.patching.path as path

    batch = prepare(tiny_llama, pairs)
    calls = _spy(path, monkeypatch)
    senders = [Head(1, 0), Head(1, 1)]
    spos = batch.positions["query_label"]
    path_patch(tiny_llama, batch, senders, "query_label", Receivers((Head(2, 1),), "v", "last"), progress=False)
    (_, frozen), (_, receiver) = calls
    assert frozen["resume"].layer == 1 and frozen["prefix"] is batch.clean_kv and frozen["start"] == int(spos.min())
    assert receiver["resume"].layer == 2 and receiver["prefix"] is batch.clean_kv
    calls.clear()
    path_patch(tiny_llama, batch, senders, "query_label", None, progress=False)
    ((_, frozen),) = calls
    assert frozen["resume"].layer == 1 and frozen["prefix"] is batch.clean_kv and frozen["start"] == int(spos.min())
    calls.clear()
    path_patch(tiny_llama, batch, senders, "last", None, progress=False)
    ((args, point),) = calls
    assert args[1].shape == (2 * len(batch), 1) and point["resume"].layer == 1


def test_scans_and_activation_patches_are_suffix_runs(tiny_llama, pairs, monkeypatch):
    """Cost, not values: head scans at one position, resid scans and activation patches with a prefix read
    the clean keys and values; head scans resume at each pass's first layer."""
    import mechdiff.patching.activation as activation
    import mechdiff.patching.scan as scan_module
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(pairs)
    clean, source, answers = t["base"]["input_ids"], t["source"]["input_ids"], t["target_ids"]
    calls = _spy(scan_module, monkeypatch)
    scan_module.scan(tiny_llama, clean, source, answers, site="z", positions="last", per_pass=4)
    patched = calls[2:]  # after the clean and the source runs
    assert len(patched) == 3 and all(k["prefix"] is not None for _, k in patched)
    assert [None if k["resume"] is None else k["resume"].layer for _, k in patched] == [None, 1, 2]
    calls.clear()
    scan_module.scan(tiny_llama, clean, source, answers, site="resid", positions=[3, 5], per_pass=4)
    assert all(k["prefix"] is not None for _, k in calls[2:]) and len(calls) == 2 + 3
    calls = _spy(activation, monkeypatch)
    kv = activation.run(tiny_llama, clean, keep_kv=True).kv
    calls.clear()
    activation.activation_patch(tiny_llama, clean, source, [Head(1, 2)], t["base"]["positions"]["query_label"],
                                prefix=kv)
    assert calls[-1][1]["prefix"] is kv


def test_empty_means_and_unpatchable_components_are_refused(tiny_llama):
    from mechdiff.patching.ablation import PositionMeans
    from mechdiff.patching.activation import capture_sources

    with pytest.raises(ValueError, match="^no activations to average; add at least one batch$"):
        PositionMeans().mean()
    with pytest.raises(ValueError, match="^" + re.escape(
            "cannot patch 'MLP1': activation patching supports heads (L<l>H<h>) and EMB") + "$"):
        capture_sources(tiny_llama, torch.zeros(1, 3, dtype=torch.long), ["MLP1"])


def test_attribution_is_the_first_order_path_patching_score(tiny_llama, pairs):
    """For a source a small step from clean, the exact path-patching score is linear in the step, so the
    attribution estimate equals it (scale included); scores cover exactly the senders asked for, or by
    default every head below the deepest receiver."""
    from mechdiff.patching.attribution import attribution_scores
    from mechdiff.patching.path import eligible_senders

    batch = prepare(tiny_llama, pairs)
    g = torch.Generator().manual_seed(2)
    batch.source_z = {l: z + 1e-3 * torch.randn(z.shape, generator=g) for l, z in batch.clean_z.items()}
    senders = [Head(0, 1), Head(1, 2), Head(2, 0)]
    exact = path_patch(tiny_llama, batch, senders, "last", None, progress=False)
    estimate = attribution_scores(tiny_llama, batch, "last", None, senders)
    assert list(estimate) == senders
    largest = max(abs(v) for v in exact.values())
    for s in senders:  # the second-order term: under 5% of the score (or 1% of the largest score near zero)
        assert estimate[s] == pytest.approx(exact[s], rel=0.05, abs=0.01 * largest)
    assert largest > 1e-7
    receivers = Receivers((Head(2, 1),), "q", "last")
    assert list(attribution_scores(tiny_llama, batch, "last", receivers)) == eligible_senders(tiny_llama, receivers)
