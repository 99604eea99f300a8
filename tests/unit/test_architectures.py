"""Architecture adapters on tiny random models of each family."""

from __future__ import annotations

import pytest
import torch

from mechdiff.common.components import Head, kv_group, parse
from mechdiff.patching.core import Patch, head_patch, run


def _ids(n=2, length=9):
    return torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0))


def test_component_names():
    assert parse("L14H7") == Head(14, 7) and Head(14, 7).name == "L14H7"
    assert parse([3, 2]) == Head(3, 2)
    assert str(parse("MLP17")) == "MLP17" and parse("EMB") == "EMB"
    assert kv_group(8, 9, 3) == 2 and Head(0, 5).kv_group(9, 3) == 1
    with pytest.raises(ValueError, match="L<layer>H<head>"):
        parse("head 3")


def test_plain_run_matches_model(tiny_model):
    ids = _ids()
    with torch.no_grad():
        expected = tiny_model.model(ids).logits[:, -1]
    assert torch.allclose(run(tiny_model, ids).logits, expected, atol=1e-6)


@pytest.mark.parametrize("kind", ["z", "q", "k", "v"])
def test_writing_a_slice_back_is_bit_identical(tiny_model, kind):
    ids = _ids()
    clean = run(tiny_model, ids, capture=[(kind, 1)])
    cols = tiny_model.arch.columns(kind, 2, tiny_model.shape)
    same = Patch(kind, 1, clean.captured[(kind, 1)][:, :, cols].clone(), None, cols)
    assert torch.equal(run(tiny_model, ids, [same]).logits, clean.logits)


def test_zeroing_one_head_changes_only_it(tiny_model):
    ids = _ids()
    shape = tiny_model.shape
    sites = [(k, l) for l in range(shape.n_layers) for k in ("q", "z")]
    clean = run(tiny_model, ids, capture=sites)
    zeroed = run(tiny_model, ids, [head_patch(tiny_model, "z", Head(1, 2), torch.zeros(2, 9, shape.d_head))],
                 capture=sites)
    cols = tiny_model.arch.columns("z", 2, shape)
    z1 = zeroed.captured[("z", 1)]
    assert torch.equal(z1[:, :, cols], torch.zeros_like(z1[:, :, cols]))
    other = torch.ones(z1.shape[-1], dtype=torch.bool)
    other[cols] = False
    assert torch.equal(z1[:, :, other], clean.captured[("z", 1)][:, :, other])  # same layer: untouched
    assert torch.equal(zeroed.captured[("z", 0)], clean.captured[("z", 0)])  # earlier layer: untouched
    assert torch.equal(zeroed.captured[("q", 1)], clean.captured[("q", 1)])  # own layer's Q: before z
    assert not torch.allclose(zeroed.captured[("q", 2)], clean.captured[("q", 2)])  # later layers: changed
    assert not torch.allclose(zeroed.logits, clean.logits)


def test_kv_columns_follow_groups(tiny_model):
    shape, arch = tiny_model.shape, tiny_model.arch
    groups = {arch.columns("k", h, shape).start for h in range(shape.n_heads)}
    assert len(groups) == shape.n_kv_heads
    qs = [arch.columns("q", h, shape) for h in range(shape.n_heads)]
    assert len({s.start for s in qs}) == shape.n_heads


def test_q_slice_is_the_head_query(tiny_model):
    """The q columns of head h are what the model multiplies with head h's keys: zeroing
    them makes head h attend uniformly (checked on the attention pattern)."""
    ids = _ids()
    shape = tiny_model.shape
    z = torch.zeros(2, 9, shape.d_head)
    with torch.no_grad(), tiny_model.nn.trace(input_ids=ids):
        tiny_model.arch.site(tiny_model.nn, "q", 0)[:, :, tiny_model.arch.columns("q", 1, shape)] = z
        pattern = tiny_model.arch.site(tiny_model.nn, "pattern", 0).save()
    causal_uniform = torch.tril(torch.ones(9, 9)) / torch.arange(1, 10)[:, None]
    assert torch.allclose(pattern[:, 1], causal_uniform.expand(2, 9, 9), atol=1e-5)
    assert not torch.allclose(pattern[:, 0], causal_uniform.expand(2, 9, 9), atol=1e-3)
