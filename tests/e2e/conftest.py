"""Runs `sluice up` as a real subprocess on free loopback ports and waits for its ready line
(printed only after every service has answered its health check). The launcher prints a line for
every child it starts, with the child's pid; `Pipeline.pids()` reads them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sluice.launcher import parse_args
from sluice.plan import replica_count, usable_cores
from sluice.ports import free_port_run

STARTUP_DEADLINE_S = 300.0
READY_MARK = "sluice is up"
STARTED = re.compile(r"sluice up: ([\w-]+) started \(pid (\d+)\)")


def free_ports(stage_ports: int = 3) -> tuple[int, int]:
    """An HTTP port and a gRPC base port whose next `stage_ports` ports (one per stage replica: see
    `sluice up --help`) are free too; never handed out before in this process (sluice.ports)."""
    return free_port_run(1), free_port_run(stage_ports + 1)


def stage_port_count(extra: tuple[str, ...]) -> int:
    """The stage replicas (hence gRPC ports after the base) that `sluice up` with `extra` may start:
    with `--engines auto` one engine per usable core, the most it resolves to (it counts one less on a
    busy host, and the load may change before the launcher counts)."""
    args = parse_args(list(extra))
    engines = args.engines if args.engines_why == "--engines" else max(args.engines, usable_cores())
    return replica_count(args) - args.engines + engines


@dataclass
class Pipeline:
    """A running `sluice up`: its process, ports, and everything it printed so far."""

    proc: subprocess.Popen[str]
    http_port: int
    grpc_base_port: int
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    printed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}/v1/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def api_url(self, api: str) -> str:
        """Where a client of `api` (openai, openai-chat, ws or grpc) reaches the pipeline."""
        if api == "grpc":
            return f"127.0.0.1:{self.grpc_base_port}"
        return self.ws_url if api == "ws" else f"{self.http_url}/v1"

    def output(self) -> str:
        return "".join(self.lines)

    def pids(self) -> dict[str, int]:
        """Child name → pid of its latest start, from the launcher's start lines."""
        with self.printed:
            return {m[1]: int(m[2]) for line in self.lines if (m := STARTED.search(line))}

    def wait_for_start(self, name: str, other_than: int, timeout_s: float) -> int:
        """Waits until the launcher reports a start of `name` with a pid other than `other_than`;
        returns that pid. Raises TimeoutError with the output so far."""
        deadline = time.monotonic() + timeout_s
        with self.printed:
            while (pid := self.pids().get(name, other_than)) == other_than:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"{name} was not started again:\n{self.output()}")
                self.printed.wait(left)
        return pid

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)


LAUNCHED: list[Pipeline] = []
"""Every `sluice up` the tests started, each the leader of a process group of its own (its children and
standbys are in it): `stop_left_behind` ends what a failed test left running."""


def stop_left_behind(pipelines: list[Pipeline]) -> None:
    """Stops each of `pipelines` still running (SIGTERM, as a user would), then SIGKILLs what is left
    of its process group: a test that failed before its own stop leaves no service running."""
    for pipeline in pipelines:
        if pipeline.proc.poll() is None:
            pipeline.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pipeline.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pipeline.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pipeline.proc.wait(timeout=30)


def _pump(pipeline: Pipeline) -> None:
    assert pipeline.proc.stdout is not None
    for line in pipeline.proc.stdout:
        with pipeline.printed:
            pipeline.lines.append(line)
            pipeline.printed.notify_all()
        if READY_MARK in line:
            pipeline.ready.set()
    with pipeline.printed:
        pipeline.printed.notify_all()
    pipeline.ready.set()


def launch_pipeline(model_dir: Path, *extra: str, env: Mapping[str, str] | None = None) -> Pipeline:
    """Starts `sluice up` (with `env` added to the environment) and returns at once; `ready` is set
    when it prints its ready line or exits. Without `--standby` in `extra` it runs with none: a warm
    standby costs every start an engine's imports, and only the tests of standbys, restarts, faults
    and chaos need one (they pass `--standby 1`, `sluice up`'s default). Without `--engines` it runs
    one engine: `sluice up`'s default, one per core, costs every start a model load per core, and
    the tests of replicas and of the default pass their own."""
    if "--standby" not in extra:
        extra = (*extra, "--standby", "0")
    if not any(flag.split("=")[0] == "--engines" for flag in extra):
        extra = (*extra, "--engines", "1")
    http, base = free_ports(stage_port_count(extra))
    cmd = [
        sys.executable,
        "-m",
        "sluice.cli",
        "up",
        "--model",
        str(model_dir),
        "--port",
        str(http),
        "--grpc-base-port",
        str(base),
        *extra,
    ]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ, start_new_session=True
    )
    pipeline = Pipeline(proc, http, base)
    LAUNCHED.append(pipeline)
    threading.Thread(target=_pump, args=(pipeline,), daemon=True).start()
    return pipeline


def launch_service(*args: str, env: Mapping[str, str] | None = None) -> Pipeline:
    """Starts `sluice serve ARGS` (one service, no launcher) and returns at once, as a `Pipeline` whose
    ports are unknown (0) and whose `ready` is set only when it exits; it is stopped with the test like
    any `sluice up`."""
    cmd = [sys.executable, "-m", "sluice.cli", "serve", *args]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ, start_new_session=True
    )
    service = Pipeline(proc, 0, 0)
    LAUNCHED.append(service)
    threading.Thread(target=_pump, args=(service,), daemon=True).start()
    return service


def start_pipeline(model_dir: Path, *extra: str, env: Mapping[str, str] | None = None) -> Pipeline:
    """Starts `sluice up`; returns once it printed its ready line. Fails the test with the output on
    a start-up failure."""
    pipeline = launch_pipeline(model_dir, *extra, env=env)
    proc = pipeline.proc
    if not pipeline.ready.wait(STARTUP_DEADLINE_S) or proc.poll() is not None:
        pipeline.stop(signal.SIGTERM)
        pytest.fail(f"sluice up did not become ready:\n{pipeline.output()}")
    return pipeline
