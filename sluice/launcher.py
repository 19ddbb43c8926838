"""`sluice up`: the whole pipeline on one host, a child process per stage replica and the gateway.

Starts tokenizer, engine, detokenizer and gateway on 127.0.0.1, waits until every one answers its
health check, prints the chat URL, and then watches: SIGINT/SIGTERM stop all children cleanly
(SIGTERM, then SIGKILL after a grace period). Every start of a child prints a line with its pid
("sluice up: engine started (pid 1234)").

Replicas: `--tokenizers N`, `--engines N`, `--detokenizers N` (default 1 each) start N processes of a
stage, named `engine-1`, `engine-2`, ... when N > 1, and the gateway is given every address of each
stage. The port plan: gateway HTTP on --port; gateway gRPC on --grpc-base-port (B); then the
tokenizers, the engines and the detokenizers, in that order, on consecutive ports from B+1 (with one of
each: B+1, B+2, B+3; with `--engines 2`: tokenizer B+1, engines B+2 and B+3, detokenizer B+4). Every
planned port must be free, or the launcher exits 1 naming the first busy one. The ready line is printed
once every replica is healthy.

A child that exits with status 2 refused its configuration (a bad flag, a model it cannot serve or whose
files are missing, a KV pool too small for one request: `grpc_server.run`, argparse): no restart can
change that, so the launcher says so under the child's own message, stops every child and exits 2. Any
other death (a crash, a signal) is restarted, as compose's `restart:` or Kubernetes would, whether it
had served or was still starting: the launcher names it and its exit code, waits a backoff (0.5 s,
doubling with each restart in the window, at most 8 s, for a run that never served: a crash loop; 0.5 s
after a run that had served), and starts it again; the other children keep running untouched. A child
that dies more than `--max-restarts` times (default 5) within `--restart-window-s` seconds (default 60)
makes the launcher give up: it stops every child and exits 1 naming it. The ready line waits until every
child has answered SERVING once; if that takes longer than `--startup-timeout`, the launcher exits 1
naming the children that never did.

Liveness: every child's grpc.health.v1 status is asked about once a second (the gateway's on its gRPC
port), each check given `--health-timeout-s`. A child that has served and then answers anything but
SERVING, or nothing at all (a hung or SIGSTOPped process), for longer than `--unhealthy-restart-s`
(default 10) is restarted: SIGTERM (and SIGCONT, so a stopped process can act on it), SIGKILL after
KILL_GRACE_S, then the restart policy as for a death. So is a restarted child that has not answered
SERVING within `--startup-timeout` of its restart. An engine whose step loop failed recovers in its
own process, NOT_SERVING for a moment, within its budget (`loop_recoveries`); past it, it stays alive
and NOT_SERVING for good (services/engine/server.py), so this is what replaces it.

Warm standbys: a cold start pays the imports again (the engine's torch, torch._dynamo and transformers:
about 4.5 s of its 5.4 s start on an idle 2-core machine, three times that on a loaded one), so with
`--standby N` (default 1; 0 = off) the launcher keeps N standbys per stage kind: a `Standby` is a child
(`python -m sluice.launcher standby KIND`) that imports what the service will, says so on a pipe and
waits on its stdin. A restart of a replica hands the dead replica's arguments to a ready standby of its
kind, which becomes it (the start line says "from a standby"; its pid is the standby's); with none
ready, the replica starts cold. The engine's standby starts with the children, and the ready line waits
for its imports, so that a restart right after the ready line is a take-over, not a cold start (a cold
engine restart outlasted the gateway's upstream wait: docs/reliability.md has the times). The others
start once the ready line is out, and every standby again for a kind only when every replica of that
kind has answered SERVING; one at a time, the engine's first, each importing at a lower CPU priority
(nice +10, every thread of it raised back when it becomes a replica; where the process may not raise it
back, it imports at the normal priority), so that the spares' imports take at most one core, and only
what the serving replicas leave. They count for nothing in health, print nothing unless they fail, get
SIGTERM when the launcher dies (as children do) and are stopped with the children. A standby that exits
by itself (an import failing, say) turns standbys of its kind off, with a line saying so: no crash loop
of spares.

Every child gets SIGTERM when the launcher dies, even by SIGKILL (Linux: PR_SET_PDEATHSIG), so no
service outlives it. Stopping (SIGINT/SIGTERM) stops the gateway first and then the stages, so the
gateway's generations in flight can finish on stages that are still there. Planned ports must all be
distinct (`--port`, the gRPC ports and the metrics ports): a clash is refused before anything starts,
naming both uses; ports in the kernel's range for outgoing connections' local ports (Linux:
32768-60999 by default, the default gRPC ports included) get a warning, since a connection can take a
stopped child's port and keep its restart from binding.

The engine shares this host's cores with the other three services and the clients, so it gets
`--threads` = one less than the cores (at least one; `--engine-threads` overrides), and every child
runs with `OMP_WAIT_POLICY=PASSIVE` unless the environment sets it: torch's OpenMP workers then sleep
at a barrier instead of spinning for milliseconds. On the 2-core development machine a two-thread
engine whose workers spun fell to under 100 output tokens/s as soon as another process was busy, while
one thread (1,395 tok/s in-process) matched two on a quiet machine (1,362): the measurement is in
docs/architecture.md.

Observability: `--otlp-endpoint URL` and `--trace-console` reach every child as the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_TRACES_EXPORTER` variables; `--metrics-base-port M` gives the
stages `/metrics` on consecutive ports from M in the same order as their gRPC ports (one of each: the
tokenizer on M, the engine on M+1, the detokenizer on M+2; the gateway serves its own on --port).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import CONFIG_ERROR_STATUS, ChannelTls, client_channel, wait_healthy

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
UNHEALTHY_RESTART_S = 10.0  # a served child not SERVING this long is restarted
HEALTH_TIMEOUT_S = 2.0  # one health check's deadline
HEALTH_INTERVAL_S = 1.0  # how often a serving child is asked
KILL_GRACE_S = 1.0  # SIGTERM → SIGKILL for an unhealthy child (it has nothing left to drain well)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CAP_SYS_NICE = 23  # linux/capability.h
EMBEDDED_MODEL_NAME = "tiny"  # the name the gateway serves the embedded model under
WATCH_INTERVAL_S = 0.2


STAGES = ("tokenizer", "engine", "detokenizer")  # the order of their ports
# What a standby imports before it waits: the service's modules and what its start-up imports later (for
# the engine: the executor, hence torch, torch._dynamo through torch.nn.attention, and transformers).
STANDBY_IMPORTS = {
    "tokenizer": ("services.tokenizer.server",),
    "engine": (
        "services.engine.server",
        "services.engine.executor.model_runner",
        "services.engine.executor.sampler",
        "services.engine.executor.grammar_mask",
    ),
    "detokenizer": ("services.detokenizer.server",),
}
STANDBY_DEFAULT = 1
STANDBY_ORDER = ("engine", "tokenizer", "detokenizer")  # which kind's standby starts first
STANDBY_NICE = 10  # added to a standby's nice value while it imports (see `_yield_while_importing`)


@dataclass(frozen=True)
class Child:
    """One service process: its name (`engine`, or `engine-2` for a replica), the gRPC port its
    health check answers on, its flags, and the service it runs (`sluice serve SERVICE`; default: its
    name)."""

    name: str
    grpc_port: int
    flags: tuple[str, ...]
    service: str = ""

    @property
    def kind(self) -> str:
        """The service this child runs: tokenizer, engine, detokenizer or gateway."""
        return self.service or self.name

    @property
    def argv(self) -> list[str]:
        """The `sluice` command's arguments that run this child."""
        return ["serve", self.kind, *self.flags]


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again: after `initial_backoff_s`, doubling with each restart of
    that child within the last `window_s` seconds, at most `max_backoff_s`, unless the run that died
    had served (it came up: no crash loop to slow down, so `initial_backoff_s`); never more than
    `max_restarts` times within `window_s` seconds, served or not."""

    max_restarts: int = 5
    window_s: float = 60.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0


@dataclass
class RestartTracker:
    """The restart history of one child under a `RestartPolicy` (pure: the caller passes the time)."""

    policy: RestartPolicy
    restarts: deque[float] = field(default_factory=deque)

    def on_exit(self, now: float, served: bool = False) -> float | None:
        """The child died at `now` (monotonic seconds), after its run had answered SERVING or not: the
        delay before starting it again, or None when it already had `max_restarts` restarts within
        the window (give up). A returned delay counts as a restart at `now`."""
        while self.restarts and now - self.restarts[0] >= self.policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.max_restarts:
            return None
        delay = self.policy.initial_backoff_s * (1 if served else 2 ** len(self.restarts))
        self.restarts.append(now)
        return min(delay, self.policy.max_backoff_s)

    @property
    def recent(self) -> int:
        """Restarts counted in the window as of the last `on_exit`."""
        return len(self.restarts)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice up", description=__doc__.strip().split("\n")[0])
    add = parser.add_argument
    add(
        "--model",
        default="",
        help="model directory or Hugging Face Hub id ORG/NAME, resolved once from the Hugging Face cache "
        "(downloaded when online and not cached) and shared by every service (default: the embedded model)",
    )
    add("--revision", default="", help="branch, tag or commit of a Hub id in --model (default: main)")
    add(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help=f"model name the APIs answer to (default: {EMBEDDED_MODEL_NAME!r} for the embedded model, "
        "else the directory's name)",
    )
    add("--host", default="127.0.0.1", help="address every service binds (default: 127.0.0.1)")
    add("--port", type=int, default=8000, help="gateway HTTP port: chat page, WebSocket, /healthz")
    parser.add_argument(
        "--grpc-base-port",
        type=int,
        default=50050,
        help="gateway gRPC port B; the tokenizers, engines and detokenizers take consecutive ports from B+1 "
        "in that order (one of each: B+1, B+2, B+3; default: 50050)",
    )
    for stage in STAGES:
        add(
            f"--{stage}s",
            type=int,
            default=1,
            metavar="N",
            help=f"{stage} replicas, each a process on its own port (default: 1)",
        )
    add("--batching", default=None, help="engine batching policy: continuous | dynamic | static")
    add("--device", default=None, help="engine device: auto | cpu | cuda")
    add("--compile", default=None, choices=("auto", "on", "off"),
        help="engine: torch.compile the model step (auto: on for CUDA, off on a CPU)")  # fmt: skip
    add(
        "--engine-threads",
        type=int,
        default=0,
        metavar="N",
        help="engine torch threads (default: one less than the cores, at least 1)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, help="seconds to wait for all services"
    )
    add(
        "--otlp-endpoint",
        default="",
        help="export every service's spans over OTLP to this URL "
        "(e.g. http://127.0.0.1:4317; OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf for OTLP/HTTP)",
    )
    add("--trace-console", action="store_true", help="print every finished span on the console")
    add(
        "--metrics-base-port",
        type=int,
        default=0,
        help="the stages serve /metrics on consecutive ports from this one, in the order of their gRPC "
        "ports (one of each: tokenizer, engine, detokenizer on M, M+1, M+2; 0 = none)",
    )
    add(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        metavar="N",
        help="restarts of one dead child allowed within --restart-window-s before giving up (default: 5)",
    )
    add(
        "--restart-window-s",
        type=float,
        default=RestartPolicy.window_s,
        metavar="S",
        help="the window of --max-restarts, in seconds (default: 60)",
    )
    add(
        "--unhealthy-restart-s",
        type=float,
        default=UNHEALTHY_RESTART_S,
        metavar="S",
        help="restart a child that served and then has not answered SERVING for this long (default: 10)",
    )
    add(
        "--health-timeout-s",
        type=float,
        default=HEALTH_TIMEOUT_S,
        metavar="S",
        help="deadline of each health check of a child; no answer counts as not serving (default: 2)",
    )
    add(
        "--standby",
        type=int,
        default=STANDBY_DEFAULT,
        metavar="N",
        help="pre-started processes kept per stage kind, their imports done, each taking over the next "
        "restart of a replica of its kind instead of a cold start (default: 1; 0 = cold restarts)",
    )
    args = parser.parse_args(argv)
    if args.standby < 0:
        parser.error("--standby must be at least 0")
    for stage in STAGES:
        if getattr(args, f"{stage}s") < 1:
            parser.error(f"--{stage}s must be at least 1")
    if args.unhealthy_restart_s <= 0 or args.health_timeout_s <= 0:
        parser.error("--unhealthy-restart-s and --health-timeout-s must be positive")
    clash = port_clash(planned_ports(args))
    if clash is not None:
        parser.error(clash)
    return args


def planned_ports(args: argparse.Namespace) -> list[tuple[int, str]]:
    """Every port `sluice up` will listen on, with its use: the gateway's HTTP and gRPC ports, each
    stage replica's gRPC port and, with --metrics-base-port, its metrics port (see `plan_children`)."""
    ports = [
        (args.port, "the gateway's HTTP port (--port)"),
        (args.grpc_base_port, "the gateway's gRPC port (--grpc-base-port)"),
    ]
    offset = 0
    for stage in STAGES:
        for name in replica_names(stage, getattr(args, f"{stage}s")):
            ports.append((args.grpc_base_port + 1 + offset, f"{name}'s gRPC port"))
            if args.metrics_base_port > 0:
                ports.append(
                    (args.metrics_base_port + offset, f"{name}'s metrics port (--metrics-base-port)")
                )
            offset += 1
    return ports


