"""Freed tensors back to the system at once: glibc's malloc raises its mmap threshold each time a large block is
freed (up to 32 MiB), after which tensors of that size come from its heap, which keeps them resident when freed;
a CPU forward's resident memory then grows to 2-2.5 times the tensors it holds at once (``benchmarks/README.md``,
"The resource planner against measurement"). A fixed threshold keeps every large tensor in its own mapping,
unmapped when it is freed, so resident memory follows the live tensors the resource planner counts."""

from __future__ import annotations

import ctypes
import sys

#: Bytes from which glibc maps an allocation on its own (returned when freed); below it, its heap.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (no dynamic raise). False where the C library is not
    glibc (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
