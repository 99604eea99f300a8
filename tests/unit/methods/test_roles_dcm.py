"""Roles by DCM over seeds (:func:`~mechdiff.methods.roles.dcm_seeds`) on a tiny llama with a planted head: where
the head carries the targets the group holds the role (the paired tests against the floor and against layer-matched
random heads reject after Holm), where its output is gone the group does not; each seed's selection against DCM run
on its own, the frequencies against a direct count; one sparsity weight at every checkpoint (the loss scaling
gives two); and the report's decision on constructed outcomes that beat the floor but not the random heads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import make_tiny
from scipy import stats

import mechdiff.methods.dcm as dcm
from mechdiff.common import inference as inf
from mechdiff.common.components import Head
from mechdiff.common.outcomes import bits, from_bits
from mechdiff.methods.dcm import DCMConfig, loss_scale, pair_items, run_dcm, split_indices, train_mask
from mechdiff.methods.dcm_cache import PairCache, masked_z_patches, source_z
from mechdiff.methods.roles import dcm_seeds, frequency, redraw, transitions
from mechdiff.patching.core import run
from mechdiff.studies.trajectory.roles import (
    role_sentences,
    roles_family,
    seeded_roles,
    seeded_rows,
    seeded_step_rows,
    transition_rows,
)
from mechdiff.studies.trajectory.settings import RolesSection, roles_dcm_config
from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors
from unit.methods.planted import planted_pairs

PLANTED = Head(2, 1)
CANDIDATES = [Head(2, h) for h in range(4)] + [Head(1, 0), Head(1, 2)]
#: [dcm]'s training as a study gives it (the loss scaling included); the roles stage fixes the weight.
DCM = DCMConfig(epochs=3, batch_size=8, eval_every=3, n_random=4, seed=0)
ROLES = RolesSection(method="dcm", lam=0.01, seeds=3, votes=2, n_random=6)


def planted_model(tokenizer, gone: bool = False):
    """A tiny llama whose head ``PLANTED`` dominates the last layer (``gone``: its output zeroed instead)."""
    model = make_tiny("llama", tokenizer, seed=3)
    o_proj = model.arch.module(model.model, "z", PLANTED.layer)
    d = model.shape.d_head
    with torch.no_grad():
        o_proj.weight[:, PLANTED.head * d : (PLANTED.head + 1) * d] *= 0.0 if gone else 40.0
    return model


@pytest.fixture(scope="module")
def case(smollm2_tokenizer):
    """The planted model (step 1: the head carries the role), the same model with the head's output gone (step 0:
    nobody carries it), the planted pairs, and each model's roles stage rows."""
    held = planted_model(smollm2_tokenizer)
    pairs = planted_pairs(held, object_value_pairs(smollm2_tokenizer, 120, n_boxes=3, seed=0))
    gone = planted_model(smollm2_tokenizer, gone=True)
    config = roles_dcm_config(DCM, ROLES)
    sites = [("last", "last", CANDIDATES)]
    rows = {
        m: dcm_seeds(lm, sites, {"planted": pairs}, config, ROLES.seeds, ROLES.votes)
        for m, lm in (("gone", gone), ("held", held))
    }
    return held, gone, pairs, rows


def top1(model, pairs, heads) -> np.ndarray:
    """Per pair, whether the run with ``heads``' z at ``last`` from the source (none: unpatched) gives the target:
    plain patched runs, not the pair cache."""
    batch = pair_batch_tensors(pairs)
    patches = []
    if heads:
        values = source_z(model, batch, sorted({h.layer for h in heads}), "last")
        patches = masked_z_patches(model, heads, torch.zeros(len(heads)), values, batch["base"]["positions"]["last"])
    with torch.no_grad():
        got = run(model, batch["base"]["input_ids"], patches).logits.argmax(-1)
    return (got == batch["target_ids"]).numpy().astype(float)


