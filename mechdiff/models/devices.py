"""The machines a plan is made for: this one (its memory read, its matrix-multiply throughput measured) or a named
accelerator (a few published numbers and a stated efficiency).

A pass also reads the weights of every block it runs: for a pass over few token rows (the short suffix runs of
pruning, DCM, CMAP) that read, not the multiplies, takes the time. A device's ``bandwidth`` is the bytes of weights a
pass reads per second: on this machine measured on matrix multiplies of few rows through more weights than the
caches hold; on a named device its memory bandwidth times `GPU_EFFICIENCY`.

A named device's throughput is its dense peak for the dtype (bfloat16/float16 on tensor cores; float32 without TF32,
which torch leaves off for matrix multiplies by default) times `GPU_EFFICIENCY`, the share of peak a forward
pass of a 7B decoder reaches at moderate batch sizes (an assumption, stated with every plan). This machine's
throughput is measured in CPU seconds (``time.process_time``, every thread counted) on a matrix multiply of the
planned model's own MLP shape, so a plan's CPU seconds compare with the CPU time a stage takes on a shared machine.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from .footprint import Dims, dtype_bytes

GIB = 2**30
#: Share of a GPU's dense peak (and of its memory bandwidth) a forward pass is assumed to reach.
GPU_EFFICIENCY = 0.5
#: The disk a named device's machine has free for scratch files unless told otherwise: a GPU machine's 64 GiB (as the
#: single-GPU machines lent to this project have; ``--plan-disk`` gives yours).
COMMON_GPU_DISK = 64 * 2**30
#: The host memory a named device's machine has unless told otherwise: 128 GiB (the single-GPU machines lent to this
#: project; ``--plan-host`` gives yours).
COMMON_GPU_HOST = 128 * 2**30
#: Bytes a second a named device's machine reads a scratch file (DCM's pair cache) or a model's weights from its
#: disk: 2 GB/s, an assumption (a data-centre NVMe SSD reads 3-7 GB/s sequentially, a cloud machine's local or
#: network disk less; h5py's reads of DCM's rows of tens of MB each are near-sequential). This machine's is measured
#: (`mechdiff.studies.machine.scratch_bandwidth`).
COMMON_GPU_DISK_READ = 2e9
#: Seconds a pass and a block cost on a GPU beside their FLOPs and weight reads: the host's Python (the intervention
#: layer, the model's forward) and kernel launches, which a small pass waits on. An assumption from launch latency:
#: eager PyTorch issues about 30 kernels a LLaMA block, each costing about 10 us on the host (dispatch and the CUDA
#: launch; NVIDIA and PyTorch's "Accelerating PyTorch with CUDA Graphs", 2021, give a few microseconds a launch), so
#: 0.3 ms a block; 1 ms a pass for the embedding, the read-out and the intervention layer's setup.
GPU_OVERHEAD = (1e-3, 3e-4)


@dataclass(frozen=True)
class Device:
    """Memory (bytes) and matrix-multiply throughput (FLOP/s per dtype name, efficiency applied) of one device."""

    name: str
    memory: int
    flops: dict[str, float] = field(default_factory=dict)
    gpu: bool = True
    note: str = ""
    disk: Optional[int] = None  # bytes free for scratch files under TMPDIR; None: not known
    bandwidth: dict[str, float] = field(default_factory=dict)  # weight bytes a pass reads per second, per dtype
    # seconds each pass and each block a pass runs cost beside FLOPs and reads (Python, the intervention layer's
    # trace): measured on this machine (``mechdiff.studies.machine.pass_overhead``); GPU_OVERHEAD on a named GPU
    overhead: tuple[float, float] = (0.0, 0.0)
    host: Optional[int] = None  # a GPU machine's host memory in bytes (None: not known; a CPU device's is ``memory``)
    disk_read: float = 0.0  # bytes a second read back from scratch files and weights on disk (0: not counted)
    # host bytes a run's process holds before its models load (Python, torch, transformers, mechdiff, a tokenizer):
    # this process's resident memory when the plan is made (`process_memory`), the same stack imported
    baseline: int = 0
    # this machine: the 1-minute load average per core while its throughput was measured (above LOADED: calibrated
    # under load, its CPU seconds per FLOP high); 0 on a named device
    load: float = 0.0

    def with_disk(self, disk: Optional[int]) -> "Device":
        """This device with ``disk`` bytes free under TMPDIR (None: unchanged)."""
        return self if disk is None else replace(self, disk=disk)

    def with_baseline(self) -> "Device":
        """This device with this process's resident memory as a run's baseline (`process_memory`)."""
        return replace(self, baseline=process_memory())

    def with_host(self, host: Optional[int]) -> "Device":
        """This GPU device's machine with ``host`` bytes of host memory (None: unchanged)."""
        return self if host is None else replace(self, host=host)

    def disk_seconds(self, nbytes: float) -> float:
        """Seconds to read ``nbytes`` from disk (scratch files, weights; 0 where the rate is not known)."""
        return nbytes / self.disk_read if self.disk_read else 0.0

    def throughput(self, dtype: str) -> float:
        """FLOP/s for ``dtype`` (float16 as bfloat16 where only bfloat16 is given)."""
        dtype_bytes(dtype)  # an unknown dtype is refused with the names
        key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        if key not in self.flops and key == "float16":
            key = "bfloat16"
        if key not in self.flops:
            raise ValueError(f"{self.name}: no throughput known for {dtype} (known: {', '.join(self.flops)})")
        return self.flops[key]

    def read_seconds(self, dtype: str, reads: float) -> float:
        """Seconds to read ``reads`` bytes of weights in ``dtype`` (0 where this device's bandwidth is not known)."""
        rate = self.bandwidth.get(dtype) or self.bandwidth.get("bfloat16" if dtype == "float16" else "")
        return reads / rate if rate else 0.0

    def overhead_seconds(self, passes: float, blocks: float) -> float:
        """Seconds ``passes`` passes running ``blocks`` blocks in all cost beside their FLOPs and weight reads."""
        return passes * self.overhead[0] + blocks * self.overhead[1]


