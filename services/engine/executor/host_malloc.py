"""The C allocator of an engine on a CPU: freed blocks kept for reuse instead of handed back to the kernel.

glibc serves a block of 128 KiB or more (a threshold it raises to at most 32 MiB as blocks are freed) with
its own `mmap` and returns it with `munmap` when freed, and gives back free memory at the top of its heap
past 128 KiB. A prefill step's activations are blocks of several MB, allocated and freed in every layer, so
each one came back from the kernel as fresh pages, paying a page fault per 4 KiB on first touch: the tiny
model's 2,048-token step took 130-150 ms, 100-105 ms with the thresholds below (as with tcmalloc). Memory
then stays at the largest step's peak instead of returning between steps, which an engine reaches again
at the next prefill anyway. docs/architecture.md ("Where the cycles go") has the measurement.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to this size come from the heap, and this much free memory stays in it


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds to KEEP_BYTES for this process (True when both took; False,
    logged, on another C library or platform). Affects allocations made after the call."""
    if not sys.platform.startswith("linux"):
        log.info("host allocator: left as it is on %s", sys.platform)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("host allocator: no mallopt (not glibc); freed blocks go back to the kernel")
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    if ok:
        log.info("host allocator: freed blocks up to %d MiB kept for reuse", KEEP_BYTES >> 20)
    else:
        log.info("host allocator: mallopt refused the thresholds; freed blocks go back to the kernel")
    return ok