def test_the_planted_role_is_held_where_the_head_carries_it_and_not_where_its_output_is_gone(case):
    """Step 1 (planted): the selection holds the planted head, its test outcomes and the floor's are those of plain
    patched runs, the test against the floor is the exact binomial test on the discordant pairs, and both tests
    reject after Holm: the group holds the role. Step 0 (head gone): it does not. Between them the planted head
    joins (nothing held before it: it takes nothing over)."""
    held, _, pairs, rows = case
    (x,) = rows["held"]
    assert len(pairs) >= 40 and PLANTED.name in x["selected"]
    test = split_indices(len(pairs), DCM.split, DCM.seed, pair_items(pairs))[2]
    mine = [pairs[i] for i in test]
    selected = [h for h in CANDIDATES if h.name in x["selected"]]
    assert from_bits(x["test_outcomes"]).tolist() == top1(held, mine, selected).tolist()
    assert from_bits(x["floor_outcomes"]).tolist() == top1(held, mine, []).tolist() == [0.0] * len(mine)
    assert all(len(hs) == len(selected) for hs in x["random_heads"]) and len(x["random_heads"]) == ROLES.n_random
    assert all(
        sorted(h[1:].split("H")[0] for h in hs) == sorted(h.name[1:].split("H")[0] for h in selected)
        for hs in x["random_heads"]
    )  # layer-matched: the selection's layers
    steps = [0, 1]
    flat = seeded_rows([{"rows": rows["gone"]}, {"rows": rows["held"]}], steps)
    tests = roles_family(flat)
    a, b = from_bits(x["test_outcomes"]), from_bits(x["floor_outcomes"])
    n10, n01 = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    assert tests[("last", "planted", 1, "floor")].p == pytest.approx(stats.binomtest(n10, n10 + n01).pvalue)
    assert all(t.family == "roles" for t in tests.values())
    assert [t.p_adjusted for t in tests.values()] == pytest.approx(list(inf.holm([t.p for t in tests.values()])))
    per_step = seeded_step_rows(flat, tests)
    assert [r["holds"] for r in per_step] == [False, True]
    (role,) = seeded_roles(flat, steps, tests)
    moves = transition_rows([role], steps, 0.5)
    assert {"step": 1, "head": PLANTED.name, "event": "joins", "others": "-"} in [
        {k: m[k] for k in ("step", "head", "event", "others")} for m in moves
    ]
    assert all(m["event"] == "joins" for m in moves)


def test_each_seed_is_dcm_trained_on_its_draw_and_the_frequency_is_the_count(case):
    """Seed 0 is DCM run on its own (the same split and training), each other seed a mask trained on the training
    and validation pairs redrawn by its seed; the frequency of each head is the count of those selections holding
    it and the selection the heads at least ``votes`` of them hold."""
    held, _, pairs, rows = case
    (x,) = rows["held"]
    config = roles_dcm_config(DCM, ROLES)
    alone = run_dcm(held, CANDIDATES, "last", pairs, config, progress=False)
    selections = [[h.name for h in alone.selected]]
    train, val, _ = split_indices(len(pairs), config.split, config.seed, pair_items(pairs))
    cache = PairCache.build(held, pairs, [(CANDIDATES, "last")], config.eval_batch)
    for k in range(1, ROLES.seeds):
        tr, va = redraw(train + val, len(train), config.seed + k, pair_items(pairs))
        mask, _, _ = train_mask(held, CANDIDATES, "last", cache, tr, va, dataclasses.replace(config, seed=k), False)
        selections.append([h.name for h, m in zip(CANDIDATES, mask.tolist()) if m < 0.5])
    cache.close()
    assert [s["selected"] for s in x["seeds"]] == selections
    direct = {h.name: sum(h.name in s for s in selections) for h in CANDIDATES}
    assert x["frequency"] == [direct[h.name] for h in CANDIDATES] == frequency(selections, x["heads"])
    assert x["selected"] == [h.name for h in CANDIDATES if direct[h.name] >= ROLES.votes]


