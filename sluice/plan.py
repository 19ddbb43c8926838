"""The plan of `sluice up`: which processes run, on which ports, with which flags and threads.

Pure functions of the parsed flags (and of the host's port range, cores and load average); nothing is
started here. Invariants: the stages' gRPC ports are consecutive from `--grpc-base-port` + 1 in STAGES
order (tokenizers, engines, detokenizers), their metrics ports likewise from `--metrics-base-port`; the
gateway takes `--port` and `--grpc-base-port` and is given every replica's address; a replica is named
`engine` when alone, else `engine-1` ... `engine-N`; every planned port has one use (`port_clash`). The
engines share the usable cores as torch threads (one core less when the load average shows other work:
BUSY_LOAD) at the launcher's priority, the light stages `--light-nice` (LIGHT_NICE) lower, every child
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


def engine_cores(load: float | None = None) -> int:
    """The cores the engines may use: the usable ones while the host is otherwise idle (`load`, the
    1-minute load average before any child starts, default `host_load()`, below BUSY_LOAD), else one
    less; at least 1."""
    load = host_load() if load is None else load
    return max(1, usable_cores() if load < BUSY_LOAD else usable_cores() - 1)


def replica_count(args: argparse.Namespace) -> int:
    """The stage replicas `args` plan (tokenizers, engines, detokenizers): one gRPC port each after
    --grpc-base-port, and one metrics port each from --metrics-base-port."""
    return sum(getattr(args, f"{stage}s") for stage in STAGES)


def host_load() -> float:
    """The host's 1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


AUTO = 0  # --engines auto, before `resolve_engines`
GPU_DEVICE_FILE = Path("/dev/nvidiactl")  # present where a CUDA driver exposes a device
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
ENGINE_OVERHEAD_BYTES = 3 << 29  # an engine besides its weights: its KV pool (0.5 GiB) and runtime (1 GiB)
MEMORY_SHARE = 0.8  # auto engines fit in this share of the memory available at start-up
# Weights up to this size make a step that Python and dispatch dominate: one engine per core pays
# (tiny, 16 MB: 1.3x at 64 streams); past it the products dominate and one engine on every core does as
# well with better batch-1 latency (h1024, 377 MB: 0.97x, batch 1 0.77x). docs/benchmarks.md has both.
SMALL_MODEL_BYTES = 64 << 20


def engines_flag(value: str) -> int:
    """`--engines`: a count of at least 1, or `auto` (AUTO)."""
    if value == "auto":
        return AUTO
    count = int(value)
    if count < 1:
        raise ValueError(value)
    return count


