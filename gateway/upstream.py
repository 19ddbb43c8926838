"""Client side of the upstream services: channels to every replica (fixed addresses, or DNS names
re-resolved as replicas come and go: `Replicas`), and the long-lived multiplexed bidirectional calls
(one per member of the engine and of the detokenizer: a member is one channel to one replica).

A `StreamLink` owns one call. Writing never blocks and keeps order: `send` appends to a queue that a
request iterator drains; everything queued since the last write goes out together, merged by the
link's `merge` function (the detokenizer merges entries into one `DetokenizeIn`). A reader task hands
every incoming message to `on_message`. When the call ends or fails, the link is dead for good and
`on_broken` fires exactly once; the owner makes a new link for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.choices import DNS_SCHEME, Endpoint
from gateway.routing import Picker
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


Resolve = Callable[[str, int], Awaitable[Sequence[str]]]
"""`resolve(host, port)`: the IP addresses a name stands for now; raises OSError when it cannot say."""

MIN_RESOLVE_GAP_S = 1.0  # re-resolutions asked for because no replica is connected: at most this often
MIN_WATCH_GAP_S = 0.5  # between two health watches of one member
# While waiting for a channel to be READY, it is asked to connect again this often: a wait for its next
# state change alone can miss a connection that came up and was ended by the server's GOAWAY (its
# maximum connection age) in between, which leaves the channel IDLE with nobody asking it to connect.
CONNECT_AGAIN_S = 0.25
RETIRE_GRACE_S = 600.0  # calls in flight on a retired replica's channel may run this long (a request's)


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, in the resolver's order, without repeats, of one address family:
    that of the resolver's first (preferred) answer. A dual-stack name gives each process an IPv4 and an
    IPv6 address (`localhost`: 127.0.0.1 and ::1; a dual-stack headless Service: an A and an AAAA record
    per pod), and each process must be one replica, not two."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family = infos[0][0] if infos else None
    return list(dict.fromkeys(str(info[4][0]) for info in infos if info[0] == family))


def host_port(ip: str, port: int) -> str:
    """`10.0.0.5:50052`, `[::1]:50052`."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Replicas:
    """Channels to every replica of one upstream service (`kind` is "tokenizer", "engine" or
    "detokenizer"), from its endpoints (`Endpoint.parse`).

    Members: each replica address gets `channels_per_replica` channels, each its own connection; a
    member is one channel, named by its key: the address itself with one channel per replica, else
    `address#i`. Several connections let a replica that runs several worker processes sharing its port
    (`--workers N`, SO_REUSEPORT: the kernel hands each connection to one worker) get work on each.
    `addresses` are the keys of the members in rotation; `channels` holds every open channel by key.

    `picker` (`gateway.routing.Picker`; default: round robin) chooses the member for new work: `pick`
    among every member, `pick_ready` among the members that are connected, waiting a bounded time for
    one when none is.

    Names (`dns:///`) are resolved as soon as an event loop runs (before the first pick) and every
    `resolve_interval_s` seconds after (`resolve` is injectable; default: the system resolver), and
    again when no member is connected (at most every MIN_RESOLVE_GAP_S). While a name is first being
    resolved it is no connected member; when it never resolves it stands for itself: one member whose
    channel gRPC resolves. A failed resolution keeps the last set. A replica the name no longer gives
    leaves the rotation at once; its channel is closed once it is no longer connected, calls in flight
    there (streams included) given up to RETIRE_GRACE_S to finish. Over TLS, the certificate of a resolved
    replica must name the host of its endpoint.

    Health: every member's grpc.health.v1 status of `health_service` (the stage's gRPC service, e.g.
    "sluice.v1.Engine"; "" for the server as a whole) is watched (one `Watch` call per member, reopened
    whenever its channel is READY again); a server that does not serve that service (another stage's at
    a wrong address) reports SERVICE_UNKNOWN and counts as not SERVING. A member whose status is known
    and not SERVING (a replica draining, or an engine whose loop failed) gets no new work until it
    reports SERVING; a member not yet heard from, or whose server has no health service, counts by its
    channel alone.
    """

    def __init__(
        self,
        kind: str,
        endpoints: Sequence[str],
        tls: ChannelTls | None = None,
        *,
        picker: Picker | None = None,
        channels_per_replica: int = 1,
        resolve_interval_s: float = 10.0,
        resolve: Resolve | None = None,
        health_service: str = "",
    ) -> None:
        assert endpoints, f"{kind}: no address"
        assert channels_per_replica >= 1
        self.kind = kind
        self.health_service = health_service
        self.endpoints = [Endpoint.parse(e) for e in endpoints]
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.addresses: tuple[str, ...] = ()
        self.picker = picker or Picker()
        self._tls = tls
        self._per_replica = channels_per_replica
        self._interval = resolve_interval_s
        self._resolve = resolve or resolve_host
        self._resolved: dict[Endpoint, tuple[str, ...]] = {}
        self._target_host: dict[str, str] = {}  # a resolved address → its endpoint's host (TLS name)
        self._retiring: set[str] = set()
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}  # retired channels closing
        self._changed = asyncio.Event()
        self._refresher: asyncio.Task[None] | None = None
        self._first_resolve: asyncio.Task[None] | None = None
        self._last_resolve = -math.inf
        self._serving: dict[str, bool] = {}  # member key → its latest health status is SERVING
        self._watchers: dict[str, asyncio.Task[None]] = {}  # member key → its health watch
        self.losses = 0  # members lost so far (`lost`): a readiness answer older than one is stale
        self._set_members()
        self._start_resolving()

    # ----- members

    def _targets(self) -> list[str]:
        """Every replica address now: fixed ones, resolved ones, and unresolved names."""
        targets: list[str] = []
        for endpoint in self.endpoints:
            resolved = self._resolved.get(endpoint) if endpoint.dns else None
            targets.extend(resolved or [endpoint.target])
        return list(dict.fromkeys(targets))

    def _keys(self, target: str) -> list[str]:
        return [target] if self._per_replica == 1 else [f"{target}#{i}" for i in range(self._per_replica)]

    def _open(self, target: str) -> grpc.aio.Channel:
        options: list[tuple[str, Any]] = list(UPSTREAM_CHANNEL_OPTIONS)
        if self._per_replica > 1:  # a connection of its own, not one shared with the other channels
            options.append(("grpc.use_local_subchannel_pool", 1))
        host = self._target_host.get(target)
        if host is not None and self._tls is not None:
            options.append(("grpc.ssl_target_name_override", host))
        interceptors = telemetry.client_interceptors()
        return client_channel(target, tls=self._tls, options=options, interceptors=interceptors)

    def replica_of(self, key: str) -> str:
        """The replica address of a member key (`10.0.0.5:50051#2` → `10.0.0.5:50051`)."""
        return key.rpartition("#")[0] if self._per_replica > 1 else key

    def _set_members(self) -> None:
        """Opens channels for new members (one that cannot be opened is no member until it can),
        retires those no longer given; wakes `pick_ready`."""
        keys = {key: target for target in self._targets() for key in self._keys(target)}
        for key, target in list(keys.items()):
            self._retiring.discard(key)
            if key not in self.channels:
                try:
                    self.channels[key] = self._open(target)
                except OSError as exc:  # e.g. the TLS files cannot be read now: tried again next time
                    log.error("%s: cannot open a channel to %s: %s", self.kind, target, exc)
                    del keys[key]
        self._retiring.update(key for key in self.channels if key not in keys)
        if tuple(keys) != self.addresses:
            if self.addresses:
                log.info("%s replicas: %s", self.kind, ", ".join(keys))
            self.addresses = tuple(keys)
            self.losses += 1
            self._wake()

    def _wake(self) -> None:
        """Wakes every `pick_ready` waiting for a member (the members or a health status changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _sweep(self) -> None:
        """Closes the channels of retired members that are not connected (a replica gone, or one that
        is draining: its GOAWAY leaves the channel IDLE), letting calls in flight there, streams
        included, run up to RETIRE_GRACE_S more."""
        for key in list(self._retiring):
            channel = self.channels[key]
            if channel.get_state() != grpc.ChannelConnectivity.READY:
                self._retiring.discard(key)
                del self.channels[key]
                self._stop_watching(key)
                closing = asyncio.get_running_loop().create_task(channel.close(RETIRE_GRACE_S))
                self._closing[closing] = channel
                closing.add_done_callback(lambda task: self._closing.pop(task, None))

    async def refresh(self) -> None:
        """Resolves every `dns:///` endpoint now and updates the members."""
        self._last_resolve = asyncio.get_running_loop().time()
        for endpoint in self.endpoints:
            if not endpoint.dns:
                continue
            try:
                ips = await self._resolve(endpoint.host, endpoint.port)
            except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
                log.warning(
                    "%s: cannot resolve %s (%s); keeping its last replicas", self.kind, endpoint.target, exc
                )
                continue
            if ips:
                self._resolved[endpoint] = tuple(host_port(ip, endpoint.port) for ip in ips)
        # Only the replicas resolved now: those retired leave no entry behind.
        self._target_host = {t: e.host for e, targets in self._resolved.items() for t in targets}
        self._set_members()
        self._sweep()

    def _start_resolving(self) -> None:
        """Starts the first resolution of the names and the periodic re-resolution, once, when there
        are names and an event loop runs."""
        if self._first_resolve is not None or not any(endpoint.dns for endpoint in self.endpoints):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._first_resolve = loop.create_task(self._refresh_logged())
        self._refresher = loop.create_task(self._refresh_forever())

    def _resolving(self) -> bool:
        """True while the first resolution of the names runs."""
        return self._first_resolve is not None and not self._first_resolve.done()

    async def _ensure_resolved(self) -> None:
        """Waits for the first resolution of the names (started if need be)."""
        self._start_resolving()
        if self._first_resolve is not None:
            await asyncio.shield(self._first_resolve)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._refresh_logged()

    async def _refresh_logged(self) -> None:
        """`refresh`, an unexpected failure logged, never raised: the members stay as they were, and a
        later pick or the periodic re-resolution tries again."""
        try:
            await self.refresh()
        except Exception:
            log.exception("%s: resolution failed", self.kind)

    # ----- choice

    def pick(self, prompt_ids: Sequence[int] = ()) -> str:
        """The member for the next piece of work among every member, by the picker (`prompt_ids`: the
        request's prompt, for prefix affinity)."""
        return self.picker.pick(self.addresses, prompt_ids)

    def connected(self) -> list[str]:
        """The members whose channel is READY. Idle channels are asked to connect. While the names
        are first being resolved, an unresolved name is no member yet (its replicas are about to be)."""
        self._start_resolving()
        ready = grpc.ChannelConnectivity.READY
        members = self.addresses
        if self._resolving():
            members = tuple(a for a in members if not a.startswith(DNS_SCHEME))
        self._watch_members()
        return [
            a
            for a in members
            if self.channels[a].get_state(try_to_connect=True) == ready and self._serving.get(a, True)
        ]

    # ----- health

    def _watch_members(self) -> None:
        """Starts a health watch for every member that has none (once an event loop runs)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for key in self.addresses:
            if key not in self._watchers:
                self._watchers[key] = loop.create_task(self._watch(key), name=f"{self.kind}-health-watch")

    def _stop_watching(self, key: str) -> None:
        watcher = self._watchers.pop(key, None)
        if watcher is not None:
            watcher.cancel()
        self._serving.pop(key, None)

    async def _watch(self, key: str) -> None:
        """Follows one member's health status for as long as it is a member: a `Watch` call each time
        its channel is READY; the status is unknown between calls. Ends when the server has no health
        service (the member then counts by its channel alone)."""
        channel = self.channels[key]
        request = health_pb2.HealthCheckRequest(service=self.health_service)
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            await until_ready(channel)
            call = health_pb2_grpc.HealthStub(channel).Watch(request)
            try:
                async for reply in call:
                    if reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
                        log.warning(
                            "%s %s serves no %s: is it another service's address?",
                            self.kind, key, self.health_service,
                        )  # fmt: skip
                    self._set_serving(key, reply.status == serving)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._serving.pop(key, None)
                    return
            finally:
                call.cancel()
            if self._serving.pop(key, None) is not None:  # the connection, or the server, went away
                self.losses += 1
                self._wake()
            await asyncio.sleep(MIN_WATCH_GAP_S)  # a call that ends at once while READY must not spin

    def _set_serving(self, key: str, serving: bool) -> None:
        if self._serving.get(key) != serving:
            log.info("%s %s: %s", self.kind, key, "SERVING" if serving else "not serving")
            self._serving[key] = serving
            self.losses += not serving
            self._wake()

    async def pick_ready(
        self, timeout_s: float, prompt_ids: Sequence[int] = (), *, avoid: str | None = None
    ) -> str:
        """The member for the next piece of work among those whose channel is READY, by the picker,
        other than a member of the replica `avoid` when another one is READY.
        When none is (the stage is starting or restarting), resolves the names again and waits up to
        `timeout_s` for the first to become READY, asking the members to connect every CONNECT_AGAIN_S;
        when none does, `pick`: a call there fails at once with UNAVAILABLE. Returns at once when a
        member is READY."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await self._ensure_resolved()
        while True:
            ready = self.connected()
            if ready:
                others = [key for key in ready if self.replica_of(key) != avoid]
                return self.picker.pick(others or ready, prompt_ids)
            if self._first_resolve is not None and loop.time() - self._last_resolve >= MIN_RESOLVE_GAP_S:
                await self._refresh_logged()
                continue
            left = deadline - loop.time()
            if left <= 0:
                return self.pick(prompt_ids)
            await self._any_ready(min(left, CONNECT_AGAIN_S))  # then `connected` asks them again

    async def _any_ready(self, timeout_s: float) -> None:
        """Returns when a member's channel becomes READY, the members or a member's health change, or
        after `timeout_s`."""
        ready = grpc.ChannelConnectivity.READY
        waiters = [
            asyncio.ensure_future(self.channels[key].channel_ready())
            for key in self.addresses
            if self.channels[key].get_state() != ready
        ]
        waiters.append(asyncio.ensure_future(self._changed.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    async def check_health(self, timeout_s: float) -> dict[str, bool]:
        """grpc.health.v1 Check of every replica (one channel of each): address → SERVING. Starts the
        members' health watches if need be, so that `losses` counts from then on."""
        await self._ensure_resolved()
        self._watch_members()
        first: dict[str, str] = {}  # replica address → its first member
        for key in self.addresses:
            first.setdefault(self.replica_of(key), key)

        async def check(key: str) -> bool:
            stub = health_pb2_grpc.HealthStub(self.channels[key])
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=self.health_service), timeout=timeout_s
                )
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        results = await asyncio.gather(*(check(key) for key in first.values()))
        return dict(zip(first, results, strict=True))

    async def close(self) -> None:
        for task in (self._refresher, self._first_resolve, *self._watchers.values()):
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        self._watchers.clear()
        for closing, channel in list(self._closing.items()):
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
            await channel.close()
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()


async def until_ready(channel: grpc.aio.Channel) -> None:
    """Returns once `channel` is READY, asking it to connect every CONNECT_AGAIN_S meanwhile (gRPC's
    `channel_ready` asks once, then waits for state changes, and can wait for good: CONNECT_AGAIN_S)."""
    ready = grpc.ChannelConnectivity.READY
    while (state := channel.get_state(try_to_connect=True)) != ready:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(channel.wait_for_state_change(state), CONNECT_AGAIN_S)


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
        self._requests_ended = False
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
            self._end_requests()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flushed.wait(), flush_timeout_s)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    def _end_requests(self) -> None:
        """Lets the request iterator end (once): after what is queued, or at once when the call is over.
        gRPC stops consuming it only when it cancels a call still running: an iterator left waiting
        on a call that ended by itself would keep gRPC's consumer task pending for good."""
        if not self._requests_ended:
            self._requests_ended = True
            self._queue.put_nowait(None)

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
        self._end_requests()
        if was_alive:
            log.warning("%s stream to %s broke: %s", self.kind, self.address, reason)
            self._on_broken(self, reason)