def port_clash(ports: list[tuple[int, str]]) -> str | None:
    """A message naming the first port planned for two uses, or None when all are distinct."""
    seen: dict[int, str] = {}
    for port, use in ports:
        if port in seen:
            return f"port {port} would be both {seen[port]} and {use}; choose other ports"
        seen[port] = use
    return None


def served_name_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The gateway's --served-model-name: the one given, else `tiny` for the embedded model (what the
    README's examples send), else none (the gateway answers to the directory's name)."""
    name = args.served_model_name
    if name is None and not args.model:
        name = EMBEDDED_MODEL_NAME
    return ("--served-model-name", name) if name else ()


def resolve_model(model: str, revision: str = "") -> str:
    """The model directory every child serves, resolved once before they start: the given directory,
    a Hub id's snapshot (from the Hugging Face cache, or downloaded with a progress bar), or the
    embedded chat model (made and cached on first use). SystemExit with the reason when none."""
    from services.common.models import ModelNotFound, resolve_model_dir

    try:
        path = resolve_model_dir(model, revision).expanduser().resolve()
    except ModelNotFound as exc:
        raise SystemExit(f"sluice up: {exc}") from None
    if not (path / "config.json").is_file():
        raise SystemExit(f"sluice up: {path} is not a Hugging Face model directory (no config.json)")
    return str(path)


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


def stage_tls(environ: Mapping[str, str]) -> ChannelTls | None:
    """How the launcher reaches the stages for its health checks: as the gateway does, over TLS when
    SLUICE_TLS_CA_FILE is set (with SLUICE_TLS_CERT_FILE and SLUICE_TLS_KEY_FILE as the client
    certificate for mutual TLS). The children read the same variables (docs/security.md)."""
    ca_file = environ.get("SLUICE_TLS_CA_FILE", "")
    if not ca_file:
        return None
    cert_file, key_file = environ.get("SLUICE_TLS_CERT_FILE", ""), environ.get("SLUICE_TLS_KEY_FILE", "")
    return ChannelTls(ca_file, cert_file, key_file)


def access_line(environ: Mapping[str, str]) -> str:
    """Says whether the gateway's APIs need a key (SLUICE_API_KEYS / SLUICE_API_KEYS_FILE)."""
    if environ.get("SLUICE_API_KEYS") or environ.get("SLUICE_API_KEYS_FILE"):
        return "API keys required (Authorization: Bearer KEY)"
    return "no API key configured: every API is open to anyone who can reach these ports"


