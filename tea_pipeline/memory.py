"""Keep freed memory in the process while LightTEA runs, instead of handing it back to the OS after every use.

Why: a LightTEA round allocates and frees multi-hundred-megabyte temporaries many times (feature matrices, product
blocks, gathered rows). glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mapping
and unmaps it on free, so every reuse pays one page fault per 4 KB page again; on YAGO-WIKI20K that is millions of
faults per run, a large share of the wall time on virtual machines where a fault is expensive
(``bench/tea/README.md``). While `reuse_freed_memory` is active, large blocks come from the heap and freed ones
stay there for the next allocation; on exit the previous policy is restored and the heap is trimmed, so the memory
goes back to the OS once the run is over. Outside Linux/glibc it does nothing.

What is kept is bounded between stages: `trim_freed_memory` hands the free heap back to the OS when it holds more
than a limit. Within a stage the kept blocks are reused over and over. The blocks one stage frees are not all reused
by the next one (the search frees other shapes than the propagation allocates), so on large pairs they would add to
its peak RSS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_DEFAULT_MMAP_MAX = 65536  # glibc's defaults, restored on exit
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_KEEP_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: keep up to 2 GiB of free heap top


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes of freed memory glibc's heaps keep for reuse (``mallinfo2().fordblks``); None off glibc."""
    libc = _glibc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)


def trim_freed_memory(keep_bytes: int = 1 << 30) -> int:
    """Return the heap's free memory to the OS (``malloc_trim``) when it holds more than ``keep_bytes``.

    Returns the free bytes found (0 off glibc, where it does nothing). The pages come back on the next use at the
    cost of one page fault each, so this is meant for boundaries after which the kept memory would not be reused as
    it is (a new round); below ``keep_bytes`` it costs one ``mallinfo2`` call.
    """
    free = free_heap_bytes()
    if free is None:
        return 0
    if free > keep_bytes:
        _glibc().malloc_trim(0)
    return free


@contextmanager
def reuse_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """Within the block, large allocations come from the heap and freed memory is kept for reuse; yields whether
    the policy is active (False when disabled or not on glibc)."""
    libc = _glibc() if enabled else None
    if libc is None or not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM_THRESHOLD)):
        yield False
        return
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
