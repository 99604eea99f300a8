"""Roles over the steps: joins, leaves and takeovers on synthetic tables whose events are known; each head's score
on two checkpoints of a tiny trajectory against a plain forward pass with that head's output replaced (torch
hooks, not the patching engine). Roles by DCM over seeds: tests/unit/methods/test_roles_dcm.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from mechdiff.common.components import parse_heads
from mechdiff.common.outcomes import from_bits
from mechdiff.methods.checkpoints import Checkpoints
from mechdiff.methods.roles import THRESHOLD, head_scores, held, transitions
from mechdiff.models.loading import load_model
from mechdiff.tasks.desiderata import desideratum_pairs

STEPS = [0, 5, 10, 15, 20]
HEADS = ["L1H0", "L2H3", "L3H1", "L4H2", "L5H5"]
#: Known by construction: L3H1 holds the role throughout; L1H0 holds it early and loses it; L2H3 takes it over at
#: step 10; L4H2 flickers (step 5), then holds it from step 15; L5H5 never holds it.
MEMBERSHIP = np.array(
    [
        [1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [0, 1, 0, 1, 1],
        [0, 0, 0, 0, 0],
    ],
    dtype=bool,
)


def test_transitions_on_a_table_whose_events_are_known():
    """Joins, leaves and takeovers read off :data:`MEMBERSHIP` by hand: at step 5 L4H2 joins with no head leaving (it
    takes nothing over); at 10 L2H3 joins while L1H0 and L4H2 leave, so it takes over from both; at 15 L4H2 joins
    again while the others stay; at 20 nothing happens."""
    got = transitions(MEMBERSHIP, HEADS, STEPS)
    assert got == [
        {"step": 5, "head": "L4H2", "event": "joins", "others": []},
        {"step": 10, "head": "L2H3", "event": "takes over", "others": ["L1H0", "L4H2"]},
        {"step": 10, "head": "L1H0", "event": "leaves", "others": ["L2H3"]},
        {"step": 10, "head": "L4H2", "event": "leaves", "others": ["L2H3"]},
        {"step": 15, "head": "L4H2", "event": "joins", "others": []},
    ]


def test_a_head_that_joins_with_nothing_held_before_it_takes_nothing_over():
    """A role no head holds until step 10 (L2H3 joins: not a takeover); a role A holds at 0, nobody at 5 and B at 10:
    A leaves at 5 with no head taking over, and B, joining at 10 with nothing held at 5, takes nothing over though A
    held the role earlier; a role B holds while A joins and nobody leaves: A joins."""
    heads = ["L1H0", "L2H3"]
    empty_then_one = np.array([[0, 0, 0], [0, 0, 1]], dtype=bool)
    assert transitions(empty_then_one, heads, [0, 5, 10]) == [
        {"step": 10, "head": "L2H3", "event": "joins", "others": []}
    ]
    lapse = np.array([[1, 0, 0], [0, 0, 1]], dtype=bool)
    assert transitions(lapse, heads, [0, 5, 10]) == [
        {"step": 5, "head": "L1H0", "event": "leaves", "others": []},
        {"step": 10, "head": "L2H3", "event": "joins", "others": []},
    ]
    beside = np.array([[0, 1, 1], [1, 1, 1]], dtype=bool)
    assert transitions(beside, heads, [0, 5, 10]) == [{"step": 5, "head": "L1H0", "event": "joins", "others": []}]
    swap = np.array([[1, 0], [0, 1]], dtype=bool)  # the same step: one leaves, the other joins
    assert [r["event"] for r in transitions(swap, heads, [0, 5])] == ["takes over", "leaves"]


def test_a_head_holds_a_role_where_its_lower_bound_exceeds_the_threshold():
    low = np.array([[0.05, THRESHOLD, 0.11, np.nan], [0.5, 0.0, 0.3, 0.2]])
    assert held(low).tolist() == [[False, False, True, False], [True, False, True, True]]
    assert held(low, threshold=0.25).tolist() == [[False, False, False, False], [True, False, True, False]]
    # a membership table built from bounds: the known events come back
    bounds = np.where(MEMBERSHIP, 0.4, 0.02)
    assert transitions(held(bounds), HEADS, STEPS) == transitions(MEMBERSHIP, HEADS, STEPS)


def test_transitions_refuse_a_table_of_the_wrong_shape():
    with pytest.raises(ValueError, match="heads x steps"):
        transitions(MEMBERSHIP[:, :3], HEADS, STEPS)
    with pytest.raises(ValueError, match="'head step'"):
        held(np.zeros(3))


def patched_top1(hf, pairs, layer: int, head: int, position: str) -> list[int]:
    """Per pair, the top-1 token of ``hf``'s base run with head ``layer.head``'s output (o_proj input) at
    ``position`` taken from its source run (``layer`` None: unpatched): one plain forward pass each, torch hooks."""
    cfg = hf.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    o_proj = hf.model.layers[layer or 0].self_attn.o_proj
    cols = slice(head * d, (head + 1) * d)
    out = []
    for p in pairs:
        grabbed = {}
        src_pos, base_pos = p.source.positions[position], p.base.positions[position]

        def grab(mod, args):
            grabbed["z"] = args[0][0, src_pos, cols].clone()

        def put(mod, args):
            z = args[0].clone()
            z[0, base_pos, cols] = grabbed["z"]
            return (z,)

        with torch.no_grad():
            if layer is not None:
                hook = o_proj.register_forward_pre_hook(grab)
                hf(torch.tensor([p.source.input_ids]))
                hook.remove()
            hook = o_proj.register_forward_pre_hook(put) if layer is not None else None
            out.append(int(hf(torch.tensor([p.base.input_ids])).logits[0, -1].argmax()))
            if hook is not None:
                hook.remove()
    return out


def test_each_heads_score_is_a_plain_forward_with_its_output_replaced(tiny_run):
    """Two checkpoints served by swapped adapters. A random model seldom gives a desideratum's target, so each
    head is scored on pairs whose even ones have as target the top-1 token of the checkpoint loaded by itself with
    that head's output at its group's position replaced by the source run's (a plain forward pass): those must
    all count, the odd ones exactly where that top-1 is their own target; the share's interval is the exact
    binomial one; and the patch moves the top-1 of some pair (else the check could not tell a patch from none)."""
    _, run = tiny_run
    names = [f"{run}@0", f"{run}@4"]
    cp = Checkpoints(names)
    tokenizer = cp.first().tokenizer  # the run's own (whatever vocabulary its tiny base was given)
    drawn = {
        "positional": desideratum_pairs("positional", tokenizer, 10, n_boxes=3, seed=4),
        "object_value": desideratum_pairs("object_value", tokenizer, 10, n_boxes=3, seed=5),
    }
    sites = [("last", "last", ["L2H1", "L0H2"]), ("query_label", "query_label", ["L1H3"])]
    moved = 0
    for name in names:
        hf = load_model(name).model
        for d, pairs in drawn.items():
            unpatched = patched_top1(hf, pairs, None, 0, "last")
            for group, position, heads in sites:
                for h in parse_heads(heads):
                    top = patched_top1(hf, pairs, h.layer, h.head, position)
                    moved += sum(t != u for t, u in zip(top, unpatched))
                    mine = [replace(p, target_id=t) if i % 2 == 0 else p for i, (p, t) in enumerate(zip(pairs, top))]
                    got = head_scores(cp.model(name), [(group, position, [h])], {d: mine}, batch_size=4)
                    (row,) = got["rows"]
                    assert (row["group"], row["position"], row["desideratum"], row["head"]) == (
                        group,
                        position,
                        d,
                        h.name,
                    )
                    want = [float(t == p.target_id) for p, t in zip(mine, top)]
                    assert from_bits(row["outcomes"]["correct"]).tolist() == want, (name, d, h.name)
                    ci = stats.binomtest(int(sum(want)), len(want)).proportion_ci(method="exact")
                    assert row["share"]["value"] == np.mean(want)
                    assert (row["share"]["low"], row["share"]["high"]) == pytest.approx((ci.low, ci.high))
                    floor = [float(u == p.target_id) for p, u in zip(mine, unpatched)]
                    assert from_bits(got["floor"][d]["outcomes"]["correct"]).tolist() == floor
    assert moved > 0