def replica_names(stage: str, count: int) -> list[str]:
    """`engine` for a lone replica, else `engine-1` ... `engine-N`."""
    return [stage] if count == 1 else [f"{stage}-{i}" for i in range(1, count + 1)]


def plan_children(args: argparse.Namespace, model: str) -> list[Child]:
    """Every stage replica on consecutive ports from --grpc-base-port + 1 (tokenizers, engines,
    detokenizers), then the gateway on --grpc-base-port, given every replica's address."""
    common = ("--host", args.host)
    engine_extra: tuple[str, ...] = ("--threads", str(args.engine_threads or default_engine_threads()))
    if args.batching:
        engine_extra += ("--batching", args.batching)
    if args.device:
        engine_extra += ("--device", args.device)
    if args.compile:
        engine_extra += ("--compile", args.compile)
    children: list[Child] = []
    addresses: dict[str, list[str]] = {}
    offset = 0
    for stage in STAGES:
        for name in replica_names(stage, getattr(args, f"{stage}s")):
            port = args.grpc_base_port + 1 + offset
            extra = engine_extra if stage == "engine" else ()
            flags = (*common, "--port", str(port), "--model", model, *extra, *_metrics_flags(args, offset))
            children.append(Child(name, port, flags, service=stage))
            addresses.setdefault(stage, []).append(f"{args.host}:{port}")
            offset += 1
    gateway_flags = (
        *common,
        "--port",
        str(args.port),
        "--grpc-port",
        str(args.grpc_base_port),
        *(flag for stage in STAGES for flag in (f"--{stage}", ",".join(addresses[stage]))),
        *served_name_flags(args),
    )
    return [*children, Child("gateway", args.grpc_base_port, gateway_flags)]


