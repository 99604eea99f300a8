"""DCM and CMAP at a position class of several tokens: every token of the class is patched (against plain HF
forwards with torch hooks), nothing outside it, and a class of one token gives bit for bit what the one-token
path gives."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny
from tolerances import assert_close32, tol32

import mechdiff.methods.dcm_cache as dcm  # the pair cache and its runs
from mechdiff.common.components import Head
from mechdiff.methods.cmap import _base_scores
from mechdiff.methods.cmap_patches import cmap_patches, isolation_patches, scope_positions
from mechdiff.methods.dcm import DCMConfig, run_dcm
from mechdiff.methods.dcm_cache import PairCache, class_widths, class_z_patches, masked_z_patches
from mechdiff.patching.core import run
from mechdiff.tasks.entity_tracking import batch_tensors, generate, object_value_pairs, pair_batch_tensors

CLASS = "words_other"  # entity tracking's words of the boxes not asked about: six tokens spread over the prompt
HEADS = [Head(1, 0), Head(2, 3)]


@pytest.fixture(scope="module")
def pairs(smollm2_tokenizer):
    return object_value_pairs(smollm2_tokenizer, 24, n_boxes=3, seed=0)


def _one_length(pairs, n=6):
    length = len(pairs[0].base.input_ids)
    return [p for p in pairs if len(p.base.input_ids) == length][:n]


def _assert_apart(planted, want):
    """The planted error's logits lie at least ten float32 tolerances from the reference (the test tells them apart)."""
    scale = float(want.abs().max())
    assert float((planted - want).abs().max()) > 10 * tol32(scale)


def _attn(model, layer):
    return model.model.model.layers[layer].self_attn


def _o_proj_inputs(model, ids):
    """Every layer's o_proj input ``"batch pos (head d)"`` of a plain HF forward (torch pre-hooks)."""
    seen = {}
    handles = [
        _attn(model, l).o_proj.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(l, a[0].clone()))
        for l in range(model.shape.n_layers)
    ]
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return seen


def _hooked_logits(model, ids, hooks):
    """Logits at every position of a plain HF forward with ``hooks``: ``(module, pre, fn)``."""
    handles = [m.register_forward_pre_hook(f) if pre else m.register_forward_hook(f) for m, pre, f in hooks]
    try:
        with torch.no_grad():
            return model.model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


def _reference_z(model, batch, heads, last_only=False):
    """The base run with ``heads``' o_proj inputs at the j-th token of the class replaced by the source run's at
    its j-th token (``last_only``: the class's last token only, the planted error the test must tell apart)."""
    source = _o_proj_inputs(model, batch["source"]["input_ids"])
    base_cells = batch["base"]["position_classes"][CLASS]
    source_cells = batch["source"]["position_classes"][CLASS]
    d = model.shape.d_head
    hooks = []
    for layer in sorted({h.layer for h in heads}):

        def hook(module, args, layer=layer):
            z = args[0].clone()
            for row in range(z.shape[0]):
                to, frm = base_cells[row].nonzero()[:, 0], source_cells[row].nonzero()[:, 0]
                if last_only:
                    to, frm = to[-1:], frm[-1:]
                for h in heads:
                    if h.layer == layer:
                        cols = slice(h.head * d, (h.head + 1) * d)
                        z[row, to, cols] = source[layer][row, frm, cols]
            return (z,)

        hooks.append((_attn(model, layer).o_proj, True, hook))
    return _hooked_logits(model, batch["base"]["input_ids"], hooks)


def test_dcm_full_mask_patches_every_token_of_the_class(tiny_llama, pairs):
    """Mask 0 at a class of six tokens == the heads' outputs at all six replaced by the source's, at every
    position (those before the class unchanged); patching only the class's last token gives other logits."""
    model, chosen = tiny_llama, _one_length(pairs)
    batch = pair_batch_tensors(chosen)
    assert (batch["base"]["position_classes"][CLASS].sum(1) == 6).all()
    k = class_widths(chosen, [CLASS], 8)[CLASS]
    values = dcm.source_class_z(model, batch, [1, 2], CLASS, k)
    index, real = dcm.class_indices(batch["base"], CLASS)
    ids = batch["base"]["input_ids"]
    n = ids.shape[1]
    patches = class_z_patches(model, HEADS, torch.zeros(len(HEADS)), values, index, real, n)
    every = torch.arange(n)[None].expand(ids.shape[0], -1)
    got = run(model, ids, patches, readout=every).logits
    want = _reference_z(model, batch, HEADS)
    assert_close32(got, want)
    first = int(index[:, 0].min())
    assert torch.equal(got[:, :first], run(model, ids, readout=every).logits[:, :first])  # x * 1 + 0 * 0: exact
    planted = _reference_z(model, batch, HEADS, last_only=True)
    _assert_apart(planted[:, -1], want[:, -1])
    # the cache's suffix runs (resumed at the first patched layer, keys and values read before the class)
    cache = PairCache.build(model, chosen, [(HEADS, CLASS)], batch_size=4)
    logits, _ = cache.logits(model, range(len(chosen)), HEADS, torch.zeros(len(HEADS)), CLASS)
    cache.close()
    assert_close32(logits, want[:, -1])


