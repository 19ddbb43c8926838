"""`Stack`: the four sluice services as child processes of a benchmark (by the launcher's plan) on free
loopback ports. Entering returns once they answer (RuntimeError with a child's last lines otherwise),
leaving stops every process (SIGTERM, then SIGKILL); enter it outside a running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Self

import psutil

from services.common.settings import env_name, flag_name
from sluice.launcher import parse_args
from sluice.plan import Child, child_env, plan_children, replica_count
from sluice.ports import free_port_run
from sluice.supervise import Supervisor, with_nice

TAIL_LINES = 20  # lines of a failed child's output quoted in the error
POLL_S = 0.2


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a child's output file ("" when it wrote nothing)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (0.0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of the last `name VALUE` in `flags` (the one argparse keeps), None when absent."""
    values = [flags[k + 1] for k in range(len(flags) - 1) if flags[k] == name]
    return values[-1] if values else None


@dataclass(frozen=True)
class StackOptions:
    """How a `Stack` runs the pipeline."""

    model: str  # model directory
    batching: str = "continuous"  # engine --batching
    engine_flags: tuple[str, ...] = ()  # extra engine flags
    host: str = "127.0.0.1"
    metrics: bool = True  # tokenizer/engine/detokenizer --metrics-port on free ports
    env: Mapping[str, str] | None = None  # extra environment for every child
    engines: int = 1  # engine replicas (sluice up --engines; 0: its default, auto)
    up_flags: tuple[str, ...] = ()  # more `sluice up` flags, e.g. ("--engine-threads", "1")
    startup_timeout_s: float = 300.0


class _LoggedSupervisor(Supervisor):
    """The launcher's supervisor with each child's stdout and stderr written to `log_dir/NAME.log`."""

    def __init__(self, children: list[Child], env: dict[str, str], log_dir: Path) -> None:
        super().__init__(children, env)
        self.log_dir, self._logs = log_dir, list[IO[bytes]]()

    def start(self) -> None:
        for child in self.children:
            self._logs.append(log := (self.log_dir / f"{child.name}.log").open("wb"))
            nice = with_nice(None, child.nice)
            command = self.command(child)
            out = {"stdout": log, "stderr": subprocess.STDOUT}
            self.procs[child.name] = subprocess.Popen(command, env=self.env, preexec_fn=nice, **out)

    def failure(self, name: str, what: str) -> RuntimeError:
        """RuntimeError "`name` `what`" quoting the child's last lines of output."""
        output = tail(self.log_dir / f"{name}.log")
        quoted = f"; its last output:\n{output}" if output else " (it wrote nothing)"
        return RuntimeError(f"{name} {what}{quoted}")

    def death(self) -> RuntimeError | None:
        """The error to raise for a child that has exited, naming it and quoting its output; or None."""
        dead = self.dead_child()
        return None if dead is None else self.failure(dead[0], f"exited with code {dead[1]} during start-up")

    def stop(self) -> None:
        super().stop()
        for log in self._logs:
            log.close()


class Stack:
    """The four sluice services as children of this process, on ports of `options.host` chosen when the
    Stack is made; ready once every one answers its gRPC health check and the gateway's `/readyz`."""

    def __init__(self, options: StackOptions) -> None:
        self.options, host, engines = options, options.host, options.engines
        flags = ["--model", options.model, "--host", host]
        flags += ["--engines", str(engines)] if engines else []
        flags += ["--batching", options.batching] if options.batching else []
        plan = parse_args([*flags, *options.up_flags])
        # Ports once the plan has counted the replicas (`--engines auto` resolved): a run per stage
        # replica after the gateway's gRPC port, and one metrics port per replica.
        replicas = replica_count(plan)
        plan.port, plan.grpc_base_port = free_port_run(1, host), free_port_run(1 + replicas, host)
        plan.metrics_base_port = free_port_run(replicas, host) if options.metrics else 0
        self.http_url = f"http://{host}:{plan.port}"
        self.openai_url = f"{self.http_url}/v1"
        self.grpc_address = f"{host}:{plan.grpc_base_port}"
        more = options.engine_flags
        self._children = [
            dataclasses.replace(c, flags=(*c.flags, *more)) if c.kind == "engine" and more else c
            for c in plan_children(plan, options.model)
        ]
        self._env = child_env(plan, {**os.environ, **(options.env or {})})
        self.metrics_urls: dict[str, str] = {"gateway": f"{self.http_url}/metrics"}
        if options.metrics:
            names = [c.name for c in self._children if c.kind != "gateway"]  # in port order
            base = plan.metrics_base_port
            self.metrics_urls |= {n: f"http://{host}:{base + k}/metrics" for k, n in enumerate(names)}
        self.pids: dict[str, int] = {}
        self._supervisor: _LoggedSupervisor | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> None:
        """Starts the children and waits for every child's gRPC health check, then for the gateway's
        /readyz (every upstream SERVING as the gateway sees it); on failure stops them and raises."""
        self._tmp = tempfile.TemporaryDirectory(prefix="sluice-stack-")
        supervisor = self._supervisor = _LoggedSupervisor(self._children, self._env, Path(self._tmp.name))
        timeout = self.options.startup_timeout_s
        try:
            supervisor.start()
            self.pids = {name: proc.pid for name, proc in supervisor.procs.items()}
            deadline = time.monotonic() + timeout
            try:
                asyncio.run(supervisor.wait_all_healthy(self.options.host, timeout))
            except RuntimeError as exc:
                if (failure := supervisor.death()) is None:
                    raise
                raise failure from exc
            except TimeoutError as exc:
                raise RuntimeError(f"the sluice stack did not become healthy: {exc}") from exc
            while _http_status(ready := f"{self.http_url}/readyz") != 200:
                if (failure := supervisor.death()) is not None:
                    raise failure
                if time.monotonic() > deadline:
                    raise supervisor.failure("gateway", f"was not ready at {ready} in time")
                time.sleep(POLL_S)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops every child started (SIGTERM, SIGKILL after a grace period; idempotent) and removes
        their output files."""
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def setup(self) -> str:
        """How the engines run, for a table's note: "1 engine, 2 threads" or "2 engines, 1 thread each",
        then the dtype where one is asked for (the engines' --dtype, else SLUICE_DTYPE in their
        environment)."""
        engines = [c for c in self._children if c.kind == "engine"]
        flags = engines[0].flags if engines else ()
        threads = flag_value(flags, flag_name("threads"))
        many = len(engines) > 1
        text = f"{len(engines)} engine{'s' if many else ''}"
        if threads is not None:
            text += f", {threads} thread{'' if threads == '1' else 's'}{' each' if many else ''}"
        dtype = flag_value(flags, flag_name("dtype")) or self._env.get(env_name("dtype"))
        return f"{text}, {dtype}" if dtype else text

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds each service has used so far (with its worker processes)."""
        return {name: process_cpu_s(pid) for name, pid in self.pids.items()}


def _http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status of GET `url`, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, TimeoutError):
        return None