def _gpu(name: str, memory_gb: float, bf16_tflops: float, fp32_tflops: float, tbps: float, note: str) -> Device:
    flops = {"bfloat16": bf16_tflops * 1e12 * GPU_EFFICIENCY, "float32": fp32_tflops * 1e12 * GPU_EFFICIENCY}
    reads = {dtype: tbps * 1e12 * GPU_EFFICIENCY for dtype in flops}
    note = (
        f"{note}; {GPU_EFFICIENCY:.0%} of dense peak and memory bandwidth assumed; "
        f"{GPU_OVERHEAD[0] * 1e3:.1f} ms a pass and {GPU_OVERHEAD[1] * 1e3:.1f} ms a block beside them; "
        f"disk read at {COMMON_GPU_DISK_READ / 1e9:.0f} GB/s"
    )
    return Device(
        name,
        int(memory_gb * 1e9),
        flops,
        True,
        note,
        COMMON_GPU_DISK,
        reads,
        GPU_OVERHEAD,
        COMMON_GPU_HOST,
        COMMON_GPU_DISK_READ,
    )


#: Named accelerators: memory, dense bfloat16 and float32 peaks, memory bandwidth (NVIDIA's data sheets, SXM parts).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in [
        _gpu("h100-80gb", 80, 989, 67, 3.35, "NVIDIA H100 SXM 80 GB: 989 TFLOP/s bf16, 67 fp32, 3.35 TB/s"),
        _gpu("h200-141gb", 141, 989, 67, 4.8, "NVIDIA H200 SXM 141 GB: 989 TFLOP/s bf16, 67 fp32, 4.8 TB/s"),
        _gpu("a100-80gb", 80, 312, 19.5, 2.039, "NVIDIA A100 SXM 80 GB: 312 TFLOP/s bf16, 19.5 fp32, 2.0 TB/s"),
        _gpu("a100-40gb", 40, 312, 19.5, 1.555, "NVIDIA A100 SXM 40 GB: 312 TFLOP/s bf16, 19.5 fp32, 1.6 TB/s"),
    ]
}


