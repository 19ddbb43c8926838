"""A service that crashes in native code says where: `grpc_server.run` turns faulthandler on, so a segfault
prints every thread's Python stack to stderr before the process dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import ctypes
from services.common import grpc_server

async def crash_in_native_code() -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV

grpc_server.run(crash_in_native_code())
"""


def test_a_segfault_in_a_service_prints_the_python_stack() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert done.returncode != 0
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr
    assert "crash_in_native_code" in done.stderr, done.stderr
