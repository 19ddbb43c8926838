"""The plan of `sluice up`: which processes run, on which ports, with which flags and threads.

Pure functions of the parsed flags (and of the host's port range, cores and load average); nothing is
started here. Invariants: the stages' gRPC ports are consecutive from `--grpc-base-port` + 1 in STAGES
order (tokenizers, engines, detokenizers), their metrics ports likewise from `--metrics-base-port`; the
gateway takes `--port` and `--grpc-base-port` and is given every replica's address; a replica is named
`engine` when alone, else `engine-1` ... `engine-N`; every planned port has one use (`port_clash`). The
engine gets a thread per usable core (one less when the load average shows other work: BUSY_LOAD) at the
launcher's priority, the light stages `--light-nice` (LIGHT_NICE) lower, every child
`OMP_WAIT_POLICY=PASSIVE` unless set: docs/architecture.md ("`sluice up`") has why and the measurement.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_NAME = "tiny"  # the name the gateway serves the embedded model under
STAGES = ("tokenizer", "engine", "detokenizer")  # the order of their ports
LIGHT_NICE = 10  # added to the light stages' nice value by default (`sluice up --light-nice`)
BUSY_LOAD = 1.0  # a 1-minute load average from this up: the host is busy, the engine leaves a core
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@dataclass(frozen=True)
class Child:
    """One service process: its name (`engine`, or `engine-2` for a replica), the gRPC port its
    health check answers on, its flags, the service it runs (`sluice serve SERVICE`; default: its
    name), and how much it adds to the launcher's nice value (0: the same CPU priority)."""

    name: str
    grpc_port: int
    flags: tuple[str, ...]
    service: str = ""
    nice: int = 0

    @property
    def kind(self) -> str:
        """The service this child runs: tokenizer, engine, detokenizer or gateway."""
        return self.service or self.name

    @property
    def argv(self) -> list[str]:
        """The `sluice` command's arguments that run this child."""
        return ["serve", self.kind, *self.flags]


def replica_names(stage: str, count: int) -> list[str]:
    """`engine` for a lone replica, else `engine-1` ... `engine-N`."""
    return [stage] if count == 1 else [f"{stage}-{i}" for i in range(1, count + 1)]


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


def plan_children(args: argparse.Namespace, model: str, load: float | None = None) -> list[Child]:
    """Every stage replica on consecutive ports from --grpc-base-port + 1 (tokenizers, engines,
    detokenizers), then the gateway on --grpc-base-port, given every replica's address. Engines get
    `engine_threads(args, load)` torch threads and nice 0; the others `light_nice(args)`."""
    common = ("--host", args.host)
    engine_extra: tuple[str, ...] = ("--threads", str(engine_threads(args, load)))
    if args.batching:
        engine_extra += ("--batching", args.batching)
    if args.device:
        engine_extra += ("--device", args.device)
    if args.compile:
        engine_extra += ("--compile", args.compile)
    if args.cpu_linear:
        engine_extra += ("--cpu-linear", args.cpu_linear)
    children: list[Child] = []
    addresses: dict[str, list[str]] = {}
    offset = 0
    for stage in STAGES:
        for name in replica_names(stage, getattr(args, f"{stage}s")):
            port = args.grpc_base_port + 1 + offset
            extra = engine_extra if stage == "engine" else ()
            flags = (*common, "--port", str(port), "--model", model, *extra, *_metrics_flags(args, offset))
            nice = 0 if stage == "engine" else light_nice(args)
            children.append(Child(name, port, flags, service=stage, nice=nice))
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
    return [*children, Child("gateway", args.grpc_base_port, gateway_flags, nice=light_nice(args))]


def _metrics_flags(args: argparse.Namespace, offset: int) -> tuple[str, ...]:
    if args.metrics_base_port <= 0:
        return ()
    return ("--metrics-port", str(args.metrics_base_port + offset))


def served_name_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The gateway's --served-model-name: the one given, else `tiny` for the embedded model (what the
    README's examples send), else none (the gateway answers to the directory's name)."""
    name = args.served_model_name
    if name is None and not args.model:
        name = EMBEDDED_MODEL_NAME
    return ("--served-model-name", name) if name else ()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as `taskset` or a container's cpuset
    narrow it), else the host's count; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def host_load() -> float:
    """The host's 1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def default_engine_threads(load: float | None = None) -> int:
    """Torch threads for the engine of `sluice up`: one per usable core while the host is otherwise
    idle (`load`, the 1-minute load average before any child starts, default `host_load()`, below
    BUSY_LOAD), else one less (at least one): on a host already busy with other work a second thread's
    barriers wait for a core that work holds. The light stages yield to the engine by priority
    (`light_nice`). docs/architecture.md ("`sluice up`") and docs/benchmarks.md ("Cores to the engine")
    have the measurements."""
    cores = usable_cores()
    load = host_load() if load is None else load
    return cores if load < BUSY_LOAD else max(1, cores - 1)


def engine_threads(args: argparse.Namespace, load: float | None = None) -> int:
    """`--engine-threads` when given (> 0), else `default_engine_threads(load)`."""
    return args.engine_threads or default_engine_threads(load)


def light_nice(args: argparse.Namespace) -> int:
    """What the light stages (tokenizer, detokenizer, gateway) add to their nice value: `--light-nice`
    (0 = the engine's priority), LIGHT_NICE when the flags have none."""
    return int(getattr(args, "light_nice", LIGHT_NICE))


def policy_line(args: argparse.Namespace, load: float | None = None) -> str:
    """The start-up line naming the CPU policy: the engine's threads (and why) and the light stages'
    nice; `load` as for `default_engine_threads`."""
    load = host_load() if load is None else load
    threads, cores = engine_threads(args, load), usable_cores()
    if args.engine_threads:
        why = "--engine-threads"
    elif threads == cores:
        why = f"one per usable core, {cores}; load average {load:.2f} < {BUSY_LOAD:g}"
    else:
        why = f"one less than the {cores} usable cores: load average {load:.2f} >= {BUSY_LOAD:g}"
    nice = light_nice(args)
    light = f"at nice +{nice} (--light-nice)" if nice else "at the engine's priority (--light-nice 0)"
    return f"sluice up: engine: {threads} torch thread(s) ({why}), nice +0; the other services {light}"


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
