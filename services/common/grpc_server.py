"""gRPC plumbing shared by every service: server construction with health and reflection, binding,
graceful drain on SIGTERM/SIGINT, and a health wait for clients.

Every service has the same shape: settings → `create_server(settings)` → servicer → core.
`create_server` builds the server with `new_server`, adds its servicer, binds with `bind`, and returns a
`ServerHandle`; `serve_forever` runs a handle until a signal, then drains.

TLS (docs/security.md): `server_credentials(settings)` turns a stage's TLS fields into the credentials
`bind` binds with (server TLS, or mutual TLS with a client CA); `client_channel(address, tls=...)` is
the one way a client opens a channel to a stage, plaintext or TLS (`ChannelTls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import priority, telemetry
from services.common.metrics import ServiceMetrics
from services.common.pb import detokenizer_pb2, engine_pb2, tokenizer_pb2
from services.common.settings import StageTlsSettings

log = logging.getLogger(__name__)

# Each stage's gRPC service, from the protos: the name its server registers (health included) and the
# health the gateway asks a replica of that stage for.
STAGE_SERVICES = {
    kind: module.DESCRIPTOR.services_by_name[name].full_name
    for kind, module, name in (
        ("tokenizer", tokenizer_pb2, "Tokenizer"),
        ("engine", engine_pb2, "Engine"),
        ("detokenizer", detokenizer_pb2, "Detokenizer"),
    )
}

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A connection older than MAX_CONNECTION_AGE_MS (gRPC adds +-10% jitter) is sent a GOAWAY: new calls
# go on a new connection, so a client re-resolves and reconnects as replicas come and go and the
# kernel re-spreads connections over --workers processes. Calls in flight on the old connection,
# long-lived streams included, go on to their end (no max_connection_age_grace: gRPC's default is
# unbounded).
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
]


class ServiceHealth:
    """The standard grpc.health.v1 service. Serving once `set_serving` is called; NOT_SERVING for good
    once `set_failed` is called: the service cannot serve any more, or is draining to stop (load
    balancers then send no new work before the server stops, whatever its core reports later)."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ["", *service_names]
        self.failed = False

    async def set_failed(self) -> None:
        """NOT_SERVING from now on, whatever `set_serving` is called with later."""
        self.failed = True
        await self.set_serving(False)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving and not self.failed
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.names:
            await self.servicer.set(name, status)


class Server(Protocol):
    """What a handle starts and stops: a `grpc.aio.Server`, or the gateway's pair of servers."""

    async def start(self) -> None: ...

    async def stop(self, grace: float | None) -> None: ...


ServerT = TypeVar("ServerT", bound=Server)
CoreT = TypeVar("CoreT")


@dataclass(frozen=True)
class ServerHandle(Generic[ServerT, CoreT]):
    """What every service's `create_server(settings)` returns: its `server`, built and bound, not
    started; the bound `port` (the gateway's: its HTTP port); the service's `core` (no gRPC in it);
    its `health` (grpc.health.v1); its `metrics`, created by `create_server` and handed to the core;
    and `release`, which frees what the core holds (threads, the engine's loop, channels) once the
    server has stopped.

    `start()` starts the server (its health NOT_SERVING, never unknown, until then) and marks it
    SERVING; `stop(grace_s)` marks it NOT_SERVING for good, stops the server (calls in flight get
    `grace_s` seconds; None: cancelled at once), then releases the core. Whoever calls `create_server`
    calls `stop` once, started or not."""

    server: ServerT
    port: int
    core: CoreT
    health: ServiceHealth
    metrics: ServiceMetrics
    release: Callable[[], Awaitable[None]]

    async def start(self) -> None:
        await self.health.set_serving(False)  # every name known before the first call: never UNKNOWN
        await self.server.start()
        await self.health.set_serving(True)

    async def stop(self, grace_s: float | None) -> None:
        await self.health.set_failed()
        await self.server.stop(grace_s)
        await self.release()


def new_server(
    service_full_names: Iterable[str], *, reuse_port: bool = False, max_receive_bytes: int = MAX_MESSAGE_BYTES
) -> tuple[grpc.aio.Server, ServiceHealth]:
    """A grpc.aio server with health and reflection added for the given services
    (e.g. "sluice.v1.Engine"), and the tracing interceptors when tracing is on
    (`telemetry.init_tracing` was called first). The caller adds its own servicer, then calls `bind`.
    A request message over `max_receive_bytes` is refused by gRPC with RESOURCE_EXHAUSTED."""
    options = [(key, value) for key, value in SERVER_OPTIONS if key != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))  # a repeated key: the first wins
    options.append(("grpc.so_reuseport", int(reuse_port)))
    server = grpc.aio.server(options=options, interceptors=telemetry.server_interceptors())
    names = list(service_full_names)
    health_state = ServiceHealth(names)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    return server, health_state


def bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Binds a port (0 picks a free one), with TLS when `credentials` are given (`server_credentials`),
    and returns the bound port."""
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def _read_pem(path: str) -> bytes:
    """The bytes of one PEM file; OSError naming the file when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read TLS file {path}: {exc.strerror or exc}") from exc


def server_credentials(settings: StageTlsSettings) -> grpc.ServerCredentials | None:
    """The credentials a stage binds with: None without a certificate (plaintext); TLS with its
    certificate and key; mutual TLS when `tls_client_ca_file` is set too (a client without a
    certificate signed by that CA is refused during the handshake). Raises OSError on an unreadable
    file."""
    if not settings.tls_cert_file:
        return None
    pair = (_read_pem(settings.tls_key_file), _read_pem(settings.tls_cert_file))
    client_ca = _read_pem(settings.tls_client_ca_file) if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


@dataclass(frozen=True)
class ChannelTls:
    """TLS of a client channel to a stage: `ca_file` holds the PEM CA that signs the stage's
    certificate (its subject alternative names must hold the host the address names); `cert_file`
    and `key_file`, both or neither, are the client's own certificate for mutual TLS."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_settings(cls, settings: Any) -> ChannelTls | None:
        """From an object with `tls_ca_file`, `tls_cert_file` and `tls_key_file` (the gateway's
        settings): None when `tls_ca_file` is empty (plaintext)."""
        if not settings.tls_ca_file:
            return None
        return cls(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files; raises OSError naming one that cannot be read."""
        key = _read_pem(self.key_file) if self.key_file else None
        chain = _read_pem(self.cert_file) if self.cert_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca_file), private_key=key, certificate_chain=chain
        )


def client_channel(
    address: str,
    *,
    tls: ChannelTls | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    interceptors: Sequence[Any] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` ("host:port"): plaintext when `tls` is None, else TLS (mutual
    TLS when `tls` has a client certificate). Raises OSError when a TLS file cannot be read."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options, interceptors=interceptors)


async def serve_forever(
    handle: ServerHandle[Any, Any],
    *,
    name: str,
    grace_s: float,
    banner: str = "",
    on_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Lowers the process's CPU priority as `sluice up` asked (priority.NICE_ENV: its start is done),
    starts the handle's server, marks it serving, prints `banner` (default: "NAME listening on port
    N"), and waits for SIGTERM or SIGINT; then stops the handle (not serving, calls in flight given up
    to `grace_s` seconds, the core released), runs `on_drain`, and returns."""
    priority.lower_when_serving()
    await handle.start()
    log.info("%s serving on port %d", name, handle.port)
    print(banner or f"{name} listening on port {handle.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s draining (grace %.1fs)", name, grace_s)
    await handle.stop(grace_s)
    if on_drain is not None:
        await on_drain()


CONFIG_ERROR_STATUS = 2  # a service's exit status for a configuration it refuses (`sluice up` stops)


def run(main: Awaitable[None]) -> int:
    """Runs a service's main coroutine on uvloop and returns the process's exit status: 0, or
    CONFIG_ERROR_STATUS when its configuration is refused: a setting (a ValueError, e.g. a context
    length the KV pool cannot hold, a model type not served) or a file the model needs that is not
    there (FileNotFoundError); the message is logged alone: the reader needs the numbers, not a
    traceback through the start-up code. `sluice up` does not restart a service that exits so. A crash
    in native code (a segfault, an abort) prints every thread's Python stack to stderr (faulthandler)."""
    import uvloop

    faulthandler.enable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        uvloop.run(main)  # type: ignore[arg-type]
    except (ValueError, FileNotFoundError) as exc:
        logging.getLogger(__name__).error("%s", exc)
        return CONFIG_ERROR_STATUS
    return 0


async def wait_healthy(
    address: str, *, timeout_s: float, service: str = "", tls: ChannelTls | None = None
) -> None:
    """Polls grpc.health.v1 Check on `address` (over TLS when `tls` is given, as `client_channel`)
    until SERVING; raises TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    async with client_channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
