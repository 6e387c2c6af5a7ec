"""glibc's malloc told to keep the memory a step frees, so that the next step reuses it.

A step's activations are a few large tensors (a 2048-token step of the default model: [2048, 3072] for the MLP's
gate and up, 12 MiB in bf16), allocated and freed once per layer. glibc serves an allocation over its mmap
threshold (at most 32 MiB, adapting) with fresh pages from the kernel and gives them back on free, and trims the
heap's freed top past 128 KiB: every layer of every step then pays page faults and the kernel's zeroing of the
pages it hands out (10% of an embedding run's CPU time on the AMX kind, `clear_page_erms` in `perf`). Raising
both thresholds keeps the freed memory in the heap for the next layer, as PyTorch's CPU tuning guide gets from
swapping in jemalloc or tcmalloc. The cost is a heap that stays at the largest step's size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

logger = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# Allocations up to this come from the heap (a 2048-token step's largest activation of a 7B model is 86 MiB);
# larger ones (the KV pool, weights) are still mapped on their own.
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # the heap grows in steps this large, not one page-fault-sized piece at a time


@cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc (musl, macOS)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        logger.debug("not glibc: malloc's thresholds left as they are")
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
