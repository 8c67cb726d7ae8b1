"""Host-memory behaviour of CPU training: optionally make glibc give freed activation memory back.

A CPU training step allocates and frees the towers' activations (blocks of tens of KiB to MiB) once per
micro-batch. glibc's malloc serves blocks of 128 KiB and more with mmap at first, but raises that
threshold (up to 32 MiB) each time such a block is freed, after which activations come from the heap
and their freed memory stays resident for reuse. A fixed threshold (what ``MALLOC_MMAP_THRESHOLD_`` sets
at process start; ``mallopt`` sets the same at run time) returns it to the system, at the price of
page-faulting every activation in afresh: less peak memory, much slower steps. Hence opt-in
(``release_freed_memory``).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
GLIBC_DEFAULT_TRIM_THRESHOLD = 128 * 1024

# Blocks from this size up are mmap'ed and unmapped on free. Measured on 2 shared cores (cliptk-tiny, fp32,
# 2 loader workers, docs/training.md): one gradient-cache step (micro-batch 64, openclip loss) at global
# batch 2048 peaked at 1.16 GB instead of 1.31 GB (process tree PSS), but steady-state training ran at
# 0.69x the samples/s (batch 256, no cache) and 0.17-0.55x (batch 512, micro-batch 64).
CPU_MMAP_THRESHOLD = 64 * 1024


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``gnu_get_libc_version``; musl does not), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def release_freed_memory(device_type: str, threshold: int = CPU_MMAP_THRESHOLD) -> bool:
    """On the CPU under glibc, fix malloc's mmap threshold at ``threshold`` bytes (and the trim threshold
    at glibc's default, as ``MALLOC_MMAP_THRESHOLD_`` leaves it), so freed activations leave the resident
    set (module docstring). Nothing on CUDA (the caching allocator holds device memory), on other C
    libraries, or when the user set ``MALLOC_MMAP_THRESHOLD_`` (theirs is in force; likewise
    ``MALLOC_TRIM_THRESHOLD_``). Call it early, before the data loader forks its workers (they inherit
    it). Returns whether the threshold was set here."""
    if device_type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    if libc is None or libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) != 1:
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_TRIM_THRESHOLD)  # the dynamic rule may have raised it
    return True
