"""Batch size from free accelerator memory (``--batch-size auto``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from .architectures import ModelShape

if TYPE_CHECKING:
    from .loading import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_BATCH = 32  # CPU, NDIF, or no CUDA: the size every stage used before
MAX_BATCH = 256


def example_bytes(shape: ModelShape, seq_len: int, bytes_per_value: int = 4) -> int:
    """Rough activation memory of one prompt in one patched forward pass.

    The heaviest stage keeps every layer's head outputs (``z``: ``layer pos d_model``) of the
    clean and counterfactual runs, plus the transient eager-attention scores
    (``head pos pos``, a few copies in float32), an MLP's hidden state (about 4 ``d_model``
    wide, three tensors) and read-out logits at every position.
    """
    kept = 2 * shape.n_layers * seq_len * shape.d_model * bytes_per_value
    attention = 3 * shape.n_heads * seq_len * seq_len * 4
    mlp = 3 * 4 * shape.d_model * seq_len * bytes_per_value
    logits = shape.vocab_size * seq_len * 4
    return kept + attention + mlp + logits


def cuda_devices(model: "LoadedModel") -> list[torch.device]:
    """Every CUDA device holding a part of the model (several under ``device_map="auto"``)."""
    hf_map = getattr(model.model, "hf_device_map", None)
    if hf_map:
        found = {torch.device(f"cuda:{d}") if isinstance(d, int) else torch.device(d) for d in hf_map.values()}
    else:
        found = {p.device for p in model.model.parameters()}
    return sorted((d for d in found if d.type == "cuda"), key=lambda d: d.index or 0)


def auto_batch_size(
    model: "LoadedModel",
    seq_len: int = 160,
    fraction: float = 0.6,
    default: int = DEFAULT_BATCH,
    cap: int = MAX_BATCH,
    reserve: int = 0,
) -> int:
    """Prompts per forward pass that fit in ``fraction`` of the free memory of the model's GPUs.

    ``default`` on CPU and for a model on NDIF (the server batches); at least 1, at most ``cap``.
    ``seq_len``: the longest prompt expected (a 7-box entity-tracking prompt is about 100 tokens
    for LLaMA's tokenizer). ``reserve``: bytes the caller will allocate beside the batches, not free for them.
    """
    if getattr(model, "remote", False):
        return default
    devices = cuda_devices(model)
    if not devices:
        return default
    free = max(min(torch.cuda.mem_get_info(d)[0] for d in devices) - reserve, 0)
    dtype = next(model.model.parameters()).dtype
    per = example_bytes(model.shape, seq_len, torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4)
    size = max(1, min(cap, int(free * fraction) // per))
    log.info(
        "batch size %d from %.1f GiB free on %s (about %.0f MiB per prompt)",
        size,
        free / 2**30,
        ", ".join(map(str, devices)),
        per / 2**20,
    )
    return size


def torch_peak(run: Callable[[], Any]) -> int:
    """The most bytes torch's CPU allocator held at once while ``run()`` ran, above what it held before: its
    allocation and free events (the profiler's ``[memory]`` events) summed in time order. Resident memory can lie
    well above it: glibc's heap keeps freed tensors (see ``benchmarks/README.md``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak
