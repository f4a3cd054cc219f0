"""Freed memory kept for the next batch, on the CPU (glibc's malloc).

A batch's tensors are large (the hidden states of every depth of 256 tweets are about 100 MiB, and the heads
make several of that size). glibc gives every block over its mmap threshold (at most 32 MiB) pages of their own
and returns them to the kernel when the block is freed, so each batch's tensors start on fresh pages, which the
kernel zero-fills at the first write: on the 2-core CI-class CPU a fresh 100 MiB tensor took 23 ms to allocate
and fill against 4 ms for one whose pages were kept, and freeing it 6.5 ms more. With no block mapped on its own
and the heap's top kept, a batch reuses the pages the one before it freed (``routing-service bench engine`` in turns
with glibc's own behaviour: 2-8 % less time a batch of 32 tweets, 15-26 % a batch of 256 in four runs of five).
Resident memory then stays at the largest batch's peak, as with jemalloc or tcmalloc, which PyTorch advises for CPU
inference. Training was measured too and gained nothing (texts of a word or two: small tensors), so only the
engine keeps it.

Only glibc is tuned; a process whose operator set glibc's malloc (``MALLOC_*_`` variables or a
``glibc.malloc`` tunable in ``GLIBC_TUNABLES``) keeps those settings.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("service.heap")

M_TRIM_THRESHOLD = -1
"""mallopt's parameter: free memory at the heap's top kept (not given back to the kernel) up to this many bytes."""
M_MMAP_MAX = -4
"""mallopt's parameter: how many blocks may be mapped on their own (0: none, every block from the heap)."""
KEPT_BYTES = 2**31 - 1
"""The heap's top kept up to this (mallopt takes a C int)."""

_kept = False


def operator_tuned() -> bool:
    """Whether this process's environment sets glibc's malloc itself."""
    return any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse in this process (see the module's doc); once per process.
    Whether it is in effect: False with another C library, or where the operator tuned malloc."""
    global _kept
    if _kept:
        return True
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        glibc = None
    if not glibc or operator_tuned():
        return False
    libc = ctypes.CDLL(None)
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEPT_BYTES))
    if _kept:
        log.debug("glibc malloc keeps freed memory for the next batch (mmap_max 0, trim_threshold %d)", KEPT_BYTES)
    return _kept


def keep_freed_memory_on(device_type: str) -> bool:
    """:func:`keep_freed_memory` in a process that computes on the CPU (``device_type``: a torch device's type); on a
    GPU the tensors are the caching allocator's, and the host's few are small."""
    return device_type == "cpu" and keep_freed_memory()
