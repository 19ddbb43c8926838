"""`sluice up`: the whole pipeline on one host, as four child processes.

Starts tokenizer, engine, detokenizer and gateway on 127.0.0.1 (gateway HTTP on --port, gateway gRPC
on --grpc-base-port, the three stages on the next three ports), waits until every one answers its
health check, prints the chat URL, and then watches: SIGINT/SIGTERM stop all children cleanly
(SIGTERM, then SIGKILL after a grace period); a child that dies is named and the launcher exits 1.

The engine shares this host's cores with the other three services and the clients, so it gets
`--threads` = one less than the cores (at least one; `--engine-threads` overrides), and every child
runs with `OMP_WAIT_POLICY=PASSIVE` unless the environment sets it: torch's OpenMP workers then sleep
at a barrier instead of spinning for milliseconds. On the 2-core development machine a two-thread
engine whose workers spun fell to under 100 output tokens/s as soon as another process was busy, while
one thread (1,395 tok/s in-process) matched two on a quiet machine (1,362): the measurement is in
docs/architecture.md.

Observability: `--otlp-endpoint URL` and `--trace-console` reach every child as the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_TRACES_EXPORTER` variables; `--metrics-base-port N` gives the
tokenizer, engine and detokenizer `/metrics` on ports N, N+1, N+2 (the gateway serves its own on --port).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.grpc_server import wait_healthy

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Child:
    """One service process: its name, the gRPC port its health check answers on, its flags."""

    name: str
    grpc_port: int
    flags: tuple[str, ...]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice up", description=__doc__.strip().split("\n")[0])
    add = parser.add_argument
    add("--model", default="", help="local Hugging Face model directory (default: the embedded model)")
    add("--host", default="127.0.0.1", help="address every service binds (default: 127.0.0.1)")
    add("--port", type=int, default=8000, help="gateway HTTP port: chat page, WebSocket, /healthz")
    parser.add_argument(
        "--grpc-base-port",
        type=int,
        default=50050,
        help="gateway gRPC port; tokenizer, engine, detokenizer take the next three (default: 50050)",
    )
    add("--batching", default=None, help="engine batching policy: continuous | dynamic | static")
    add("--device", default=None, help="engine device: auto | cpu | cuda")
    add("--engine-threads", type=int, default=0, metavar="N",
        help="engine torch threads (default: one less than the cores, at least 1)")
    parser.add_argument(
        "--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, help="seconds to wait for all services"
    )
    add("--otlp-endpoint", default="", help="export every service's spans over OTLP to this URL "
        "(e.g. http://127.0.0.1:4317; OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf for OTLP/HTTP)")
    add("--trace-console", action="store_true", help="print every finished span on the console")
    add("--metrics-base-port", type=int, default=0,
        help="tokenizer, engine, detokenizer serve /metrics on this port and the next two (0 = none)")
    return parser.parse_args(argv)


def resolve_model(model: str) -> str:
    """The model directory every child serves: the given one, or the embedded chat model (made and
    cached on first use, with a progress bar)."""
    if model:
        path = Path(model).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(f"sluice up: {path} is not a Hugging Face model directory (no config.json)")
        return str(path)
    from sluice.model.tiny import default_model_dir

    return str(default_model_dir())


def default_engine_threads() -> int:
    """Torch threads for an engine that shares the host with the rest of the pipeline."""
    return max(1, (os.cpu_count() or 1) - 1)


def child_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The children's environment: `env` plus the OTEL_* variables the tracing flags stand for, and
    OpenMP workers that wait passively (the services share the host's cores)."""
    env = dict(env)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
    if args.trace_console:
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        env["OTEL_TRACES_EXPORTER"] = "console,otlp" if endpoint else "console"
    return env


def _metrics_flags(args: argparse.Namespace, offset: int) -> tuple[str, ...]:
    if args.metrics_base_port <= 0:
        return ()
    return ("--metrics-port", str(args.metrics_base_port + offset))


