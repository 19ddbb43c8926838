"""A setting the engine refuses ends `sluice serve engine` with exit status 2 and the reason in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.engine.conftest import TEST_DEVICE


def test_a_context_length_the_pool_cannot_hold_stops_the_engine_with_its_numbers(llama_dir: Path) -> None:
    argv = [sys.executable, "-m", "sluice.cli", "serve", "engine", "--model", str(llama_dir), "--port", "0"]
    argv += ["--device", TEST_DEVICE, "--num-kv-blocks", "4"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "context length 512" in last and "4 blocks of 16 tokens hold 64 tokens" in last
