"""DCM's memory is bounded by its batch, not by its number of pairs: the peak allocation above what was allocated
before the stage, at ``n`` pairs and at ``10 n``, measured with memray (which sees torch's CPU allocator, as
tracemalloc does not, and here each Python object rather than pymalloc's 1 MiB arenas)."""

from __future__ import annotations

from pathlib import Path

import memray
from conftest import make_tiny

from mechdiff.common.components import Head
from mechdiff.methods.dcm import DCMConfig, run_dcm
from mechdiff.tasks.entity_tracking import object_value_pairs

N = 16  # 10 training pairs: one full micro-batch of 8, where the peak is (the backward pass)


def _peak(stage, path: Path) -> int:
    """Bytes allocated at the high-water mark while ``stage()`` runs, counting only what it allocates."""
    with memray.Tracker(path, native_traces=False, trace_python_allocators=True):
        stage()
    return memray.FileReader(path).metadata.peak_memory


def test_dcm_peak_memory_does_not_grow_with_the_number_of_pairs(tmp_path, smollm2_tokenizer):
    model = make_tiny("llama", smollm2_tokenizer, seed=5)
    pairs = object_value_pairs(smollm2_tokenizer, 10 * N, n_boxes=3, seed=4)
    config = DCMConfig(epochs=1, batch_size=8, micro_batch=8, eval_batch=8, eval_every=1000, n_random=1)
    heads = [Head(1, 0), Head(2, 1), Head(2, 3)]

    def dcm(n: int):
        return lambda: run_dcm(model, heads, "last", pairs[:n], config, progress=False)

    dcm(N)()  # torch's and h5py's first-call allocations are not the stage's
    small, large = _peak(dcm(N), tmp_path / "n.bin"), _peak(dcm(10 * N), tmp_path / "10n.bin")
    print(f"DCM peak above baseline: {small / 1e6:.2f} MB at {N} pairs, {large / 1e6:.2f} MB at {10 * N}")
    assert abs(large - small) <= 0.1 * small, f"{small / 1e6:.2f} MB at {N} pairs, {large / 1e6:.2f} MB at {10 * N}"
