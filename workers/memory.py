"""Bounding a CPU worker's resident memory.

Under a load of varied request shapes a CPU worker's RSS grew by tens of MiB per batch of
requests, with no growth in Python objects or tensors. The growth is in live ``malloc`` memory
(``mallinfo2().uordblks``) and disappears with a fixed workload: it is two shape-keyed caches of
PyTorch's oneDNN (mkldnn) path, each holding up to 1024 entries by default:

* oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), compiled kernels per shape;
* ideep's computation cache (``LRU_CACHE_CAPACITY``), per-shape operator descriptors.

Every forward of a new token count or batch width adds entries, so the RSS rises towards a
ceiling of 2 x 1024 entries, far above what the model needs. ``limit_native_caches`` lowers both
capacities (unless the user set them); it must run before the first oneDNN operation of the
process, since both libraries read their capacity once. ``MallocTrimmer`` returns freed heap pages
to the kernel (glibc ``malloc_trim``) after the worker has been idle for a while, so the resident
size falls back after a burst instead of staying at its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

log = logging.getLogger(__name__)

# Enough for the handful of GEMM shapes a step mixes; a miss costs one primitive creation.
DEFAULT_NATIVE_CACHE_CAPACITY = 64
CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def limit_native_caches(capacity: int = DEFAULT_NATIVE_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's and ideep's shape-keyed caches at ``capacity`` entries where the environment
    does not already choose; returns the values in effect. Call before the first forward."""
    effective = {}
    for name in CACHE_ENV_VARS:
        effective[name] = os.environ.setdefault(name, str(capacity))
    return effective


def _load_malloc_trim():
    if not os.path.exists("/proc/self/statm"):  # Linux only; elsewhere the allocator differs
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def malloc_trim() -> bool:
    """Give free heap memory back to the kernel; False where glibc's ``malloc_trim`` is absent."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def rss_bytes() -> int | None:
    """Resident set size of this process (None where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MallocTrimmer:
    """Trims the heap once per idle period: call ``busy()`` after each step and ``idle()`` when
    the worker waited without work; the trim runs when it has been idle for ``idle_s`` seconds
    since the last step, and not again until another step ran."""

    def __init__(self, idle_s: float = 1.0, clock=time.monotonic):
        self.idle_s, self.clock = idle_s, clock
        self._last_busy = clock()
        self._dirty = False
        self.trims = 0

    def busy(self) -> None:
        self._last_busy = self.clock()
        self._dirty = True

    def idle(self) -> bool:
        """True when it trimmed now."""
        if not self._dirty or self.clock() - self._last_busy < self.idle_s:
            return False
        self._dirty = False
        if malloc_trim():
            self.trims += 1
            return True
        return False
