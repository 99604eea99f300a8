"""Position-wise means, written once (mechdiff.patching.ablation): scoring's means with and without the
activation store, and the knowledge circuits' sink-apart means, against numpy on captured activations."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tolerances import assert_close32

from mechdiff.circuits.scoring import position_means
from mechdiff.patching.core import run
from mechdiff.tasks.base import batch_tensors
from mechdiff.tasks.entity_tracking import generate


@pytest.fixture(scope="module")
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, 7, n_boxes=3, seed=4)


def _z_mean(model, records) -> np.ndarray:
    """Every layer's z averaged over the prompts in float64: ``"layer pos cols"``."""
    ids = batch_tensors(records)["input_ids"]
    sites = [("z", layer) for layer in range(model.shape.n_layers)]
    with torch.no_grad():
        captured = run(model, ids, capture=sites).captured
    return np.stack([captured[s].double().numpy().mean(0) for s in sites])


def test_position_means_with_and_without_the_store(tiny_llama, records, tmp_path):
    want = _z_mean(tiny_llama, records)
    plain = position_means(tiny_llama, records, batch_size=3, progress=False)  # 3 + 3 + 1 prompts
    assert plain.dtype == torch.float32 and plain.shape == want.shape
    assert_close32(plain, want)  # batches of 3 against one of 7: another summation order in the forward
    stored = position_means(tiny_llama, records, batch_size=3, progress=False, store=tmp_path / "acts.h5")
    assert_close32(stored, plain, depth=len(records))  # the same activations, summed from the store


def test_bucketed_means_against_numpy():
    from mechdiff.patching.ablation import PositionMeans, every_position, sink_apart

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 4, 2, 4, generator=g)  # unit batch pos d
    sink = PositionMeans(sink_apart, n_buckets=2)
    sink.add(a)
    sink.add(b)  # prompts of another length: the buckets still line up
    x, y = a.double().numpy(), b.double().numpy()
    first = np.concatenate([x[:, :, 0], y[:, :, 0]], 1).mean(1)
    rest = np.concatenate([x[:, :, 1:].reshape(3, -1, 4), y[:, :, 1:].reshape(3, -1, 4)], 1).mean(1)
    assert_close32(sink.mean(), np.stack([first, rest], 1), depth=12 + 1)  # float32 sums of <= 12 terms, a division
    each = PositionMeans(every_position)
    each.add(a)
    each.add(a[:, :1])
    assert_close32(each.mean(), np.concatenate([x, x[:, :1]], 1).mean(1), depth=3 + 1)  # sums of 3 terms, a division
    with pytest.raises(ValueError, match="one length"):
        each.add(b)
    one = PositionMeans(sink_apart, n_buckets=2)
    one.add(a[:, :, :1])  # one-token prompts: nothing in the later bucket, whose mean is 0
    assert float(one.mean()[:, 1].abs().max()) == 0.0  # exact: no term was added to that bucket
    with pytest.raises(ValueError, match="no activations"):
        PositionMeans().mean()


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


def test_empty_means_and_unpatchable_components_are_refused(tiny_llama):
    from mechdiff.patching.ablation import PositionMeans
    from mechdiff.patching.activation import capture_sources

    with pytest.raises(ValueError, match="^no activations to average; add at least one batch$"):
        PositionMeans().mean()
    with pytest.raises(
        ValueError,
        match="^" + re.escape("cannot patch 'MLP1': activation patching supports heads (L<l>H<h>) and EMB") + "$",
    ):
        capture_sources(tiny_llama, torch.zeros(1, 3, dtype=torch.long), ["MLP1"])