def get_device(name: str) -> Device:
    """The named device, or an error listing the names there are."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; named devices: {', '.join(DEVICES)}") from None


def process_memory() -> int:
    """Bytes this process holds resident (``VmRSS``; 0 where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_memory() -> int:
    """Bytes this machine can still give (``MemAvailable``; total memory where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: Token rows of a throughput measurement's warm-up multiply (`matmul_throughput`).
WARM_ROWS = 8
#: CPU seconds a throughput measurement may take at the most: on a dtype this CPU multiplies slowly (float16 here:
#: 0.3 GFLOP/s, one LLaMA-7B MLP multiply of 512 rows 150 s) it measures fewer rows (`matmul_throughput`).
MEASURE_SECONDS = 4.0


def matmul_throughput(rows: int, inner: int, outer: int, dtype: str, min_seconds: float = 0.4) -> float:
    """FLOP per CPU second (``time.process_time``) of ``(rows, inner) @ (inner, outer)`` in ``dtype`` on the CPU,
    repeated for at least ``min_seconds`` after a warm-up of `WARM_ROWS` rows (a multiply that takes longer is timed
    once). Where the warm-up shows one multiply would take over `MEASURE_SECONDS`, fewer rows are measured (at
    least `WARM_ROWS`), so that it takes about that."""
    import torch

    from .loading import DTYPES

    a = torch.randn(rows, inner, dtype=DTYPES[dtype])
    b = torch.randn(inner, outer, dtype=DTYPES[dtype])
    warm = min(rows, WARM_ROWS)
    start = time.process_time()
    torch.mm(a[:warm], b)
    expected = (time.process_time() - start) * rows / warm
    if expected > MEASURE_SECONDS:
        rows = max(warm, int(rows * MEASURE_SECONDS / expected))
        a = a[:rows]
    reps, start = 0, time.process_time()
    while (spent := time.process_time() - start) < min_seconds or reps < 1:
        torch.mm(a, b)
        reps += 1
    return 2 * rows * inner * outer * reps / spent


#: Bytes of weights `weight_bandwidth` reads through at the least: more than a CPU's caches hold.
STREAM_BYTES = 256 * 2**20
#: Token rows of `weight_bandwidth`'s multiplies: a short suffix run's few.
STREAM_ROWS = 4
#: Matrices `weight_bandwidth` reads through at the most (a tiny model's fit a cache: its reads cost little).
STREAM_MATRICES = 128


def weight_bandwidth(inner: int, outer: int, dtype: str, min_seconds: float = 0.4) -> float:
    """Bytes of weights per CPU second that ``(STREAM_ROWS, inner) @ (inner, outer)`` multiplies read, through
    matrices of that shape totalling at least `STREAM_BYTES` (each read from memory, not a cache; at most
    `STREAM_MATRICES` of them), repeated for at least ``min_seconds`` after one warm-up pass."""
    import torch

    from .loading import DTYPES

    x = torch.randn(STREAM_ROWS, inner, dtype=DTYPES[dtype])
    count = min(STREAM_MATRICES, max(2, -(-STREAM_BYTES // (inner * outer * dtype_bytes(dtype)))))
    # constant weights: a multiply reads them at the same rate as random ones, and they are made 2.5 times faster
    weights = [torch.full((inner, outer), 0.5, dtype=DTYPES[dtype]) for _ in range(count)]
    for w in weights:
        torch.mm(x, w)
    reps, start = 0, time.process_time()
    while (spent := time.process_time() - start) < min_seconds or reps < 2:
        for w in weights:
            torch.mm(x, w)
        reps += 1
    return count * inner * outer * dtype_bytes(dtype) * reps / spent


def this_machine(dims: Dims, dtypes: tuple[str, ...], rows: Optional[int] = None) -> Device:
    """This machine as a device: its available memory (with what this process holds, a run's baseline), the CPU
    throughput of each of ``dtypes`` measured on a matrix multiply of ``dims``' MLP shape with ``rows`` token rows
    (default 512: a batch of prompts), the bytes of weights of that shape a pass of few rows reads per CPU second
    (`weight_bandwidth`) and the load average a core while it measured (`load_per_core`)."""
    rows = rows or 512
    flops = {d: matmul_throughput(rows, dims.d_model, dims.d_ff, d) for d in dict.fromkeys(dtypes)}
    reads = {d: weight_bandwidth(dims.d_model, dims.d_ff, d) for d in dict.fromkeys(dtypes)}
    shown = ", ".join(f"{d} {f / 1e9:.0f} GFLOP/s, weights read at {reads[d] / 1e9:.1f} GB/s" for d, f in flops.items())
    note = f"CPU, measured per CPU second: {shown}"
    held = process_memory()  # a run's baseline, and memory this process frees to a run that follows its plan
    device = Device("this machine", available_memory() + held, flops, False, note, scratch_disk(), reads)
    return replace(device, baseline=held, load=load_per_core())


#: Load average per core above which a measured throughput counts as calibrated under load: other processes share
#: the cores, so a CPU second does less and the plan's times run high (or low, where the load goes away).
LOADED = 0.5


def load_per_core() -> float:
    """The 1-minute load average over the cores this process may run on (0 where unknown)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return os.getloadavg()[0] / cores
    except OSError:
        return 0.0


def scratch_disk() -> int:
    """Bytes free on the disk that holds TMPDIR (where scratch files such as DCM's pair cache go)."""
    return shutil.disk_usage(tempfile.gettempdir()).free
