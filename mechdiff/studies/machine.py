"""This machine (and its GPU) as a plan's device: the fixed cost of a pass and of each block it runs
(`pass_overhead`), the rate scratch files are read back at (`scratch_bandwidth`), and the first CUDA GPU as the
named device of its kind (`gpu_device`). Measured once a plan (`with_overhead`); the matrix-multiply throughput
and weight bandwidth are `mechdiff.models.devices.this_machine`'s."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..models.devices import Device
from ..models.footprint import Dims


def gpu_device() -> Device:
    """The first CUDA GPU as a named device: the one of its name (H100, H200, A100 of its memory), else an H100's
    figures with its own memory."""
    import torch

    from ..models.devices import DEVICES

    props = torch.cuda.get_device_properties(0)
    name = props.name.upper()
    for key, device in DEVICES.items():
        kind, size = key.split("-")
        if kind.upper() in name and abs(int(size[:-2]) * 1e9 - props.total_memory) < 16e9:
            return replace(device, memory=props.total_memory)
    return replace(DEVICES["h100-80gb"], name=props.name, memory=props.total_memory)


#: Width of the random model `pass_overhead` times: its FLOPs and weight reads are negligible.
OVERHEAD_WIDTH = 64


def pass_overhead(dims: Dims, min_seconds: float = 0.2) -> tuple[float, float]:
    """CPU seconds a pass costs beside its FLOPs and weight reads, and each block it runs: ``run`` (through the
    intervention layer) of one token on a random LLaMA of ``dims``' depth and `OVERHEAD_WIDTH`, timed in full
    and resumed at its last block; the difference is the blocks' share. A departure: the model's own norms,
    attention and rotary code is LLaMA's, not necessarily the planned model's."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..models.loading import LoadedModel
    from ..models.registry import ModelSpec
    from ..patching.core import Resume, run

    w, layers = OVERHEAD_WIDTH, dims.n_layers
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=w, intermediate_size=2 * w, num_attention_heads=4, vocab_size=w
    )
    config._attn_implementation = "eager"
    model = LoadedModel("overhead", ModelSpec("overhead", "local", ""), LlamaForCausalLM(config).eval(), None)
    ids, hidden = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, w)

    def seconds(resume: Optional[Resume]) -> float:
        run(model, ids, resume=resume)
        reps, start = 0, time.process_time()
        while (spent := time.process_time() - start) < min_seconds or reps < 3:
            run(model, ids, resume=resume)
            reps += 1
        return spent / reps

    with torch.no_grad():
        full, last = seconds(None), seconds(Resume(layers - 1, hidden))
    block = max(full - last, 0.0) / max(layers - 1, 1)
    return max(last - block, 0.0), block


def with_overhead(device: Device, dims: Dims) -> Device:
    """This machine (a CPU device) with `pass_overhead` and `scratch_bandwidth` measured; a GPU device as
    it is."""
    if device.gpu:
        return device
    each, block = pass_overhead(dims)
    disk = scratch_bandwidth()
    note = (
        f"{device.note}; {each * 1e3:.1f} ms a pass and {block * 1e3:.2f} ms a block beside them; scratch files "
        f"read back at {disk / 1e9:.1f} GB/s (wall)"
    )
    return replace(device, overhead=(each, block), note=note, disk_read=disk)


#: What `scratch_bandwidth` writes and reads back: rows of a few MB, as DCM's pair cache holds.
SCRATCH_ROWS, SCRATCH_ROW_BYTES = 32, 4 * 2**20


def scratch_bandwidth(min_seconds: float = 0.2) -> float:
    """Bytes a wall-clock second that rows of a scratch file (`RowStore`, read as
    DCM's pair cache reads them: batches of 8 rows in a shuffled order) come back under TMPDIR just after they were
    written (from the page cache where memory holds them, as a run's are). Wall time, not CPU time: a read that
    waits on the disk costs time but little CPU."""
    import time

    import numpy as np
    import torch

    from ..patching.store import RowStore

    store = RowStore(SCRATCH_ROWS)
    try:
        store.write("rows", range(SCRATCH_ROWS), torch.ones(SCRATCH_ROWS, SCRATCH_ROW_BYTES // 4))
        order = np.random.default_rng(0).permutation(SCRATCH_ROWS)
        batches = [sorted(order[i : i + 8].tolist()) for i in range(0, SCRATCH_ROWS, 8)]
        reps, start = 0, time.perf_counter()
        while (spent := time.perf_counter() - start) < min_seconds or reps < 2:
            for batch in batches:
                store.read("rows", batch)
            reps += 1
        return SCRATCH_ROWS * SCRATCH_ROW_BYTES * reps / spent
    finally:
        store.close()
