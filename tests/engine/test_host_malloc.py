"""The engine's C allocator setting (executor/host_malloc.py): after it, a large block comes from the heap
instead of its own mmap, so freeing and allocating it again costs no fresh pages."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

glibc = hasattr(ctypes.CDLL(None), "mallinfo2")

# Run in its own process: the setting is process-wide. Prints, for a 64 MiB malloc before and after
# keep_freed_memory(): whether it was mmapped (glibc's mallinfo2 hblkhd grew by it), and the call's result.
SCRIPT = """
import ctypes
from services.engine.executor import host_malloc

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
          "keepcost")
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mapped() -> bool:
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(64 << 20)
    grew = libc.mallinfo2().hblkhd - before >= 64 << 20
    libc.free(block)
    return grew

print(mapped(), host_malloc.keep_freed_memory(), mapped())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not glibc, reason="glibc's mallopt only")
def test_after_keep_freed_memory_large_blocks_come_from_the_heap() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, cwd=root
    )
    assert done.stdout.split() == ["True", "True", "False"], done.stdout + done.stderr
