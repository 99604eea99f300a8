"""The HDF5 activation store: round trip, refusal of other models' entries, resume, atomic commits."""

from __future__ import annotations

import h5py
import pytest
import torch
from conftest import make_tiny

from mechdiff.patching.store import ActivationStore, RowStore, StoreKey, StoreMismatchError, capture_sites
from mechdiff.tasks.entity_tracking import dataset_hash, generate


@pytest.fixture
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, n=10, n_boxes=3, seed=1)


def test_round_trip_and_streaming(tmp_path, tiny_llama, records):
    store = ActivationStore(tmp_path / "acts.h5")
    entry = store.get_or_compute(tiny_llama, records, "z", "all", batch_size=4, progress=False)
    direct = capture_sites(tiny_llama, records, "z", "all")
    assert len(entry) == len(records) and entry.layers == [0, 1, 2]
    for layer in entry.layers:
        torch.testing.assert_close(entry.read(layer), direct[layer].float())
    torch.testing.assert_close(entry.read(1, slice(3, 7)), direct[1][3:7].float())  # streamed slice
    last = store.get_or_compute(tiny_llama, records, "q", "last", batch_size=4, progress=False)
    assert last.read(0).shape == (len(records), 32)
    with h5py.File(tmp_path / "acts.h5") as f:
        g = f[entry.key.group]
        assert g.attrs["model_fingerprint"] == tiny_llama.fingerprint
        assert g.attrs["dataset_hash"] == dataset_hash(records)
        assert g["L0"].compression == "gzip" and g["L0"].chunks is not None
    assert set(store.keys()) == {entry.key, last.key}


def test_means_are_position_wise(tmp_path, tiny_llama, records):
    store = ActivationStore(tmp_path / "acts.h5")
    means = store.means(tiny_llama, records, "z", batch_size=3, progress=False)
    direct = capture_sites(tiny_llama, records, "z", "all")
    assert means.shape == (3, len(records[0].input_ids), 32)
    for layer in range(3):
        torch.testing.assert_close(means[layer], direct[layer].float().mean(0), atol=1e-5, rtol=1e-5)
    again = store.means(tiny_llama, records, "z", batch_size=3, progress=False)  # cached
    torch.testing.assert_close(again, means)


def test_other_model_or_dataset_refused(tmp_path, tiny_llama, smollm2_tokenizer, records):
    store = ActivationStore(tmp_path / "acts.h5")
    store.get_or_compute(tiny_llama, records, "z", "last", progress=False)
    other = make_tiny("llama", smollm2_tokenizer, seed=1)
    with pytest.raises(StoreMismatchError, match="not for model"):
        store.read(other, records, "z", "last")
    with pytest.raises(StoreMismatchError):
        store.read(tiny_llama, records[:5], "z", "last")
    # an entry whose attributes were tampered with is refused, not used
    key = StoreKey(tiny_llama.fingerprint, dataset_hash(records), "z", "last")
    with h5py.File(tmp_path / "acts.h5", "a") as f:
        f[key.group].attrs["dataset_hash"] = "0" * 64
    with pytest.raises(StoreMismatchError, match="will not be used"):
        store.get(key)


def test_interrupted_write_resumes_and_leaves_previous_file_intact(tmp_path, tiny_llama, records):
    store = ActivationStore(tmp_path / "acts.h5")
    first = store.get_or_compute(tiny_llama, records, "z", "last", batch_size=4, progress=False)
    before = (tmp_path / "acts.h5").read_bytes()
    calls: list[int] = []

    def crashing(model, recs):
        calls.append(len(recs))
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        return capture_sites(model, recs, "v", "all")

    with pytest.raises(KeyboardInterrupt):
        store.get_or_compute(tiny_llama, records, "v", "all", compute_fn=crashing, batch_size=4, progress=False)
    assert (tmp_path / "acts.h5").read_bytes() == before  # the committed file is untouched
    assert store.partial.exists()
    torch.testing.assert_close(store.get(first.key).read(0), first.read(0))
    calls.clear()

    def counting(model, recs):
        calls.append(len(recs))
        return capture_sites(model, recs, "v", "all")

    entry = store.get_or_compute(tiny_llama, records, "v", "all", compute_fn=counting, batch_size=4, progress=False)
    assert calls == [4, 2]  # batch 0 was kept; only batches 1 and 2 ran
    assert not store.partial.exists()
    direct = capture_sites(tiny_llama, records, "v", "all")
    torch.testing.assert_close(entry.read(2), direct[2].float())
    assert first.key in store.keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_store_reads_back_the_rows_written(tmp_path, dtype):
    """Batches written at scattered rows read back, in any order asked, as the very values written."""
    full = torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    store = RowStore(7, tmp_path)
    for rows in ([4, 0, 6], [1, 5], [3, 2]):
        store.write("a", rows, full[rows])
    assert "a" in store and "b" not in store
    for rows in ([0, 1, 2, 3, 4, 5, 6], [6, 2, 0], [3]):
        got = store.read("a", rows)
        assert got.dtype == dtype and torch.equal(got, full[rows])  # exact: a value read back


def test_row_store_file_goes_with_the_store(tmp_path):
    """close() deletes the scratch file, and so does dropping the store."""
    closed, dropped = RowStore(2, tmp_path), RowStore(2, tmp_path)
    for store in (closed, dropped):
        store.write("a", [0, 1], torch.zeros(2, 3))
    paths = [closed.path, dropped.path]
    assert all(p.exists() and p.parent.parent == tmp_path for p in paths)
    closed.close()
    del dropped, store
    assert list(tmp_path.iterdir()) == []
