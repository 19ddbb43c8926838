"""One real sluice stack for the reliability tests: tokenizer, engine, detokenizer and gateway as four
processes on free loopback ports, started with `sluice serve NAME` as `sluice up` starts them, on the
tiny test model; and what the tests read from it: the engine's figures, the gateway's in-flight count,
every service's health, resident memory and open descriptors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import engine_pb2, engine_pb2_grpc
from sluice.plan import default_engine_threads
from sluice.ports import free_port

SERVICES = ("gateway", "tokenizer", "engine", "detokenizer")
WAIT_S = 30.0  # upper bound on one wait for a reply; replies normally come in milliseconds
QUIET_WITHIN_S = 60.0  # upper bound on the engine and gateway settling after a burst of work
POLL_S = 0.05
STARTUP_S = 240.0
STOP_S = 15.0
GRACE_S = 1.0  # how long a stopping service lets calls in flight finish


@dataclass
class Quiet:
    """The figures that say nothing is left running."""

    running: int
    waiting: int
    free_blocks: int
    num_blocks: int
    gateway_in_flight: float

    @property
    def idle(self) -> bool:
        return (
            self.running == 0
            and self.waiting == 0
            and self.free_blocks == self.num_blocks
            and self.gateway_in_flight == 0
        )


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, free now and never handed out before in this process."""
    return [free_port() for _ in range(count)]


class RealStack:
    """The four services as child processes of the test (`start`, `stop`), and ways to look into them."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model = model_dir.name  # the served model name: the model directory's name
        self.host = "127.0.0.1"
        http, *grpc_ports = free_ports(5)
        self.http_url = f"http://{self.host}:{http}"
        self.ws_url = f"ws://{self.host}:{http}/v1/ws"
        self.ports = dict(zip(SERVICES, grpc_ports, strict=True))
        self._model_dir = model_dir
        self._log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # ----- processes

    def _flags(self, service: str) -> list[str]:
        own = ["--host", self.host, "--grace-s", str(GRACE_S)]
        if service == "gateway":
            upstreams = [f"--{name}={self.address(name)}" for name in SERVICES[1:]]
            return [*own, "--port", self.http_url.rsplit(":", 1)[1], "--grpc-port", str(self.ports[service]),
                    *upstreams]  # fmt: skip
        own += ["--port", str(self.ports[service]), "--model", str(self._model_dir)]
        if service == "engine":  # as `sluice up` runs it beside the other services
            own += ["--threads", str(default_engine_threads())]
        return own

    def start(self) -> None:
        """Starts the four services and returns once each is SERVING and the gateway is ready."""
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        for service in SERVICES[::-1]:
            log = (self._log_dir / f"{service}.log").open("wb")
            command = [sys.executable, "-m", "sluice.cli", "serve", service, *self._flags(service)]
            self.procs[service] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
        deadline = time.monotonic() + STARTUP_S
        for service in SERVICES:
            while not self._serving(service):
                self._check_alive()
                assert time.monotonic() < deadline, f"{service} not serving after {STARTUP_S:g}s"
                time.sleep(POLL_S)
        while _http_status(f"{self.http_url}/readyz") != 200:
            self._check_alive()
            assert time.monotonic() < deadline, f"the gateway not ready after {STARTUP_S:g}s"
            time.sleep(POLL_S)

    def _serving(self, service: str) -> bool:
        with grpc.insecure_channel(self.address(service)) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _check_alive(self) -> None:
        for service, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise AssertionError(f"{service} exited with code {code}:\n{self.log_tail(service)}")

    def log_tail(self, service: str, lines: int = 30) -> str:
        text = (self._log_dir / f"{service}.log").read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to each service, SIGKILL to any still running after the grace period."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ----- looking in

    def address(self, service: str) -> str:
        """The gRPC address of a service ("gateway" is the public API)."""
        return f"{self.host}:{self.ports[service]}"

    async def engine_stats(self) -> engine_pb2.StatsResponse:
        async with grpc.aio.insecure_channel(self.address("engine")) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            return await stub.Stats(engine_pb2.StatsRequest(), timeout=WAIT_S)

    def gateway_in_flight(self) -> float:
        """The gateway's `sluice_gateway_requests_in_flight` gauge, from its /metrics."""
        with urllib.request.urlopen(f"{self.http_url}/metrics", timeout=WAIT_S) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith("sluice_gateway_requests_in_flight "):
                return float(line.split()[1])
        raise AssertionError("the gateway's /metrics has no sluice_gateway_requests_in_flight")

    async def quiet(self) -> Quiet:
        stats = await self.engine_stats()
        in_flight = await asyncio.to_thread(self.gateway_in_flight)
        return Quiet(stats.running, stats.waiting, stats.free_blocks, stats.num_blocks, in_flight)

    async def wait_quiet(self, within_s: float = QUIET_WITHIN_S) -> Quiet:
        """Polls until the engine runs and waits for nothing, its KV free list is full and the gateway
        has nothing in flight; fails with the last figures after `within_s`."""
        deadline = time.monotonic() + within_s
        while not (figures := await self.quiet()).idle:
            assert time.monotonic() < deadline, f"not quiet after {within_s:g}s: {figures}"
            await asyncio.sleep(POLL_S)
        return figures

    async def health(self) -> dict[str, str]:
        """Each service's grpc.health.v1 status name (gateway: its public gRPC server's)."""
        statuses: dict[str, str] = {}
        for service in SERVICES:
            async with grpc.aio.insecure_channel(self.address(service)) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=WAIT_S
                )
            statuses[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return statuses

    def resources(self) -> dict[str, dict[str, int]]:
        """Per service: resident memory (bytes), open descriptors and threads, now."""
        figures = {}
        for service in SERVICES:
            proc = psutil.Process(self.procs[service].pid)
            with proc.oneshot():
                figures[service] = {"rss": proc.memory_info().rss, "fds": proc.num_fds(),
                                    "threads": proc.num_threads()}  # fmt: skip
        return figures


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@pytest.fixture(scope="package")
def real_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealStack]:
    """The four services on free ports, started once for the modules of this package that run (each
    test leaves them quiet) and stopped after the last."""
    stack = RealStack(tiny_model_dir, tmp_path_factory.mktemp("stack-logs"))
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def sse_texts(lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The text of an OpenAI completions SSE stream (its `data:` lines) and its parsed events."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(choice.get("text") or "" for event in events for choice in event.get("choices", []))
    return text, events
