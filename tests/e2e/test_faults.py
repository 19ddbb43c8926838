"""Faults that leave a stage's process alive, and deaths around start-up, under a real `sluice up`:

- an engine whose step loop failed (the fault hook: SLUICE_FAULT_INJECTION=1 and SIGUSR1) recovers in
  its process, within its budget (loop_recoveries, 3 within 60 s); one failure more leaves it up and
  NOT_SERVING for good, and the launcher's health checks find it and restart it;
- a SIGSTOPped stage answers nothing; the launcher sends SIGTERM, then SIGKILL, and restarts it;
- a stage killed after it served but before `sluice up` said ready is restarted, not a failed start-up;
- children do not outlive a launcher killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.plan import STAGES
from tests.e2e.conftest import Pipeline, launch_pipeline, start_pipeline
from tests.e2e.test_restart import _one_generation, _wait_ready, standbys

pytestmark = pytest.mark.e2e

UNHEALTHY_RESTART_S = 2.0
FLAGS = ("--standby", "1", "--unhealthy-restart-s", str(UNHEALTHY_RESTART_S), "--health-timeout-s", "1")
FAULTS_ON = {"SLUICE_FAULT_INJECTION": "1"}
WAIT_S = 120.0  # generous: two shared cores, other tests running


@pytest.fixture(scope="module")
def faulty(tiny_model_dir: Path) -> Iterator[Pipeline]:
    running = start_pipeline(tiny_model_dir, *FLAGS, env=FAULTS_ON)
    yield running
    code = running.stop()
    assert code == 0, running.output()


def _status(address: str) -> str:
    """The grpc.health.v1 status name of `address`, or "NO ANSWER"."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.RpcError:
            return "NO ANSWER"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _recovered(pipeline: Pipeline) -> None:
    """/readyz says ready and a new generation completes."""
    async with httpx.AsyncClient(base_url=pipeline.http_url, timeout=WAIT_S) as client:
        await _wait_ready(client)
    done = await _one_generation(pipeline.ws_url)
    assert done["type"] == "done" and done["usage"]["completion_tokens"] > 0, done


def _others_unchanged(pipeline: Pipeline, before: dict[str, int], name: str) -> None:
    now = pipeline.pids()
    assert {k: v for k, v in now.items() if k != name} == {k: v for k, v in before.items() if k != name}


def test_an_engine_whose_loop_failed_recovers_then_past_its_budget_is_restarted(faulty: Pipeline) -> None:
    """Three loop failures recover in the engine's own process (same pid, SERVING again, a generation
    completes); the fourth within 60 s leaves it NOT_SERVING for good, and the launcher restarts it."""
    before = faulty.pids()
    engine = psutil.Process(before["engine"])
    address = f"127.0.0.1:{faulty.grpc_base_port + 2}"
    for n in range(1, 4):
        engine.send_signal(signal.SIGUSR1)
        recovered = f"(pid {engine.pid}): step loop recovered (recovery {n} of 3 allowed within 60s)"
        deadline = time.monotonic() + WAIT_S
        while recovered not in faulty.output():
            assert time.monotonic() < deadline and engine.is_running(), faulty.output()[-3000:]
            time.sleep(0.05)
        asyncio.run(_recovered(faulty))
    assert faulty.pids() == before
    engine.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + WAIT_S
    while (status := _status(address)) != "NOT_SERVING":  # alive and failed, until the launcher acts
        assert time.monotonic() < deadline and engine.is_running(), status
        time.sleep(0.05)
    faulty.wait_for_start("engine", before["engine"], WAIT_S)
    output = faulty.output()
    assert "engine has not answered SERVING for" in output
    assert "engine exited with code" in output
    asyncio.run(_recovered(faulty))
    _others_unchanged(faulty, before, "engine")


def test_a_stopped_stage_is_killed_and_restarted(faulty: Pipeline) -> None:
    before = faulty.pids()
    detokenizer = psutil.Process(before["detokenizer"])
    detokenizer.suspend()  # SIGSTOP: it answers nothing
    try:
        faulty.wait_for_start("detokenizer", before["detokenizer"], WAIT_S)
    finally:
        if detokenizer.is_running():
            detokenizer.resume()
    assert not detokenizer.is_running() or detokenizer.status() == psutil.STATUS_ZOMBIE
    assert "detokenizer has not answered SERVING for" in faulty.output()
    asyncio.run(_recovered(faulty))
    _others_unchanged(faulty, before, "detokenizer")


def test_a_stage_killed_before_up_is_ready_is_restarted_and_no_child_outlives_up(
    tiny_model_dir: Path,
) -> None:
    """The tokenizer serves long before the engine has loaded its model: killed then, it is restarted
    and `sluice up` comes up. Then `sluice up` itself is SIGKILLed: every child stops on its own."""
    running = launch_pipeline(tiny_model_dir, "--standby", "1")
    try:
        tokenizer = f"127.0.0.1:{running.grpc_base_port + 1}"
        deadline = time.monotonic() + WAIT_S
        while _status(tokenizer) != "SERVING":
            assert time.monotonic() < deadline and running.proc.poll() is None, running.output()
            time.sleep(0.05)
        assert not running.ready.is_set(), "the engine was ready first: nothing was starting any more"
        first = running.pids()["tokenizer"]
        psutil.Process(first).send_signal(signal.SIGKILL)
        assert running.ready.wait(WAIT_S) and running.proc.poll() is None, running.output()
        assert running.pids()["tokenizer"] != first
        assert re.search(
            r"tokenizer exited with code -9 \(SIGKILL\)( during start-up)?; restarting", running.output()
        )
        asyncio.run(_recovered(running))
        deadline = time.monotonic() + WAIT_S
        while standbys(running).keys() != set(STAGES):  # a standby per stage kind, after the ready line
            assert time.monotonic() < deadline, running.output()
            time.sleep(0.05)
        children = psutil.Process(running.proc.pid).children()  # the replicas and the standbys
        assert len([c for c in children if c.pid in running.pids().values()]) == 4
    except BaseException:
        running.stop(signal.SIGTERM)
        raise
    running.proc.send_signal(signal.SIGKILL)
    running.proc.wait(timeout=WAIT_S)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], alive
