"""Mean-ablation scoring's edge cases against direct runs. Written from the survivors of mutation testing
(benchmarks/mutation.md)."""

from __future__ import annotations

import torch

from mechdiff.circuits.scoring import Scorer, ablation_patches
from mechdiff.common.components import Head
from mechdiff.patching.core import run
from mechdiff.tasks.entity_tracking import batch_tensors, generate, reference_records


def test_removing_pairs_of_a_class_absent_from_the_batch_changes_nothing(tiny_llama, smollm2_tokenizer):
    """A removed pair whose position class holds no position in these prompts: the resumed run reads the
    last position only, and its logits are F(C)'s."""
    records = generate(smollm2_tokenizer, 4, n_boxes=3, seed=0)
    reference = reference_records(smollm2_tokenizer, 4, 3, seed=1)
    scorer = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False)
    batch = batch_tensors(records)
    batch["position_classes"] = {"nowhere": torch.zeros(batch["input_ids"].shape, dtype=torch.bool)}
    base = frozenset({(Head(1, 0), "last"), (Head(2, 1), "nowhere"), (Head(0, 2), "query_label")})
    removed = frozenset({(Head(2, 1), "nowhere")})
    got = scorer._resumed(base, base - removed, removed, 2, batch, [0, 1, 2, 3])
    with torch.no_grad():
        want = run(tiny_llama, batch["input_ids"], ablation_patches(tiny_llama, scorer.means, batch, base)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    key = frozenset({(Head(1, 0), "last")})
    cached, runs = scorer.keep(key), len(scorer.runs)
    assert scorer.keep_without(key | removed, removed) is cached  # served by the cache: nothing run again
    assert len(scorer.runs) == runs


def test_a_scorer_built_with_a_store_writes_and_then_reads_its_means(tiny_llama, smollm2_tokenizer, tmp_path,
                                                                       monkeypatch):
    """``store``: the means are written to the HDF5 store on the first build and read from it on the next
    (no forward pass), equal to the means computed in memory."""
    import mechdiff.circuits.scoring as scoring
    import mechdiff.patching.store

    records = generate(smollm2_tokenizer, 2, n_boxes=3, seed=0)
    reference = reference_records(smollm2_tokenizer, 4, 3, seed=1)
    store = tmp_path / "activations.h5"
    first = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False, store=store)
    assert store.is_file()
    memory = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False)
    # exact: the same activations summed by the same code in this process (the store only holds a copy)
    torch.testing.assert_close(first.means, memory.means, rtol=0, atol=0)
    def recomputed(*args, **kwargs):
        raise AssertionError("the means were computed again")

    monkeypatch.setattr(scoring, "site_means", recomputed)
    monkeypatch.setattr(mechdiff.patching.store, "capture_sites", recomputed)
    again = Scorer.build(tiny_llama, records, reference, batch_size=4, progress=False, store=store)
    assert (again.batch_size, again.progress) == (4, False)
    torch.testing.assert_close(again.means, memory.means, rtol=0, atol=0)  # exact: read back, not recomputed


def test_position_mask_refuses_unknown_and_missing_positions_by_kind():
    import pytest

    from mechdiff.circuits.scoring import position_mask

    ids = torch.zeros(2, 5, dtype=torch.long)
    batch = {"input_ids": ids, "positions": {"last": torch.tensor([4, 4]), "gone": torch.tensor([3, -1]),
                                             "objects": torch.tensor([[0, 2], [1, -1]])},
             "position_classes": {"context": torch.ones(2, 5, dtype=torch.bool)}}
    assert position_mask(batch, "context") is batch["position_classes"]["context"]
    assert position_mask(batch, "last").nonzero().tolist() == [[0, 4], [1, 4]]
    for name, message in (("gone", "position 'gone' is missing in some prompts; score on prompts that contain it"),
                          ("objects", "position class 'objects' is missing in some prompts; score on prompts that "
                                      "contain it"),
                          ("box", "unknown position 'box'; valid: ['gone', 'last', 'objects'], the classes "
                                  "['context'] or '*'")):
        with pytest.raises(ValueError) as err:
            position_mask(batch, name)
        assert str(err.value) == message
    batch["positions"]["objects"] = torch.tensor([[0, 2], [1, 3]])
    assert position_mask(batch, "objects").nonzero().tolist() == [[0, 0], [0, 2], [1, 1], [1, 3]]


def test_means_of_no_records_are_refused(tiny_llama):
    import pytest

    from mechdiff.circuits.scoring import position_means

    with pytest.raises(ValueError) as err:
        position_means(tiny_llama, [])
    assert str(err.value) == "no reference records to average; give at least one"