def busy_port(host: str, ports: list[int]) -> int | None:
    """The first of `ports` that cannot be bound on `host` (as the services bind: SO_REUSEADDR), or
    None when all are free."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return port
    return None


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports(path: Path = EPHEMERAL_RANGE_FILE) -> range | None:
    """The local ports the kernel gives outgoing connections (Linux), or None when it cannot be read."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def ephemeral_warning(ports: list[tuple[int, str]], ephemeral: range | None) -> str | None:
    """A warning when planned ports lie in the range of outgoing connections' local ports: while a child
    is down, any connection on the host may take its port, and the restart then cannot bind it (seen:
    a tokenizer restarted over a minute in vain, its port held by a client's keep-alive connection)."""
    inside = sorted(port for port, _ in ports if ephemeral is not None and port in ephemeral)
    if not inside or ephemeral is None:
        return None
    return (
        f"sluice up: warning: ports {', '.join(map(str, inside))} are in the range the kernel gives outgoing "
        f"connections ({ephemeral.start}-{ephemeral.stop - 1}); a child restarted while a connection holds "
        f"its port cannot bind it. Ports below {ephemeral.start} avoid that (--port, --grpc-base-port, "
        "--metrics-base-port)."
    )


def _parent_death_signal() -> Callable[[], None] | None:
    """A function for Popen's `preexec_fn` that has the child receive SIGTERM when the launcher dies
    (Linux prctl PR_SET_PDEATHSIG), or None elsewhere. libc is looked up here, in the launcher, so that
    the forked child only makes the one call. Linux sends the signal when the *thread* that started
    the child ends: `sluice up` starts every child from its main thread, which lives as long as it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the call: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return set_signal


class Standby:
    """A pre-started process for one stage kind: `python -m sluice.launcher standby KIND FD` imports
    STANDBY_IMPORTS[KIND], writes a line to the pipe FD (ready), then waits for one line on its stdin,
    the JSON list of `sluice` arguments of the replica it is to become, and runs them in-process
    (`hand_over`); end of input instead makes it exit 0. It prints nothing unless it fails, and gets
    SIGTERM when the launcher dies, as the children do."""

    def __init__(self, kind: str, env: dict[str, str], preexec: Callable[[], None] | None) -> None:
        self.kind = kind
        ready_r, ready_w = os.pipe()
        command = [sys.executable, "-m", "sluice.launcher", "standby", kind, str(ready_w)]
        try:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, env=env, preexec_fn=preexec, pass_fds=(ready_w,)
            )
        finally:
            os.close(ready_w)
        os.set_blocking(ready_r, False)
        self._ready_r: int | None = ready_r
        self.ready = False

    def poll(self) -> bool | None:
        """True once its imports are done, False while they run, None when it has exited."""
        if self.proc.poll() is not None:
            self._close_pipe()
            return None
        if not self.ready and self._ready_r is not None:
            with contextlib.suppress(BlockingIOError):
                self.ready = bool(os.read(self._ready_r, 64))
                self._close_pipe()
        return self.ready

    def hand_over(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Makes the (ready) standby run `sluice ARGV`; returns its process, now the replica's."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv).encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def stop(self) -> None:
        """Ends a standby that was not handed over: end of input, then SIGTERM (it may still import)."""
        self._close_pipe()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def _close_pipe(self) -> None:
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None


def _may_raise_priority(nice: int) -> bool:
    """Whether this process may set its nice value back to `nice` after raising it: with CAP_SYS_NICE,
    or an RLIMIT_NICE that allows it (nice values down to 20 - the limit)."""
    with open("/proc/self/status") as status:
        caps = next((line.split()[1] for line in status if line.startswith("CapEff:")), "0")
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return bool(int(caps, 16) >> CAP_SYS_NICE & 1) or soft == resource.RLIM_INFINITY or 20 - soft <= nice


def _yield_while_importing() -> Callable[[], None]:
    """Lowers this process's CPU priority by STANDBY_NICE while a standby imports, so that its imports
    yield to the serving replicas, where it may raise it back; returns what raises it back, for every
    thread of the process (a no-op where it may not: the standby then imports at the replicas' priority
    rather than leave a replica at a lower one).

    On Linux a nice value belongs to a thread (PRIO_PROCESS with a pid sets only that thread), and a new
    thread starts with its creator's: threads that the imports started (thread pools, a library's
    workers) would keep the lower priority after the hand-over, so the restore sets each thread's."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if sys.platform != "linux" or not _may_raise_priority(nice):
        return lambda: None
    os.setpriority(os.PRIO_PROCESS, 0, nice + STANDBY_NICE)
    return lambda: _set_every_thread_nice(nice)