def test_dcm_empty_class_patches_nothing(tiny_llama, pairs):
    """A prompt whose class is empty runs as the base (exactly), its neighbour in the batch is patched."""
    model, chosen = tiny_llama, _one_length(pairs, 2)
    batch = pair_batch_tensors(chosen)
    values = dcm.source_class_z(model, batch, [1, 2], CLASS, 6)
    index, real = dcm.class_indices(batch["base"], CLASS)
    real[1] = False  # the second prompt's class is empty
    ids = batch["base"]["input_ids"]
    patches = class_z_patches(model, HEADS, torch.zeros(len(HEADS)), values, index, real, ids.shape[1])
    got, plain = run(model, ids, patches).logits, run(model, ids).logits
    assert torch.equal(got[1], plain[1])
    assert not torch.allclose(got[0], plain[0])


def test_one_token_class_is_bit_for_bit_the_one_token_path(tiny_llama, pairs, monkeypatch):
    """The last token as a class of one token: the patches give the one-token path's logits and gradients bit
    for bit, and a whole DCM run (training, test, random baseline) its result."""
    model, chosen = tiny_llama, _one_length(pairs)
    batch = pair_batch_tensors(chosen)
    ids, n = batch["base"]["input_ids"], batch["base"]["input_ids"].shape[1]
    assert torch.equal(batch["base"]["position_classes"]["last"].nonzero()[:, 1], batch["base"]["positions"]["last"])
    one = dcm.source_z(model, batch, [1, 2], "last")
    many = dcm.source_class_z(model, batch, [1, 2], "last", 1)
    assert all(torch.equal(one[l], many[l][:, 0]) for l in (1, 2))
    index, real = dcm.class_indices(batch["base"], "last")
    grads = []
    for patches_of in (
        lambda m: masked_z_patches(model, HEADS, m, one, batch["base"]["positions"]["last"]),
        lambda m: class_z_patches(model, HEADS, m, many, index, real, n),
    ):
        mask = torch.tensor([0.3, 0.8], requires_grad=True)
        logits = run(model, ids, patches_of(mask), grad=True).logits
        logits.sum().backward()
        grads.append((logits.detach(), mask.grad))
    assert torch.equal(grads[0][0], grads[1][0])  # the same products and sums at the token, x * 1 + 0 * 0 elsewhere
    assert_close32(grads[0][1], grads[1][1])  # the mask's gradient sums the batch in another order
    config = DCMConfig(epochs=1, batch_size=4, micro_batch=4, eval_batch=8, n_random=2)
    plain = run_dcm(model, HEADS, "last", pairs, config, progress=False).to_dict()
    monkeypatch.setattr(dcm, "is_one_token", lambda batch, name: False)  # "last" through the class path
    classed = run_dcm(model, HEADS, "last", pairs, config, progress=False)
    assert json.dumps(classed.to_dict(), sort_keys=True) == json.dumps(plain, sort_keys=True)  # NaN == NaN


def test_class_of_other_sizes_in_base_and_source_is_refused(pairs):
    with pytest.raises(ValueError, match="tokens in the base prompt"):
        class_widths(pairs, ["query_segment_after"], 8)  # 2 tokens in a base, 1 in its source (object_value)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return batch_tensors(generate(smollm2_tokenizer, 6, n_boxes=3, seed=0))


def _reference_cmap(base, donor_ids_out, batch, kind, head):
    """The base's run with ``head``'s ``kind`` (its o_proj input for z, its q_proj output for q, its KV group's
    k_proj output up to the class's last token for k) replaced by the donor's (``donor_ids_out``: module ->
    the donor's tensor), via torch hooks."""
    cells = batch["position_classes"][CLASS]
    d = base.shape.d_head
    if kind == "k":
        last = torch.stack([row.nonzero()[-1, 0] for row in cells])
        cells = torch.arange(cells.shape[1])[None] <= last[:, None]
        cols = base.arch.columns("k", head.head, base.shape)
    else:
        cols = slice(head.head * d, (head.head + 1) * d)
    module = {"z": "o_proj", "q": "q_proj", "k": "k_proj"}[kind]
    donor = donor_ids_out[kind]

    def replace(t):
        t = t.clone()
        t[..., cols] = torch.where(cells[..., None], donor[..., cols], t[..., cols])
        return t

    mod = getattr(_attn(base, head.layer), module)
    hook = (mod, True, lambda m, a: (replace(a[0]),)) if kind == "z" else (mod, False, lambda m, a, out: replace(out))
    return _hooked_logits(base, batch["input_ids"], [hook])[:, -1]


