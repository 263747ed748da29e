"""Keep freed tensor memory in the process instead of handing it back to the OS (glibc only).

PyTorch's CPU allocator takes every tensor straight from ``malloc``. With glibc's defaults a
block above the (dynamic) mmap threshold is a fresh ``mmap`` and its ``free`` an ``munmap``,
and free space at the top of the heap beyond the trim threshold is returned with ``brk``, so a
training step that creates and drops the same activation-sized tensors thousands of times
page-faults on every one of them: the kernel zeroes each new 4 KiB page. On small CPU models
that page-faulting is a visible part of a step (the measurements, with their dates, are in
``benchmarks/RESULTS.md``, section 3.0, item 2).

:func:`keep_freed_memory` raises both thresholds with ``mallopt`` (the run-time equivalent of
the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables, which only
act at process start), so freed blocks are reused from the heap. The price: the process keeps
up to ``trim_threshold`` bytes of freed memory mapped after a peak instead of returning it, and
blocks below ``mmap_threshold`` come from the heap (blocks above it are still mmapped). It is
process-wide and one-way (the defaults are not restored); the trainer calls it when
``run.keep_freed_memory`` is true (the default). Other C libraries (musl, macOS): a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_memory"]

#: glibc's ``mallopt`` parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (larger ones are still mmapped)
MMAP_THRESHOLD = 1 << 30
#: free memory at the heap top kept before it is returned to the OS
TRIM_THRESHOLD = 1 << 30

_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); True when applied
    (now or by an earlier call), False where the C library is not glibc or refuses."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _applied
