"""Warm standbys under a real `sluice up` (`--standby N`, default 1): a killed replica is restarted by
handing its arguments to the standby of its kind (the restarted replica's pid is the standby's), a new
standby is started once the restarted replica has served, and `--standby 0` restarts cold with no
standby at all."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sluice.launcher import STAGES
from tests.e2e.conftest import Pipeline, start_pipeline
from tests.e2e.test_faults import WAIT_S, _others_unchanged, _recovered, _status
from tests.e2e.test_restart import standbys

pytestmark = pytest.mark.e2e


def ready(standby: psutil.Process) -> bool:
    """A standby is ready once its imports are done: it has then closed the pipe it says so on (Linux)."""
    return not os.path.exists(f"/proc/{standby.pid}/fd/{standby.cmdline()[-1]}")


def wait_for(condition, what: str, pipeline: Pipeline):  # type: ignore[no-untyped-def]
    """Polls `condition()` until it returns something true; returns that."""
    deadline = time.monotonic() + WAIT_S
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}:\n{pipeline.output()[-3000:]}"
        time.sleep(0.05)
    return found


@pytest.fixture(scope="module")
def warm(tiny_model_dir: Path) -> Iterator[Pipeline]:
    running = start_pipeline(tiny_model_dir, "--unhealthy-restart-s", "2", "--health-timeout-s", "1")
    yield running
    code = running.stop()
    assert code == 0, running.output()


def test_a_killed_replica_is_restarted_from_the_standby_and_a_new_standby_follows(warm: Pipeline) -> None:
    spares = wait_for(lambda: (found := standbys(warm)).keys() == set(STAGES) and found, "no standbys", warm)
    assert all(len(procs) == 1 for procs in spares.values()), spares  # --standby 1: one per stage kind
    spare = spares["engine"][0]
    wait_for(lambda: ready(spare), "the engine standby never became ready", warm)
    before = warm.pids()
    psutil.Process(before["engine"]).send_signal(signal.SIGKILL)
    pid = warm.wait_for_start("engine", before["engine"], WAIT_S)
    assert pid == spare.pid
    assert f"engine started (pid {pid}) from a standby" in warm.output()
    address = f"127.0.0.1:{warm.grpc_base_port + 2}"
    started_early = []
    while _status(address) != "SERVING":  # no new engine standby before the restarted engine serves
        started_early += [p.pid for p in standbys(warm).get("engine", [])]
        assert spare.is_running(), warm.output()[-3000:]
        time.sleep(0.05)
    assert started_early == []
    new = wait_for(lambda: standbys(warm).get("engine"), "no new engine standby", warm)
    assert [p.pid for p in new] != [spare.pid]
    assert {kind: [p.pid for p in procs] for kind, procs in standbys(warm).items() if kind != "engine"} == {
        kind: [p.pid for p in procs] for kind, procs in spares.items() if kind != "engine"
    }
    asyncio.run(_recovered(warm))
    _others_unchanged(warm, before, "engine")


def test_standby_0_restarts_cold_and_starts_no_standby(tiny_model_dir: Path) -> None:
    pipeline = start_pipeline(tiny_model_dir, "--standby", "0")
    try:
        before = pipeline.pids()
        psutil.Process(before["engine"]).send_signal(signal.SIGKILL)
        pid = pipeline.wait_for_start("engine", before["engine"], WAIT_S)
        asyncio.run(_recovered(pipeline))
        assert f"engine started (pid {pid})\n" in pipeline.output()
        assert standbys(pipeline) == {}
        assert "standby" not in " ".join(psutil.Process(pid).cmdline())
    finally:
        code = pipeline.stop()
    assert code == 0, pipeline.output()