def available_memory() -> int:
    """Bytes of memory available for new processes now (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def weight_bytes(model: str) -> int:
    """The size of the weight files of the model directory `model` (0 for the embedded model, "",
    and for a Hub id not yet resolved)."""
    path = Path(model).expanduser() if model else None
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def auto_engines(args: argparse.Namespace, load: float | None = None) -> tuple[int, str]:
    """The engine count of `--engines auto`, with why. On a GPU (`--device cuda`, or `auto`/none where
    GPU_DEVICE_FILE exists): one. On a CPU, for a model of at most SMALL_MODEL_BYTES of weights (the
    embedded one is): one engine per core of `engine_cores` (one less on a busy
    host), each then a one-thread engine: such a model's step is mostly one Python
    thread, so one-thread engines use the cores that one multi-thread engine leaves idle between its
    parallel regions (docs/benchmarks.md, "Cores to the engine"); at most as many as fit in
    MEMORY_SHARE of the available memory, an engine counted as twice its weight files (oneDNN's packed
    copy) plus ENGINE_OVERHEAD_BYTES. A larger model, or a Hub id not yet downloaded: one engine."""
    device = args.device or "auto"
    if device == "cuda" or (device == "auto" and GPU_DEVICE_FILE.exists()):
        return 1, "one on a GPU"
    load = host_load() if load is None else load
    cores = engine_cores(load)
    if args.model and not Path(args.model).expanduser().is_dir():
        return 1, "one: the model's size is unknown before it is resolved"
    weights = weight_bytes(args.model)
    if weights > SMALL_MODEL_BYTES:
        return 1, f"one: {weights >> 20} MB of weights, over {SMALL_MODEL_BYTES >> 20} MB"
    per_engine = 2 * weights + ENGINE_OVERHEAD_BYTES
    fit = max(1, int(MEMORY_SHARE * available_memory() // per_engine))
    if fit < cores:
        return fit, f"as many as fit in memory, {per_engine / 2**30:.1f} GiB each"
    busy = "" if load < BUSY_LOAD else f", less one: load average {load:.2f} >= {BUSY_LOAD:g}"
    return cores, f"one per usable core{busy}"


def resolve_engines(args: argparse.Namespace, load: float | None = None) -> None:
    """Replaces `--engines auto` in `args` with its count (`auto_engines`), kept with why in
    `args.engines_why`; a count given stays, with why "--engines"."""
    if args.engines == AUTO:
        args.engines, args.engines_why = auto_engines(args, load)
    else:
        args.engines_why = "--engines"


def default_engine_threads(load: float | None = None, engines: int = 1) -> int:
    """Torch threads for each of the `engines` engines of `sluice up`: the usable cores shared out
    among them (at least one each), while the host is otherwise idle (`load`, the 1-minute load average
    before any child starts, default `host_load()`, below BUSY_LOAD), else one core less: on a host
    already busy with other work a second thread's barriers wait for a core that work holds, and
    engines with more threads than their share of the cores wait on each other likewise. The light
    stages yield to the engines by priority (`light_nice`). docs/architecture.md ("`sluice up`") and
    docs/benchmarks.md ("Cores to the engine") have the measurements."""
    return max(1, engine_cores(load) // max(1, engines))


def engine_threads(args: argparse.Namespace, load: float | None = None) -> int:
    """`--engine-threads` when given (> 0), else `default_engine_threads(load, --engines)`."""
    return args.engine_threads or default_engine_threads(load, args.engines)


def light_nice(args: argparse.Namespace) -> int:
    """What the light stages (tokenizer, detokenizer, gateway) add to their nice value: `--light-nice`
    (0 = the engine's priority) when given; else LIGHT_NICE beside one engine, whose threads leave the
    cores idle between their parallel regions for the light stages to fill, and 0 beside several
    engines, which keep every core busy: there +10 starved the light stages that the engines wait on
    (p99 TTFT above 2.4 s in half the runs against 0.9-1.3 s at 0; docs/benchmarks.md, "Engines per
    core")."""
    nice = getattr(args, "light_nice", None)
    if nice is not None:
        return int(nice)
    return LIGHT_NICE if getattr(args, "engines", 1) <= 1 else 0


def policy_line(args: argparse.Namespace, load: float | None = None) -> str:
    """The start-up line naming the CPU policy: the engine's threads (and why) and the light stages'
    nice; `load` as for `default_engine_threads`."""
    load = host_load() if load is None else load
    threads, cores, engines = engine_threads(args, load), usable_cores(), args.engines
    share = f", shared by {engines} engines" if engines > 1 else ""
    if args.engine_threads:
        why = "--engine-threads"
    elif load < BUSY_LOAD:
        why = f"one per usable core, {cores}{share}; load average {load:.2f} < {BUSY_LOAD:g}"
    else:
        why = f"one less than the {cores} usable cores{share}: load average {load:.2f} >= {BUSY_LOAD:g}"
    nice = light_nice(args)
    light = f"at nice +{nice} (--light-nice)" if nice else "at the engine's priority (--light-nice 0)"
    if getattr(args, "light_nice", None) is None and engines > 1:
        light = "at the engine's priority (beside several engines; --light-nice)"
    each = " each" if engines > 1 else ""
    count = f"{engines} engine{'s' if engines > 1 else ''} ({getattr(args, 'engines_why', '--engines')})"
    return (
        f"sluice up: engine: {threads} torch thread(s){each} ({why}), nice +0, {count}; "
        f"the other services {light}"
    )


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