def _set_every_thread_nice(nice: int) -> None:
    """Sets the nice value of every thread of this process (Linux: /proc/self/task lists them), again
    for threads that a thread still at the old value started meanwhile, until no new one appears."""
    done: set[str] = set()
    while new := set(os.listdir("/proc/self/task")) - done:
        for task in new:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(task), nice)
        done |= new


def standby_main(argv: list[str]) -> int:
    """The standby process (see `Standby`): `standby KIND READY_FD`."""
    kind, ready_fd = argv[0], int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the launcher stops us
    restore_priority = _yield_while_importing()
    for module in STANDBY_IMPORTS[kind]:
        importlib.import_module(module)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    sys.stdin.close()
    restore_priority()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from sluice.cli import main

    return main(json.loads(line))


class Supervisor:
    """Owns the child processes: starts them, waits for health, stops them all exactly once. With
    `standby` N, also keeps up to N `Standby` processes per stage kind (`top_up_standbys`): a start of a
    child takes a ready one of its kind when there is one, else starts the child cold."""

    def __init__(self, children: list[Child], env: dict[str, str] | None = None, standby: int = 0) -> None:
        self.children = children
        self.env = os.environ.copy() if env is None else env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.standby = standby
        self.standbys: dict[str, list[Standby]] = {}
        self._standby_off: set[str] = set()  # kinds whose standby failed
        self._retired: list[Standby] = []  # stopped standbys, reaped by `stop`
        self._early_kind: str | None = None  # the kind whose standby `start` started with the children
        self._preexec = _parent_death_signal()

    def start(self) -> None:
        """Starts every child, and with `standby` on, the engine's standby at once beside them (the
        first kind of STANDBY_ORDER the children have), importing at its lower priority: a restart
        right after the ready line, which waits for it (`early_standby_settled`), is then a take-over,
        not a cold start."""
        for child in self.children:
            self.start_child(child)
        kinds = {child.kind for child in self.children}
        early = next((kind for kind in STANDBY_ORDER if kind in kinds), None)
        if self.standby > 0 and early is not None:
            self._early_kind = early
            self._start_standby(early)

    def early_standby_settled(self) -> bool:
        """False while the standby started with the children still imports; True once it is ready, has
        failed (its kind then restarts cold), was handed over to a restart, or none was started."""
        spares = self.standbys.get(self._early_kind, []) if self._early_kind else []
        if not spares or self._early_kind in self._standby_off:
            return True
        state = spares[0].poll()
        if state is None:
            self._standby_failed(
                self._early_kind, f"it exited with {describe_exit(spares[0].proc.poll() or 0)}"
            )
            return True
        return state

    def start_child(self, child: Child) -> None:
        """Starts (or starts again) one child, from a ready standby of its kind when there is one, and
        prints its pid. The child gets SIGTERM if the launcher dies (see `_parent_death_signal`)."""
        standby, proc, how = self._ready_standby(child.kind), None, ""
        if standby is not None:
            with contextlib.suppress(OSError):  # it died since it said ready: a cold start then
                proc, how = standby.hand_over(child.argv), " from a standby"
        if proc is None:
            proc = subprocess.Popen(self.command(child), env=self.env, preexec_fn=self._preexec)
        self.procs[child.name] = proc
        print(f"sluice up: {child.name} started (pid {proc.pid}){how}", flush=True)

    @staticmethod
    def command(child: Child) -> list[str]:
        """The command line that runs `child`."""
        return [sys.executable, "-m", "sluice.cli", *child.argv]

    def top_up_standbys(self, kinds: set[str]) -> None:
        """Starts standbys of `kinds` (stage kinds) up to `standby` of each, one at a time: none starts
        while another still imports (the engine's first), so that the spares' imports take at most one
        core from the serving replicas. A standby that exits by itself, or cannot be started, turns
        standbys of its kind off (no crash loop of spares): its replicas restart cold from then on."""
        importing = False
        for kind in kinds - self._standby_off:
            for spare in self.standbys.setdefault(kind, []):
                state = spare.poll()
                if state is None:
                    self._standby_failed(kind, f"it exited with {describe_exit(spare.proc.poll() or 0)}")
                    break
                importing |= not state
        if importing:
            return
        for kind in sorted(kinds - self._standby_off, key=STANDBY_ORDER.index):
            if len(self.standbys[kind]) < self.standby:
                self._start_standby(kind)
                return

    def _start_standby(self, kind: str) -> None:
        try:
            self.standbys.setdefault(kind, []).append(Standby(kind, self.env, self._preexec))
        except OSError as exc:
            self._standby_failed(kind, str(exc))

    def _standby_failed(self, kind: str, why: str) -> None:
        self.standbys.setdefault(kind, [])
        print(
            f"sluice up: the {kind} standby failed ({why}); {kind} replicas restart cold from now on",
            file=sys.stderr,
            flush=True,
        )
        self._standby_off.add(kind)
        for spare in self.standbys[kind]:
            spare.stop()
        self._retired += self.standbys[kind]
        self.standbys[kind] = []

    def _ready_standby(self, kind: str) -> Standby | None:
        """Takes a ready standby of `kind` out of the pool, or None (none, or none done importing)."""
        spares = self.standbys.get(kind, [])
        for spare in spares:
            if spare.poll():
                spares.remove(spare)
                return spare
        return None

    def dead_child(self) -> tuple[str, int] | None:
        dead = self.dead_children()
        return dead[0] if dead else None

    def dead_children(self) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited (a code -N: killed by signal N)."""
        return [(name, code) for name, proc in self.procs.items() if (code := proc.poll()) is not None]

    def terminate(self, name: str) -> None:
        """SIGTERM to a running child, then SIGCONT so that a stopped one acts on it."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)

    async def wait_all_healthy(self, host: str, timeout_s: float, tls: ChannelTls | None = None) -> None:
        """Returns when every child is SERVING (the stages asked over `tls` when given, the gateway's
        public port in plaintext); raises RuntimeError naming a child that died first. The benchmark
        stacks start this way (sluice/bench/stack.py); `sluice up` watches with a `Watcher` instead."""
        checks = [
            asyncio.ensure_future(
                wait_healthy(
                    f"{host}:{child.grpc_port}",
                    timeout_s=timeout_s,
                    tls=None if child.kind == "gateway" else tls,
                )
            )
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
        """Stops the gateway first, then the stages (its generations in flight finish on them): each
        group gets SIGTERM, then SIGKILL once STOP_GRACE_S has passed."""
        gateway = [name for name in self.procs if name == "gateway"]
        stages = [name for name in self.procs if name != "gateway"]
        spares = [spare for kind in self.standbys.values() for spare in kind] + self._retired
        self.standbys, self._retired = {}, []
        for spare in spares:
            spare.stop()
        for group in (gateway, stages):
            for name in group:
                self.terminate(name)
            for name in group:
                self._reap(name)
        for spare in spares:
            self._reap_process(spare.proc, f"the {spare.kind} standby")

    def _reap(self, name: str) -> None:
        self._reap_process(self.procs[name], name)

    @staticmethod
    def _reap_process(proc: subprocess.Popen[bytes], name: str) -> None:
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"sluice up: {name} did not stop in {STOP_GRACE_S:.0f}s; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()


def describe_exit(code: int) -> str:
    """ "code 1", or "code -9 (SIGKILL)" for a child killed by a signal."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


@dataclass
class _Run:
    """One run of a child process: its pid, when it started, whether and when it last answered
    SERVING, and when it gets SIGKILL after an unhealthy restart's SIGTERM."""

    pid: int
    started: float
    restarted: bool = False  # started by the watcher, after the first start-up
    served: bool = False
    last_serving: float = 0.0
    kill_at: float | None = None


class Watcher:
    """Restarts children that die or stay unhealthy, under one `RestartPolicy` per child (pure: the
    caller passes the time and the health checks' answers).

    A child whose latest run has answered SERVING (`on_health`) and then not for `unhealthy_restart_s`,
    or whose restarted run has not answered SERVING within `startup_timeout_s` of its start, gets
    SIGTERM, and SIGKILL after KILL_GRACE_S; every death, whether the run had served or was still
    starting, goes through the restart policy, except an exit with CONFIG_ERROR_STATUS, which gives up
    at once. (The first start-up's own limit is `_watch`'s.)"""

    def __init__(
        self,
        supervisor: Supervisor,
        policy: RestartPolicy,
        *,
        unhealthy_restart_s: float = UNHEALTHY_RESTART_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        now: float | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.policy = policy
        self.unhealthy_restart_s = unhealthy_restart_s
        self.startup_timeout_s = startup_timeout_s
        self.trackers = {child.name: RestartTracker(policy) for child in supervisor.children}
        self.due: dict[str, float] = {}  # child name → monotonic time of its next start
        self.give_up_status = 1  # `sluice up`'s exit status once `check` gives up on a child
        started = time.monotonic() if now is None else now
        self.runs = {name: _Run(proc.pid, started) for name, proc in supervisor.procs.items()}

    def on_health(self, name: str, pid: int, serving: bool, asked_at: float) -> None:
        """The answer of a health check of `name` (run `pid`) sent at `asked_at`."""
        run = self.runs[name]
        if serving and run.pid == pid:
            run.served = True
            run.last_serving = max(run.last_serving, asked_at)

    def all_served(self) -> bool:
        """True once every child's current run has answered SERVING."""
        return all(run.served for run in self.runs.values())

    def settled_kinds(self) -> set[str]:
        """The stage kinds none of whose children is starting, due a restart or being stopped: every
        current run has answered SERVING (standbys are started only then, so that their imports never
        compete with a start)."""
        busy = {
            child.kind
            for child in self.supervisor.children
            if child.name in self.due or not self.runs[child.name].served or self.runs[child.name].kill_at
        }
        return {child.kind for child in self.supervisor.children if child.kind in STAGES} - busy

    def check(self, now: float) -> str | None:
        """Notes new deaths, stops unhealthy children and starts those whose backoff has passed;
        returns the name of a child to give up on, if any."""
        for name, code in self.supervisor.dead_children():
            if name not in self.due and not self._schedule_restart(name, code, now):
                return name
        for child in self.supervisor.children:
            if child.name not in self.due:
                self._check_alive(child.name, now)
        for child in self.supervisor.children:
            if child.name in self.due and self.due[child.name] <= now:
                del self.due[child.name]
                self.supervisor.start_child(child)
                self.runs[child.name] = _Run(self.supervisor.procs[child.name].pid, now, restarted=True)
        return None

    def _schedule_restart(self, name: str, code: int, now: float) -> bool:
        """False when the policy gives up on `name`, or when it refused its configuration (exit status
        CONFIG_ERROR_STATUS: no restart can fix that; `give_up_status` is then that status)."""
        when = "" if self.runs[name].served else " during start-up"
        if code == CONFIG_ERROR_STATUS:
            print(
                f"sluice up: {name} exited with {describe_exit(code)}{when}: it refused its configuration "
                "(its message is above); not restarting it; stopping the others",
                file=sys.stderr,
                flush=True,
            )
            self.give_up_status = CONFIG_ERROR_STATUS
            return False
        delay = self.trackers[name].on_exit(now, self.runs[name].served)
        if delay is None:
            print(
                f"sluice up: {name} exited with {describe_exit(code)}{when} after {self.policy.max_restarts} "
                f"restarts within {self.policy.window_s:g}s; giving up and stopping the others",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f"sluice up: {name} exited with {describe_exit(code)}{when}; restarting it in {delay:g}s "
            f"(restart {self.trackers[name].recent} of {self.policy.max_restarts} allowed within "
            f"{self.policy.window_s:g}s)",
            file=sys.stderr,
            flush=True,
        )
        self.due[name] = now + delay
        return True

    def _check_alive(self, name: str, now: float) -> None:
        """SIGTERM to a served child silent or not SERVING for too long, or to a restarted one that has
        not served within the start-up timeout; SIGKILL once its grace is out."""
        run = self.runs[name]
        if run.kill_at is not None:
            if now >= run.kill_at:
                print(
                    f"sluice up: {name} did not stop {KILL_GRACE_S:g}s after SIGTERM; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                self.supervisor.procs[name].kill()
                run.kill_at = math.inf
            return
        if run.served and now - run.last_serving > self.unhealthy_restart_s:
            why = f"has not answered SERVING for {now - run.last_serving:.1f}s"
        elif not run.served and run.restarted and now - run.started > self.startup_timeout_s:
            why = f"has not answered SERVING {now - run.started:.1f}s after its restart"
        else:
            return
        print(f"sluice up: {name} {why}; stopping it to restart it", file=sys.stderr, flush=True)
        self.supervisor.terminate(name)
        run.kill_at = now + KILL_GRACE_S


Probe = Callable[[Child], Awaitable[bool]]
"""`probe(child)`: whether the child answers its grpc.health.v1 check with SERVING now."""


def health_probe(host: str, tls: ChannelTls | None, timeout_s: float) -> Probe:
    """Asks a child's grpc.health.v1 Check on `host` (the stages over `tls` when given, the gateway's
    public gRPC port in plaintext), on a fresh channel, within `timeout_s`: no answer is not SERVING."""

    async def probe(child: Child) -> bool:
        channel_tls = None if child.kind == "gateway" else tls
        async with client_channel(f"{host}:{child.grpc_port}", tls=channel_tls) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    return probe


class HealthChecks:
    """At most one health check in flight per child, in the background: a starting child is asked
    every WATCH_INTERVAL_S, a serving one every HEALTH_INTERVAL_S; answers go to the `Watcher`."""

    def __init__(self, supervisor: Supervisor, watcher: Watcher, probe: Probe) -> None:
        self.supervisor = supervisor
        self.watcher = watcher
        self.probe = probe
        self.pending: dict[str, tuple[asyncio.Task[bool], int, float]] = {}  # name → (check, pid, sent)
        self.sent: dict[str, float] = {}

    def poll(self, now: float) -> None:
        """Hands finished checks' answers to the watcher and sends the checks that are due."""
        for name, (task, pid, asked_at) in list(self.pending.items()):
            if task.done():
                del self.pending[name]
                serving = not task.cancelled() and task.exception() is None and task.result()
                self.watcher.on_health(name, pid, serving, asked_at)
        for child in self.supervisor.children:
            proc = self.supervisor.procs[child.name]
            run = self.watcher.runs[child.name]
            interval = HEALTH_INTERVAL_S if run.served else WATCH_INTERVAL_S
            if child.name in self.pending or proc.poll() is not None:
                continue
            if now - self.sent.get(child.name, -math.inf) >= interval:
                self.sent[child.name] = now
                task = asyncio.ensure_future(self.probe(child))
                self.pending[child.name] = (task, proc.pid, now)

    def cancel(self) -> None:
        for task, _, _ in self.pending.values():
            task.cancel()


async def _watch(
    watcher: Watcher,
    checks: HealthChecks,
    stop: asyncio.Event,
    startup_timeout_s: float,
    on_ready: Callable[[], None],
) -> int:
    """Watches the children until a stop signal (returns 0), a child that keeps dying, or a start-up
    that outlasts `startup_timeout_s` (returns 1), or a child that refused its configuration (returns
    2). Calls `on_ready` once every child has served and the standby started with them is ready."""
    deadline = time.monotonic() + startup_timeout_s
    ready = False
    try:
        while not stop.is_set():
            now = time.monotonic()
            checks.poll(now)
            if watcher.check(now) is not None:
                return watcher.give_up_status
            if not ready and watcher.all_served() and watcher.supervisor.early_standby_settled():
                ready = True
                on_ready()
            if ready:
                watcher.supervisor.top_up_standbys(watcher.settled_kinds())
            if not ready and now > deadline:
                late = ", ".join(name for name, run in watcher.runs.items() if not run.served)
                late = late or "the engine standby's imports"  # every child served; the ready line waits
                print(f"sluice up: not healthy after {startup_timeout_s:.0f}s: {late}", file=sys.stderr)
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=WATCH_INTERVAL_S)
        return 0
    finally:
        checks.cancel()


def _print_ready(args: argparse.Namespace, model: str) -> None:
    print(f"sluice is up: chat at http://{args.host}:{args.port}/  (model: {model})", flush=True)
    print(f"  gateway gRPC {args.host}:{args.grpc_base_port}; Ctrl-C stops everything", flush=True)
    print(f"  {access_line(os.environ)}", flush=True)


async def _run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model, args.revision)
    children = plan_children(args, model)
    busy = busy_port(args.host, [port for port, _ in planned_ports(args)])
    if busy is not None:
        print(
            f"sluice up: port {busy} on {args.host} is in use (see --port, --grpc-base-port and "
            "--metrics-base-port)",
            file=sys.stderr,
        )
        return 1
    warning = ephemeral_warning(planned_ports(args), ephemeral_ports())
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    supervisor = Supervisor(children, child_env(args, os.environ.copy()), standby=args.standby)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor.start()
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
        watcher = Watcher(
            supervisor,
            policy,
            unhealthy_restart_s=args.unhealthy_restart_s,
            startup_timeout_s=args.startup_timeout,
        )
        probe = health_probe(args.host, stage_tls(os.environ), args.health_timeout_s)
        checks = HealthChecks(supervisor, watcher, probe)
        return await _watch(watcher, checks, stop, args.startup_timeout, lambda: _print_ready(args, model))
    finally:
        supervisor.stop()


def main(argv: list[str]) -> int:
    """`sluice up ARGV`'s exit status: 0 after a stop signal, 1 when it gave up on a child, 2 for a
    configuration error (argparse's, one found before any child starts, or a child's)."""
    args = parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr, flush=True)
        return CONFIG_ERROR_STATUS


if __name__ == "__main__" and sys.argv[1:2] == ["standby"]:
    raise SystemExit(standby_main(sys.argv[2:]))
