"""`sluice up`: the whole pipeline on one host, a child process per stage replica and the gateway.

It reads as plan → spawn → wait → stop: `plan_children` (sluice/plan.py) lays out processes, ports and
threads; `Supervisor.start` spawns them, each start printing "sluice up: NAME started (pid N)"; `_wait`
watches them (restarts, liveness, standbys: sluice/supervise.py) and prints the ready line once every
child has answered SERVING; `Supervisor.stop` ends them all, the gateway first. Exit status: 0 after
SIGINT/SIGTERM; 1 when a planned port is busy, a child keeps dying, or the start-up outlasts
`--startup-timeout`; 2 for a configuration error (argparse's, one found before any child starts, or a
child's exit status 2, never restarted). Narrative and figures: docs/architecture.md ("`sluice up`").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping

from services.common.grpc_server import CONFIG_ERROR_STATUS, ChannelTls
from services.engine.settings import COMPILE_MODES, CPU_LINEAR_MODES
from sluice.plan import (
    AUTO,
    EMBEDDED_MODEL_NAME,
    LIGHT_NICE,
    STAGES,
    busy_port,
    child_env,
    engines_flag,
    ephemeral_ports,
    ephemeral_warning,
    host_load,
    plan_children,
    planned_ports,
    policy_line,
    port_clash,
    resolve_engines,
)
from sluice.supervise import (
    HEALTH_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    UNHEALTHY_RESTART_S,
    WATCH_INTERVAL_S,
    HealthChecks,
    RestartPolicy,
    Supervisor,
    Watcher,
    health_probe,
    standby_main,
)

STANDBY_DEFAULT = 1

ENGINES_HELP = (
    "engine replicas, each a process on its own port (default: auto: on a CPU one per usable core, one "
    "less on a busy host, as many as fit in memory, each with one torch thread; on a GPU one)"
)


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
        if stage == "engine":
            add("--engines", type=engines_flag, default=AUTO, metavar="N|auto", help=ENGINES_HELP)
            continue
        add(
            f"--{stage}s",
            type=int,
            default=1,
            metavar="N",
            help=f"{stage} replicas, each a process on its own port (default: 1)",
        )
    add("--batching", default=None, help="engine batching policy: continuous | dynamic | static")
    add("--device", default=None, help="engine device: auto | cpu | cuda")
    add("--compile", default=None, choices=COMPILE_MODES,
        help="engine: torch.compile the model step (auto: on for CUDA, off on a CPU)")  # fmt: skip
    add("--cpu-linear", default=None, choices=CPU_LINEAR_MODES,
        help="engine: linear layers on a CPU (auto: oneDNN's prepacked weights where they run; onednn: "
        "the same, refused where they cannot; torch: torch's GEMM)")  # fmt: skip
    add(
        "--engine-threads",
        type=int,
        default=0,
        metavar="N",
        help="torch threads of each engine (default: the cores this process may run on, one less when the "
        "host's load average is 1 or more before the services start, shared out among the --engines)",
    )
    add(
        "--light-nice",
        type=int,
        default=None,
        choices=range(0, 20),
        metavar="N",
        help="added to the nice value of the tokenizers, detokenizers and gateway once they serve (they "
        f"start at the engine's), so that they yield the cores to it (0-19; 0 = the engine's priority; "
        f"default: {LIGHT_NICE} beside one engine, 0 beside several)",
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
    args.start_load = host_load()  # before any child starts: other work only
    resolve_engines(args, args.start_load)
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


async def _run(args: argparse.Namespace) -> int:
    """plan → spawn → wait → stop; the exit status of `sluice up` (see `main`)."""
    model = resolve_model(args.model, args.revision)  # plan
    load = args.start_load
    children = plan_children(args, model, load)
    if not _ports_usable(args):
        return 1
    print(policy_line(args, load), flush=True)
    supervisor = Supervisor(children, child_env(args, os.environ.copy()), standby=args.standby)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor.start()  # spawn
    try:
        return await _wait(args, supervisor, stop, lambda: _print_ready(args, model))  # wait
    finally:
        supervisor.stop()  # stop: the gateway first, then the stages


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


def _ports_usable(args: argparse.Namespace) -> bool:
    """False, with a line naming it, when a planned port is busy; warns of ports a connection may take."""
    busy = busy_port(args.host, [port for port, _ in planned_ports(args)])
    if busy is not None:
        print(
            f"sluice up: port {busy} on {args.host} is in use (see --port, --grpc-base-port and "
            "--metrics-base-port)",
            file=sys.stderr,
        )
        return False
    warning = ephemeral_warning(planned_ports(args), ephemeral_ports())
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    return True


async def _wait(
    args: argparse.Namespace, supervisor: Supervisor, stop: asyncio.Event, on_ready: Callable[[], None]
) -> int:
    """Watches the children (restarts and liveness by a `Watcher`, standbys topped up once ready) until
    a stop signal (returns 0), a child that keeps dying, or a start-up that outlasts --startup-timeout
    (returns 1), or a child that refused its configuration (returns 2). Calls `on_ready` once every
    child has served and the standby started with them is ready."""
    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
    watcher = Watcher(
        supervisor,
        policy,
        unhealthy_restart_s=args.unhealthy_restart_s,
        startup_timeout_s=args.startup_timeout,
    )
    probe = health_probe(args.host, stage_tls(os.environ), args.health_timeout_s)
    checks = HealthChecks(supervisor, watcher, probe)
    deadline = time.monotonic() + args.startup_timeout
    ready = False
    try:
        while not stop.is_set():
            now = time.monotonic()
            checks.poll(now)
            if watcher.check(now) is not None:
                return watcher.give_up_status
            if not ready and watcher.all_served() and supervisor.early_standby_settled():
                ready = True
                on_ready()
            if ready:
                supervisor.top_up_standbys(watcher.settled_kinds())
            if not ready and now > deadline:
                late = ", ".join(name for name, run in watcher.runs.items() if not run.served)
                late = late or "the engine standby's imports"  # every child served; the ready line waits
                print(f"sluice up: not healthy after {args.startup_timeout:.0f}s: {late}", file=sys.stderr)
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=WATCH_INTERVAL_S)
        return 0
    finally:
        checks.cancel()


def stage_tls(environ: Mapping[str, str]) -> ChannelTls | None:
    """How the launcher reaches the stages for its health checks: as the gateway does, over TLS when
    SLUICE_TLS_CA_FILE is set (with SLUICE_TLS_CERT_FILE and SLUICE_TLS_KEY_FILE as the client
    certificate for mutual TLS). The children read the same variables (docs/security.md)."""
    ca_file = environ.get("SLUICE_TLS_CA_FILE", "")
    if not ca_file:
        return None
    cert_file, key_file = environ.get("SLUICE_TLS_CERT_FILE", ""), environ.get("SLUICE_TLS_KEY_FILE", "")
    return ChannelTls(ca_file, cert_file, key_file)


def _print_ready(args: argparse.Namespace, model: str) -> None:
    print(f"sluice is up: chat at http://{args.host}:{args.port}/  (model: {model})", flush=True)
    print(f"  gateway gRPC {args.host}:{args.grpc_base_port}; Ctrl-C stops everything", flush=True)
    print(f"  {access_line(os.environ)}", flush=True)


def access_line(environ: Mapping[str, str]) -> str:
    """Says whether the gateway's APIs need a key (SLUICE_API_KEYS / SLUICE_API_KEYS_FILE)."""
    if environ.get("SLUICE_API_KEYS") or environ.get("SLUICE_API_KEYS_FILE"):
        return "API keys required (Authorization: Bearer KEY)"
    return "no API key configured: every API is open to anyone who can reach these ports"


if __name__ == "__main__" and sys.argv[1:2] == ["standby"]:
    raise SystemExit(standby_main(sys.argv[2:]))