def access_line(environ: Mapping[str, str]) -> str:
    """Says whether the gateway's APIs need a key (SLUICE_API_KEYS / SLUICE_API_KEYS_FILE)."""
    if environ.get("SLUICE_API_KEYS") or environ.get("SLUICE_API_KEYS_FILE"):
        return "API keys required (Authorization: Bearer KEY)"
    return "no API key configured: every API is open to anyone who can reach these ports"


def plan_children(args: argparse.Namespace, model: str) -> list[Child]:
    base = args.grpc_base_port
    tok, eng, detok = base + 1, base + 2, base + 3
    common = ("--host", args.host)
    engine_extra: tuple[str, ...] = ("--threads", str(args.engine_threads or default_engine_threads()))
    if args.batching:
        engine_extra += ("--batching", args.batching)
    if args.device:
        engine_extra += ("--device", args.device)
    return [
        Child("tokenizer", tok, (*common, "--port", str(tok), "--model", model, *_metrics_flags(args, 0))),
        Child("engine", eng, (*common, "--port", str(eng), "--model", model, *engine_extra,
                              *_metrics_flags(args, 1))),
        Child("detokenizer", detok, (*common, "--port", str(detok), "--model", model,
                                     *_metrics_flags(args, 2))),
        Child(
            "gateway",
            base,
            (
                *common,
                "--port", str(args.port),
                "--grpc-port", str(base),
                "--tokenizer", f"{args.host}:{tok}",
                "--engine", f"{args.host}:{eng}",
                "--detokenizer", f"{args.host}:{detok}",
            ),
        ),
    ]


class Supervisor:
    """Owns the child processes: starts them, waits for health, stops them all exactly once."""

    def __init__(self, children: list[Child], env: dict[str, str] | None = None) -> None:
        self.children = children
        self.env = os.environ.copy() if env is None else env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        for child in self.children:
            self.procs[child.name] = subprocess.Popen(self.command(child), env=self.env)

    @staticmethod
    def command(child: Child) -> list[str]:
        """The command line that runs `child`."""
        return [sys.executable, "-m", "sluice.cli", "serve", child.name, *child.flags]

    def dead_child(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    async def wait_all_healthy(self, host: str, timeout_s: float) -> None:
        """Returns when every child is SERVING; raises RuntimeError naming a child that died first."""
        checks = [
            asyncio.ensure_future(wait_healthy(f"{host}:{child.grpc_port}", timeout_s=timeout_s))
            for child in self.children
        ]
        try:
            while not all(task.done() for task in checks):
                dead = self.dead_child()
                if dead is not None:
                    raise RuntimeError(f"{dead[0]} exited with code {dead[1]} during start-up")
                await asyncio.wait(checks, timeout=0.2)
            for task in checks:
                task.result()
        finally:
            for task in checks:
                task.cancel()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"sluice up: {name} did not stop in {STOP_GRACE_S:.0f}s; killing it", file=sys.stderr)
                proc.kill()
                proc.wait()


async def _watch(supervisor: Supervisor, stop: asyncio.Event) -> int:
    """Waits for a stop signal (returns 0) or a dead child (returns 1)."""
    while not stop.is_set():
        dead = supervisor.dead_child()
        if dead is not None:
            print(f"sluice up: {dead[0]} exited with code {dead[1]}; stopping the others", file=sys.stderr)
            return 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)
    return 0


async def _run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    supervisor = Supervisor(plan_children(args, model), child_env(args, os.environ.copy()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor.start()
    try:
        startup = asyncio.ensure_future(supervisor.wait_all_healthy(args.host, args.startup_timeout))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([startup, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            startup.cancel()
            return 0
        stopped.cancel()
        try:
            startup.result()
        except (RuntimeError, TimeoutError) as exc:
            print(f"sluice up: {exc}", file=sys.stderr)
            return 1
        print(f"sluice is up: chat at http://{args.host}:{args.port}/  (model: {model})", flush=True)
        print(f"  gateway gRPC {args.host}:{args.grpc_base_port}; Ctrl-C stops everything", flush=True)
        print(f"  {access_line(os.environ)}", flush=True)
        return await _watch(supervisor, stop)
    finally:
        supervisor.stop()


def main(argv: list[str]) -> int:
    args = _parse(argv)
    return asyncio.run(_run(args))