@pytest.mark.parametrize("kind", ["z", "q", "k"])
def test_cmap_patches_every_token_of_the_class(tiny_llama, smollm2_tokenizer, prompts, kind):
    """CMAP of a class of six tokens (z and q at each of them, k up to the last) == hooked HF forwards of the base
    with the fine-tune's activations written there; the class's last token alone gives other logits."""
    base, donor = tiny_llama, make_tiny("llama", smollm2_tokenizer, seed=1)
    head = Head(1, 2)
    scope = [(head, CLASS)]
    ids = prompts["input_ids"]
    n = ids.shape[1]
    out = run(donor, ids, capture=[(c, 1) for c in ("q", "k", "v", "z")])
    captured = {key: t for key, t in out.captured.items()}
    where = scope_positions(prompts, [CLASS])
    assert where[CLASS].dtype == torch.bool and (where[CLASS].sum(1) == 6).all()
    got = run(base, ids, cmap_patches(base, scope, kind, captured, where, n)).logits
    module = {"z": "o_proj", "q": "q_proj", "k": "k_proj"}[kind]
    seen = {}
    mod = getattr(_attn(donor, 1), module)
    handle = (
        mod.register_forward_pre_hook(lambda m, a: seen.__setitem__(kind, a[0].clone()))
        if kind == "z"
        else mod.register_forward_hook(lambda m, a, o: seen.__setitem__(kind, o.clone()))
    )
    with torch.no_grad():
        donor.model(input_ids=ids, use_cache=False)
    handle.remove()
    want = _reference_cmap(base, seen, prompts, kind, head)
    assert_close32(got, want)
    last_only = dict(prompts, position_classes={CLASS: torch.zeros_like(where[CLASS])})
    last_only["position_classes"][CLASS][torch.arange(len(ids)), where[CLASS].int().cumsum(1).argmax(1)] = True
    planted = _reference_cmap(base, seen, last_only, kind, head)
    if kind != "k":  # k up to the last token is the same set either way
        _assert_apart(planted, want)
    # through the stage's runs (resumed at the scope's layer, suffix from the class's first token)
    scored = _base_scores(base, ids, prompts["answer_ids"], captured, {"g": scope}, [kind], where, isolate=False)
    prob = torch.softmax(want.double(), -1)[torch.arange(len(ids)), prompts["answer_ids"]]
    assert_close32(torch.as_tensor(scored[("g", kind)][1]), prob)


def test_isolation_frees_every_token_of_the_class(tiny_llama, prompts):
    """Isolated Q/K/V kinds restore every head's output to the base's except at the class's tokens and the
    read-out (and, in the patched K/V layer, the scope head's own class tokens only)."""
    model, head = tiny_llama, Head(1, 2)
    n = prompts["input_ids"].shape[1]
    where = scope_positions(prompts, [CLASS])
    base_z = {l: torch.zeros(len(prompts["input_ids"]), n, 32) for l in range(3)}
    cells = prompts["position_classes"][CLASS].clone()
    free = cells.clone()
    free[:, -1] = True
    d = model.shape.d_head
    for kind in ("q", "k"):
        patches = isolation_patches(model, [(head, CLASS)], kind, base_z, where, n)
        assert [p.layer for p in patches] == [1, 2]
        for p in patches:
            for h in range(4):
                kept = p.mask[:, :, h * d].bool()
                if kind == "k" and p.layer == 1 and h // model.shape.group_size == head.head // 2:
                    assert torch.equal(kept, cells if h == head.head else torch.zeros_like(cells))
                else:
                    assert torch.equal(kept, free)


def test_run_cmap_runs_a_class_group(tiny_llama, smollm2_tokenizer):
    """A circuit group at a class runs in every kind, isolation included."""
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.methods.cmap import run_cmap

    donor = make_tiny("llama", smollm2_tokenizer, seed=1)
    records = generate(smollm2_tokenizer, 12, n_boxes=3, seed=0)
    circuit = Circuit("tiny", "entity_tracking", {"g": [Head(1, 2), Head(2, 0)]}, {"g": CLASS})
    res = run_cmap(tiny_llama, donor, circuit, records, ["z", "qkv"], 6, progress=False)
    assert {(r.scope, r.kind) for r in res.rows} == {(s, k) for s in ("g", "circuit") for k in ("z", "qkv")}


def test_group_choice_keeps_class_groups_and_says_why_it_leaves_one_out(smollm2_tokenizer, pairs):
    """DCM and CMAP take a group at a class of several tokens; a group is left out only at a position the prompts
    lack, or (DCM) at a class whose size differs between a pair's two prompts, each with why."""
    from types import SimpleNamespace

    from mechdiff.circuits.circuit import Circuit
    from mechdiff.studies.circuits.stages.dcm import unpaired_classes
    from mechdiff.studies.circuits.stages.groups import group_choice

    records = generate(smollm2_tokenizer, 8, n_boxes=3, seed=0)
    positions = {"a": "last", "b": CLASS, "c": "query_segment_after", "d": "nowhere"}
    circuit = Circuit("tiny", "entity_tracking", {g: [Head(1, 0)] for g in positions}, positions)
    task = SimpleNamespace(positions=["last"])
    groups, left_out = group_choice(task, records, circuit, [])
    assert groups == ["a", "b", "c"] and list(left_out) == ["d"] and "`nowhere`" in left_out["d"]
    assert group_choice(task, records, circuit, [], check=False) == (["a", "b", "c", "d"], {})
    unpaired = unpaired_classes(circuit, groups, {"object_value": pairs}, 8)
    assert list(unpaired) == ["c"] and "tokens in the base prompt" in unpaired["c"]
