"""Client side of the upstream services: channels to every replica, and the long-lived multiplexed
bidirectional calls (one per replica of the engine and of the detokenizer).

A `StreamLink` owns one call. Writing never blocks and keeps order: `send` appends to a queue that a
request iterator drains; everything queued since the last write goes out together, merged by the
link's `merge` function (the detokenizer merges entries into one `DetokenizeIn`). A reader task hands
every incoming message to `on_message`. When the call ends or fails, the link is dead for good and
`on_broken` fires exactly once; the owner makes a new link for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import telemetry
from services.common.grpc_server import CHANNEL_OPTIONS, ChannelTls, client_channel

log = logging.getLogger(__name__)

# A restarted upstream is reachable again within about a second, not after gRPC's default backoff
# (which grows to two minutes while the peer is down).
UPSTREAM_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

In = TypeVar("In")
Out = TypeVar("Out")
Item = TypeVar("Item")


class Replicas:
    """Channels to every replica of one upstream service (`kind` is "tokenizer", "engine" or
    "detokenizer"). `pick` chooses the replica for new work: the least loaded by the caller's measure
    when one is given (ties go round the replicas in turn), else the next in turn; `pick_ready` chooses
    so among the replicas that are connected, waiting a bounded time for one when none is."""

    def __init__(self, kind: str, addresses: Sequence[str], tls: ChannelTls | None = None) -> None:
        assert addresses, f"{kind}: no address"
        self.kind = kind
        self.addresses = tuple(addresses)
        self.channels = {
            address: client_channel(
                address,
                tls=tls,
                options=UPSTREAM_CHANNEL_OPTIONS,
                interceptors=telemetry.client_interceptors(),
            )
            for address in self.addresses
        }
        self._turn = itertools.count()

    def pick(self, load: Callable[[str], int] | None = None, among: Collection[str] | None = None) -> str:
        """The replica for the next piece of work. `load(address)` (e.g. requests in flight there);
        `among`: the candidates (default: every replica; must not be empty)."""
        start = next(self._turn) % len(self.addresses)
        in_turn = [a for a in self.addresses[start:] + self.addresses[:start] if among is None or a in among]
        if load is None:
            return in_turn[0]
        return min(in_turn, key=load)

    def connected(self) -> list[str]:
        """The replicas whose channel is READY. Idle channels are asked to connect."""
        ready = grpc.ChannelConnectivity.READY
        return [a for a in self.addresses if self.channels[a].get_state(try_to_connect=True) == ready]

    async def pick_ready(self, timeout_s: float, load: Callable[[str], int] | None = None) -> str:
        """The replica for the next piece of work among those whose channel is READY, chosen as
        `pick` chooses. When none is (the stage is starting or restarting), waits up to `timeout_s`
        for the first to become READY; when none does, `pick(load)`: a call there fails at once
        with UNAVAILABLE. Returns at once when a replica is READY."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            ready = self.connected()
            if ready:
                return self.pick(load, ready)
            left = deadline - loop.time()
            if left <= 0:
                return self.pick(load)
            await self._any_ready(left)

    async def _any_ready(self, timeout_s: float) -> None:
        """Returns when a channel becomes READY, or after `timeout_s`."""
        waiters = [asyncio.ensure_future(channel.channel_ready()) for channel in self.channels.values()]
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    async def check_health(self, timeout_s: float) -> dict[str, bool]:
        """grpc.health.v1 Check of every replica: address → SERVING."""

        async def check(address: str) -> bool:
            stub = health_pb2_grpc.HealthStub(self.channels[address])
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        results = await asyncio.gather(*(check(a) for a in self.addresses))
        return dict(zip(self.addresses, results, strict=True))

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


class StreamLink(Generic[Item, In, Out]):
    """One long-lived bidirectional call to one replica.

    `open_call(request_iterator)` starts the call (e.g. `stub.Stream`); `merge(items)` turns the items
    queued since the last write into the messages to write; `on_message(link, msg)` handles each
    message read; `on_broken(link, reason)` fires once when the call ends or fails, after which
    `alive` is False and `send` is ignored. `request_ids` is owned by the caller: the requests that
    depend on this call, to be failed when it breaks.
    """

    def __init__(
        self,
        *,
        kind: str,
        address: str,
        open_call: Callable[[AsyncIterator[In]], Any],
        merge: Callable[[list[Item]], list[In]],
        on_message: Callable[[StreamLink[Item, In, Out], Out], None],
        on_broken: Callable[[StreamLink[Item, In, Out], str], None],
    ) -> None:
        self.kind = kind
        self.address = address
        self.alive = True
        self.request_ids: set[str] = set()
        self._merge = merge
        self._on_message = on_message
        self._on_broken = on_broken
        self._queue: asyncio.Queue[Item | None] = asyncio.Queue()
        self._flushed = asyncio.Event()
        self._call = open_call(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"{kind}-link-reader")

    def send(self, item: Item) -> None:
        """Queues one item for the next write (never blocks; ignored once the link is dead)."""
        if self.alive:
            self._queue.put_nowait(item)

    async def close(self, flush_timeout_s: float = 1.0) -> None:
        """Ends the call: writes what is queued (aborts, closes) and half-closes the request stream,
        waiting up to `flush_timeout_s` for that, then cancels the call and the reader."""
        if self.alive:
            self.alive = False
            self._queue.put_nowait(None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flushed.wait(), flush_timeout_s)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _requests(self) -> AsyncIterator[In]:
        while True:
            first = await self._queue.get()
            items = [first]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            done = None in items
            batch = [item for item in items if item is not None]
            if batch:
                for message in self._merge(batch):
                    yield message
            if done:
                self._flushed.set()
                return

    async def _read(self) -> None:
        reason = "stream ended"
        try:
            async for message in self._call:
                self._on_message(self, message)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            self.alive = False
            self._call.cancel()
            raise
        except Exception:
            log.exception("%s link to %s: bad message handling", self.kind, self.address)
            reason = "internal error while reading the stream"
        was_alive = self.alive
        self.alive = False
        self._call.cancel()
        if was_alive:
            log.warning("%s stream to %s broke: %s", self.kind, self.address, reason)
            self._on_broken(self, reason)
