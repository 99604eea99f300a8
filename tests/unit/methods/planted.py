"""The planted-head case DCM's tests share (``test_dcm``, ``test_dcm_modes``, ``test_dcm_controls``): a tiny llama
whose head ``PLANTED`` dominates the last layer, and pairs whose target is what the model says when exactly that
head's z at ``last`` comes from the source."""

from __future__ import annotations

import dataclasses

import torch
from conftest import make_tiny

from mechdiff.common.components import Head
from mechdiff.methods.dcm_cache import masked_z_patches, source_z
from mechdiff.patching.core import run
from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors

PLANTED = Head(2, 1)
CANDIDATES = [Head(2, h) for h in range(4)] + [Head(1, 0), Head(1, 2)]  # the planted head's layer and two others


def planted_case(tokenizer, pairs):
    """(model, pairs): the tiny llama with ``PLANTED`` scaled up, and those of ``pairs`` whose answer changes when
    exactly that head's z at ``last`` comes from the source, that answer their target (kind ``planted``)."""
    model = make_tiny("llama", tokenizer, seed=3)
    o_proj = model.arch.module(model.model, "z", PLANTED.layer)
    d = model.shape.d_head
    with torch.no_grad():
        o_proj.weight[:, PLANTED.head * d : (PLANTED.head + 1) * d] *= 40
    return model, planted_pairs(model, pairs, kind="planted")


def planted_pairs(model, pairs, kind=None):
    """Those of ``pairs`` whose answer from ``model`` changes when exactly ``PLANTED``'s z at ``last`` comes from the
    source (a plain patched run, not the pair cache), that answer their target (and ``kind``, where given)."""
    out = []
    for chunk in range(0, len(pairs), 16):
        part = pairs[chunk : chunk + 16]
        batch = pair_batch_tensors(part)
        values = source_z(model, batch, [PLANTED.layer], "last")
        patches = masked_z_patches(model, [PLANTED], torch.zeros(1), values, batch["base"]["positions"]["last"])
        with torch.no_grad():
            new = run(model, batch["base"]["input_ids"], patches).logits.argmax(-1)
            old = run(model, batch["base"]["input_ids"]).logits.argmax(-1)
        extra = {} if kind is None else {"kind": kind}
        out += [
            dataclasses.replace(p, target_id=int(t), **extra)
            for p, t, o in zip(part, new.tolist(), old.tolist())
            if t != o
        ]
    return out


def mixed_pairs(tokenizer) -> list:
    """Pairs of two token lengths: 48 of 3 boxes and 32 of 4."""
    return object_value_pairs(tokenizer, 48, n_boxes=3, seed=0) + object_value_pairs(tokenizer, 32, n_boxes=4, seed=1)
