"""`--workers N`: N processes of one service sharing its port with SO_REUSEPORT.

The first process binds (port 0 picks a free one) and starts N-1 children on the bound port; the
kernel spreads new connections over all of them. On SIGTERM/SIGINT the first process drains, then
stops its children and waits for them. A child whose parent disappears drains and exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.common.grpc_server import ServerHandle

# create_server(settings, reuse_port=...) builds and binds one process's server (its service's own).
CreateServer = Callable[..., Awaitable["ServerHandle[Any, Any]"]]
CHILD_JOIN_S = 30.0


def _child_main(name: str, settings: Any, create_server: CreateServer, parent_pid: int) -> None:
    from services.common import grpc_server

    stop_when = _parent_gone(parent_pid)
    status = grpc_server.run(
        serve_worker(name, settings, create_server, reuse_port=True, stop_when=stop_when)
    )
    if status:
        raise SystemExit(status)


async def _parent_gone(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)


async def signal_self_when(event: Awaitable[None]) -> None:
    """Sends this process SIGTERM (a graceful drain) when `event` completes."""
    with contextlib.suppress(asyncio.CancelledError):
        await event
        os.kill(os.getpid(), signal.SIGTERM)


async def serve_workers(name: str, settings: Any, create_server: CreateServer) -> None:
    """Serves `create_server`'s server here, plus `settings.workers - 1` children (processes that
    build their own with it) on the port this process bound."""
    if settings.workers <= 1:
        await serve_worker(name, settings, create_server, reuse_port=False)
        return
    context = multiprocessing.get_context("spawn")
    children: list[multiprocessing.process.BaseProcess] = []

    def start_children(port: int) -> None:
        for index in range(1, settings.workers):
            metrics_port = settings.metrics_port + index if settings.metrics_port > 0 else 0
            child_settings = dataclasses.replace(settings, port=port, workers=1, metrics_port=metrics_port)
            child = context.Process(
                target=_child_main, args=(name, child_settings, create_server, os.getpid()), daemon=False
            )
            child.start()
            children.append(child)

    async def stop_children() -> None:
        for child in children:
            if child.is_alive() and child.pid is not None:
                child.terminate()
        loop = asyncio.get_running_loop()
        for child in children:
            await loop.run_in_executor(None, child.join, CHILD_JOIN_S)

    await serve_worker(
        name, settings, create_server, reuse_port=True, on_bound=start_children, on_drain=stop_children
    )


async def serve_worker(
    name: str,
    settings: Any,
    create_server: CreateServer,
    *,
    reuse_port: bool,
    on_bound: Callable[[int], None] | None = None,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    stop_when: Awaitable[None] | None = None,
) -> None:
    """One process of a pool: sets up tracing (`OTEL_*`), builds the server with `create_server`, serves
    metrics when `settings.metrics_port` is set, and serves until SIGTERM/SIGINT (or until `stop_when`
    completes), then drains: the handle stops (its core released), the metrics endpoint closes,
    `on_drain` runs."""
    from services.common import grpc_server, metrics, telemetry

    telemetry.init_tracing(name)
    handle = await create_server(settings, reuse_port=reuse_port)
    endpoint = metrics.maybe_serve_metrics(handle.metrics.registry, settings.host, settings.metrics_port)
    if on_bound is not None:
        on_bound(handle.port)
    watcher = asyncio.ensure_future(signal_self_when(stop_when)) if stop_when is not None else None

    async def drain() -> None:
        if endpoint is not None:
            endpoint.close()
        if on_drain is not None:
            await on_drain()

    try:
        await grpc_server.serve_forever(handle, name=name, grace_s=settings.grace_s, on_drain=drain)
    finally:
        if watcher is not None:
            watcher.cancel()