def test_redraw_keeps_items_whole_and_is_seeded():
    items = [i // 2 for i in range(20)]  # two rows an item
    rows = list(range(4, 20))
    train, val = redraw(rows, 9, 1, items)
    assert sorted(train + val) == rows and not {items[r] for r in train} & {items[r] for r in val}
    assert len(train) == 10 and val  # whole items: 9 rows take 5 items
    assert redraw(rows, 9, 1, items) == (train, val) and redraw(rows, 9, 2, items) != (train, val)
    with pytest.raises(ValueError, match="at least 2 items"):
        redraw([0, 1], 1, 0, items)


def test_the_sparsity_weight_is_the_same_at_every_checkpoint(case, monkeypatch):
    """Every optimiser step of every seed in both checkpoints weighs the sparsity term by ``[roles] lam``; [dcm]'s
    loss scaling would weigh it by each checkpoint's own logits (two different numbers here), and is refused."""
    held, gone, pairs, _ = case
    weights: dict[str, list[float]] = {"held": [], "gone": []}
    real = dcm._step

    def spy(model, heads, position, cache, rows, mask, optimiser, config, scale=1.0):
        weights[now[0]].append(config.lam * scale)
        return real(model, heads, position, cache, rows, mask, optimiser, config, scale)

    monkeypatch.setattr(dcm, "_step", spy)
    config = roles_dcm_config(DCM, ROLES)
    now = [""]
    for now[0], lm in (("held", held), ("gone", gone)):
        dcm_seeds(lm, [("last", "last", CANDIDATES[:2])], {"planted": pairs[:24]}, config, 2, 1)
    assert weights["held"] and set(weights["held"]) == set(weights["gone"]) == {ROLES.lam}
    train = split_indices(len(pairs), DCM.split, DCM.seed, pair_items(pairs))[0]
    scaled = []
    for lm in (held, gone):
        cache = PairCache.build(lm, pairs, [(CANDIDATES, "last")], DCM.eval_batch)
        scaled.append(DCM.lam * loss_scale(lm, CANDIDATES, "last", cache, train, DCM))
        cache.close()
    assert abs(scaled[0] - scaled[1]) > 1e-3 * max(scaled)
    with pytest.raises(ValueError, match="lam_scale='absolute'"):
        dcm_seeds(held, [("last", "last", CANDIDATES)], {"planted": pairs}, DCM, 3, 2)


def _row(step: int, test: list[int], floor: list[int], draws: list[list[int]]) -> dict:
    return {
        "group": "last",
        "desideratum": "positional",
        "position": "last",
        "heads": ["L2H1", "L2H3"],
        "seeds": [{}, {}, {}],
        "frequency": [3, 1],
        "votes": 2,
        "selected": ["L2H1"],
        "test_accuracy": {"value": float(np.mean(test)), "low": 0.0, "high": 1.0},
        "floor": {"value": float(np.mean(floor)), "low": 0.0, "high": 1.0},
        "test_outcomes": bits(test),
        "floor_outcomes": bits(floor),
        "random_outcomes": [bits(d) for d in draws],
    }


def test_a_selection_above_the_floor_but_not_above_its_random_heads_holds_no_role():
    """Constructed outcomes on 12 test pairs: at step 0 the selection gives the target on every pair, the floor on
    none and the random heads on none (both tests reject: held); at step 5 the random heads give it as often as the
    selection (the floor test alone rejects: not held); at step 10 the selection beats both on 6 pairs only (p =
    2/64 each, below 0.05 alone but not after Holm over the family's six tests: not held)."""
    n = 12
    rows = [
        {"rows": [_row(0, [1] * n, [0] * n, [[0] * n] * 4)]},
        {"rows": [_row(5, [1] * n, [0] * n, [[1] * n] * 4)]},
        {"rows": [_row(10, [1] * 6 + [0] * 6, [0] * n, [[0] * n] * 4)]},
    ]
    flat = seeded_rows(rows, [0, 5, 10])
    tests = roles_family(flat)
    assert tests[("last", "positional", 10, "floor")].p == pytest.approx(2 / 2**6)
    assert tests[("last", "positional", 10, "floor")].p_adjusted > 0.05
    assert [r["holds"] for r in seeded_step_rows(flat, tests)] == [True, False, False]
    (role,) = seeded_roles(flat, [0, 5, 10], tests)
    assert role.low[:, 0].tolist() == [1.0, 0.0] and not role.low[:, 1:].any()
    assert role.value[:, 0].tolist() == [1.0, pytest.approx(1 / 3)]


def test_the_sentences_name_each_join_leave_and_takeover():
    """A role not shown at step 5, held by L1H0 and L2H3 from 15, where at 45 L4H2 replaces L1H0: the sentence says
    where it is held and not, that the two join at 15 (nothing held before them: no takeover), and that L4H2 takes
    over from L1H0 at 45 while L1H0 leaves; a role held by nobody gets its own sentence."""
    steps = [5, 15, 45]
    membership = np.array([[0, 1, 0], [0, 1, 1], [0, 0, 1]], dtype=bool)
    moves = [
        {"group": "last", "desideratum": "positional", **{**m, "others": " ".join(m["others"]) or "-"}}
        for m in transitions(membership, ["L1H0", "L2H3", "L4H2"], steps)
    ]
    per_step = [{"group": "last", "desideratum": "positional", "step": s, "holds": s > 5} for s in steps]
    per_step += [{"group": "last", "desideratum": "label_value", "step": s, "holds": False} for s in steps]
    assert role_sentences(steps, per_step, moves) == [
        "- **last / positional**: held at steps 15, 45; not shown at 5: at step 15 L1H0, L2H3 join; at step 45 "
        "L4H2 takes over from L1H0; L1H0 leaves.",
        "- **last / label_value**: held at no step scored. No head joins or leaves.",
    ]
