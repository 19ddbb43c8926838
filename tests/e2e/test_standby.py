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

import httpx
import psutil
import pytest

from sluice.plan import STAGES
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
    running = start_pipeline(
        tiny_model_dir, "--standby", "1", "--unhealthy-restart-s", "2", "--health-timeout-s", "1"
    )
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


def test_the_only_engine_killed_right_after_the_ready_line_drops_readiness_and_a_request_waits_for_it(
    tiny_model_dir: Path,
) -> None:
    """Issue 28 defect 7. The engine's standby starts with the children and the ready line waits for it,
    so a restart right after the ready line is a take-over; /readyz answers 503 from the moment the
    launcher has seen the engine die until its restart starts (no cached 200); a request sent then,
    while the engine is down, waits for the restarted one (the gateway's upstream wait) and completes,
    with the same text as the same request afterwards."""
    running = start_pipeline(tiny_model_dir, "--standby", "1")
    body = {"model": running_model(running), "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}

    async def scenario() -> tuple[list[int], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=running.http_url, timeout=WAIT_S) as http:
            assert (await http.get("/readyz")).status_code == 200  # a fresh cached answer
            before = running.pids()["engine"]
            psutil.Process(before).send_signal(signal.SIGKILL)
            await asyncio.to_thread(wait_for, lambda: "engine exited with code -9" in running.output(),
                                    "the launcher never saw the engine die", running)  # fmt: skip
            answers, while_down = [], None
            while running.pids()["engine"] == before:  # until the restart starts
                answers.append((await http.get("/readyz")).status_code)
                if while_down is None:  # sent once the death is known, while the engine is down
                    while_down = asyncio.ensure_future(http.post("/v1/completions", json=body))
                await asyncio.sleep(0.02)
            assert while_down is not None, "the restart started before anything was asked"
            during = await while_down
            await _recovered(running)
            return answers, during, await http.post("/v1/completions", json=body)

    try:
        answers, during, after = asyncio.run(scenario())
    finally:
        code = running.stop()
    assert answers and set(answers) == {503}, answers
    assert during.status_code == 200, during.text
    assert (
        after.status_code == 200 and during.json()["choices"][0]["text"] == after.json()["choices"][0]["text"]
    )
    pid = running.pids()["engine"]
    assert f"engine started (pid {pid}) from a standby" in running.output(), running.output()[-3000:]
    assert code == 0, running.output()[-3000:]


def running_model(pipeline: Pipeline) -> str:
    return httpx.get(f"{pipeline.http_url}/v1/models", timeout=WAIT_S).json()["data"][0]["id"]
