"""The gateway's links to the stages: the replicas of the tokenizer, engine and detokenizer
(`gateway.upstream.Replicas`), each with its picker (`gateway.routing.Picker`), and one long-lived
multiplexed call (`StreamLink`) per engine and detokenizer member. No request state lives here: the
pipeline owns the requests and gets every message read on a link (`on_engine_out`, `on_detok_out`) and
every broken link (`on_broken`). Look-ups are cached: the model's `Info` from a tokenizer and the
engines' context length from an engine's `Stats` (each fetched once), and token pieces from a
detokenizer (for logprobs; at most `TOKEN_PIECE_CACHE` entries, cleared when full). Every connected
engine gets a link as soon as a request is routed, so each reports its load and prefix cache
(`EngineReport`) to the engines' picker; a broken engine link makes the picker forget that replica's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.events import GenerateInput, TokenPiece
from gateway.routing import Picker
from gateway.settings import GatewaySettings
from gateway.upstream import Replicas, StreamLink
from services.common.grpc_server import STAGE_SERVICES, ChannelTls
from services.common.pb import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

log = logging.getLogger(__name__)

# The status of a unary call whose replica went away while it ran: worth one more try elsewhere.
REPLICA_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

EngineLink = StreamLink[engine_pb2.EngineIn, engine_pb2.EngineIn, engine_pb2.EngineOut]
DetokLink = StreamLink[
    detokenizer_pb2.DetokenizeInEntry, detokenizer_pb2.DetokenizeIn, detokenizer_pb2.DetokenizeOut
]
OnBroken = Callable[[EngineLink | DetokLink, str], None]
TOKEN_PIECE_CACHE = 200_000  # token id → piece entries kept for logprobs


@dataclass(frozen=True)
class TokenizeOptions:
    """The tokenizer's options for one call; None leaves the tokenizer's default (true for both)."""

    add_special_tokens: bool | None = None  # text only: bos and the like
    add_generation_prompt: bool | None = None  # messages only: the assistant turn's opening


def _one_message(entries: list[detokenizer_pb2.DetokenizeInEntry]) -> list[detokenizer_pb2.DetokenizeIn]:
    """The detokenizer link's writes: the entries queued since the last one, in one message."""
    return [detokenizer_pb2.DetokenizeIn(entries=entries)]


class Stages:
    """Replicas, pickers and links of the three stages. Create it inside the event loop that will use
    it; `close()` closes every link and channel."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        on_engine_out: Callable[[EngineLink, engine_pb2.EngineOut], None],
        on_detok_out: Callable[[DetokLink, detokenizer_pb2.DetokenizeOut], None],
        on_broken: OnBroken,
    ) -> None:
        self._settings = settings
        tls = ChannelTls.from_settings(settings)
        interval = settings.resolve_interval_s
        engine_picker = Picker(
            settings.routing, self.engine_load, settings.routing_margin, settings.routing_margin_ratio
        )
        self.engines = Replicas(
            "engine", settings.engine, tls, picker=engine_picker, resolve_interval_s=interval,
            health_service=STAGE_SERVICES["engine"],
        )  # fmt: skip
        pooled = {"channels_per_replica": settings.channels_per_replica, "resolve_interval_s": interval}
        self.tokenizers = Replicas(
            "tokenizer", settings.tokenizer, tls, health_service=STAGE_SERVICES["tokenizer"], **pooled
        )
        self.detokenizers = Replicas(
            "detokenizer", settings.detokenizer, tls, health_service=STAGE_SERVICES["detokenizer"], **pooled
        )
        self._engine_links: dict[str, EngineLink] = {}
        self._detok_links: dict[str, DetokLink] = {}
        self._links = {"engine": self._engine_links, "detokenizer": self._detok_links}  # by kind
        self._on_engine_out = on_engine_out
        self._on_detok_out = on_detok_out
        self._on_broken = on_broken
        self._ready_check: asyncio.Future[dict[str, list[bool]]] | None = None
        self._ready_checked_at = -math.inf
        self._ready_losses = 0  # `Replicas.losses` of the three stages when the latest check began
        self.info: tokenizer_pb2.InfoResponse | None = None  # the model's, once fetched (`model_info`)
        self._max_model_len = 0
        self._token_pieces: dict[int, TokenPiece] = {}

    # ----- picking

    async def pick_engine(self, ids: list[int], wait_s: float) -> str:
        """The engine replica for a prompt of `ids`, by the routing policy among the connected replicas
        (each gets a link, so it reports), waiting up to `wait_s` for one when none is connected."""
        address = await self.engines.pick_ready(wait_s, ids)
        for connected in self.engines.connected():
            self.engine_link(connected)
        return address

    def retry_engine(self, failed: str, ids: list[int]) -> str | None:
        """Another connected engine replica than `failed` for a prompt of `ids`, by the routing policy;
        None when there is none."""
        others = [a for a in self.engines.connected() if a != failed]
        return self.engines.picker.pick(others, ids) if others else None

    def engine_load(self, address: str) -> int:
        """Requests in flight on an engine replica, as this gateway sent them."""
        link = self._engine_links.get(address)
        return len(link.request_ids) if link is not None and link.alive else 0

    # ----- links

    def engine_link(self, address: str) -> EngineLink:
        """The live link to an engine member, opened if need be."""
        return self._link(self.engines, address, engine_pb2_grpc.EngineStub, list, self._on_engine_message)

    def detok_link(self, address: str) -> DetokLink:
        """The live link to a detokenizer member, opened if need be."""
        stub = detokenizer_pb2_grpc.DetokenizerStub
        return self._link(self.detokenizers, address, stub, _one_message, self._on_detok_out)

    def _link(self, replicas: Replicas, address: str, stub: Any, merge: Any, on_message: Any) -> Any:
        links = self._links[replicas.kind]
        link = links.get(address)
        if link is None or not link.alive:
            link = links[address] = StreamLink(
                kind=replicas.kind,
                address=address,
                open_call=stub(replicas.channels[address]).Stream,
                merge=merge,
                on_message=on_message,
                on_broken=self._on_link_broken,
            )
        return link

    def _on_engine_message(self, link: EngineLink, out: engine_pb2.EngineOut) -> None:
        if out.HasField("report"):
            self.engines.picker.on_report(link.address, out.report)
        self._on_engine_out(link, out)

    def _on_link_broken(self, link: EngineLink | DetokLink, reason: str) -> None:
        # A broken link leaves its map, so a retired replica's link and report mirror do not stay behind.
        links = self._links[link.kind]
        if links.get(link.address) is link:
            del links[link.address]
            if link.kind == "engine":
                self.engines.picker.forget(link.address)
        self._on_broken(link, reason)

    # ----- unary calls

    async def tokenize(
        self, request_id: str, inp: GenerateInput, deadline: float, options: TokenizeOptions | None = None
    ) -> list[int]:
        """The prompt's ids from a tokenizer replica (in turn), within `deadline` (`time.monotonic()`).
        A call that fails because its replica went away (UNAVAILABLE, or CANCELLED: a draining
        replica cancels what is still running when its grace ends) is made once more, on another
        replica when one is ready. Raises AioRpcError."""
        given = {k: v for k, v in dataclasses.asdict(options or TokenizeOptions()).items() if v is not None}
        if inp.messages is not None:
            chat = common_pb2.Conversation(messages=inp.messages)
            given.update(chat=chat, tools_json=inp.tools_json)
        else:
            given.update(text=inp.prompt)
        message = tokenizer_pb2.TokenizeRequest(request_id=request_id, **given)
        failed: str | None = None
        while True:
            wait_s = min(self._settings.upstream_wait_s, deadline - time.monotonic())
            address = await self.tokenizers.pick_ready(wait_s, avoid=failed)
            timeout = max(0.001, min(self._settings.tokenize_timeout_s, deadline - time.monotonic()))
            stub = tokenizer_pb2_grpc.TokenizerStub(self.tokenizers.channels[address])
            try:
                reply = await stub.Tokenize(message, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if failed is not None or exc.code() not in REPLICA_GONE:
                    raise
                failed = self.tokenizers.replica_of(address)
                log.info("request %s: tokenizer %s: %s; retrying", request_id, address, exc.code().name)
                continue
            return list(reply.ids)

    async def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        """The text of `ids` from a detokenizer replica (in turn). Raises AioRpcError."""
        stub = await self._ready_stub(self.detokenizers, detokenizer_pb2_grpc.DetokenizerStub)
        request = detokenizer_pb2.DecodeRequest(ids=ids, skip_special_tokens=skip_special_tokens)
        reply = await stub.Decode(request, timeout=self._settings.tokenize_timeout_s)
        return reply.text

    async def model_info(self) -> tokenizer_pb2.InfoResponse:
        """The tokenizer's Info (model name, context length), fetched once (then `info`). Raises
        AioRpcError."""
        if self.info is None:
            stub = await self._ready_stub(self.tokenizers, tokenizer_pb2_grpc.TokenizerStub)
            self.info = await stub.Info(
                tokenizer_pb2.InfoRequest(), timeout=self._settings.tokenize_timeout_s
            )
        return self.info

    async def max_model_len(self) -> int:
        """The engines' context length (prompt and output tokens of one request), from the `Stats` of
        a connected engine replica, fetched once: every replica serves the same model with the same
        settings. A figure the APIs show (`/v1/models`, `/tokenize`), never a limit the gateway
        applies: the engine owns the context limit. Raises AioRpcError."""
        if not self._max_model_len:
            stub = await self._ready_stub(self.engines, engine_pb2_grpc.EngineStub)
            stats = await stub.Stats(engine_pb2.StatsRequest(), timeout=self._settings.tokenize_timeout_s)
            self._max_model_len = stats.max_model_len
        return self._max_model_len

    async def token_pieces(self, ids: list[int]) -> list[TokenPiece]:
        """Each token id on its own (special tokens kept), for logprobs: its text and bytes, from the
        detokenizer's vocabulary in one call for the ids not yet cached, on a ready replica (waiting up
        to `upstream_wait_s` for one). A call that fails because its replica went away (UNAVAILABLE,
        CANCELLED) is made once more, on another replica when one is ready. Raises AioRpcError."""
        missing = sorted({i for i in ids if i not in self._token_pieces})
        if missing:
            reply = await self._token_pieces_call(missing)
            if len(reply.pieces) != len(missing):
                raise RuntimeError(f"detokenizer gave {len(reply.pieces)} pieces for {len(missing)} ids")
            if len(self._token_pieces) + len(missing) > TOKEN_PIECE_CACHE:
                self._token_pieces.clear()
            self._token_pieces.update(
                (i, TokenPiece(p.text, p.bytes)) for i, p in zip(missing, reply.pieces, strict=True)
            )
        return [self._token_pieces[i] for i in ids]

    async def _token_pieces_call(self, ids: list[int]) -> detokenizer_pb2.TokenPiecesResponse:
        request = detokenizer_pb2.TokenPiecesRequest(ids=ids)
        failed: str | None = None
        while True:
            address = await self.detokenizers.pick_ready(self._settings.upstream_wait_s, avoid=failed)
            stub = detokenizer_pb2_grpc.DetokenizerStub(self.detokenizers.channels[address])
            try:
                return await stub.TokenPieces(request, timeout=self._settings.tokenize_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if failed is not None or exc.code() not in REPLICA_GONE:
                    raise
                failed = self.detokenizers.replica_of(address)
                log.info("token pieces: detokenizer %s: %s; retrying", address, exc.code().name)

    async def _ready_stub(self, replicas: Replicas, stub: Any) -> Any:
        """A `stub` on a member of `replicas` that is ready, waiting up to `upstream_wait_s` for one."""
        return stub(replicas.channels[await replicas.pick_ready(self._settings.upstream_wait_s)])

    async def check_ready(self) -> dict[str, list[bool]]:
        """Health of every upstream replica by stage: kind → SERVING per replica, in the stage's order
        of replicas. One fan-out of health checks at a time, and at most one per `readyz_cache_s`:
        callers within that time of the latest share its answer, unless a replica was lost since it
        began (its connection or its server gone, NOT_SERVING, the members changed: `Replicas.losses`),
        which makes the next caller check again at once: readiness drops the moment a stage's last
        replica is known down, not a cache period later."""
        now = time.monotonic()
        checking = self._ready_check
        losses = self._losses()
        if (
            checking is None
            or losses != self._ready_losses
            or (checking.done() and now - self._ready_checked_at >= self._settings.readyz_cache_s)
        ):
            self._ready_checked_at, self._ready_losses = now, losses
            checking = self._ready_check = asyncio.ensure_future(self._check_every_replica())
        return await asyncio.shield(checking)

    def _losses(self) -> int:
        return self.tokenizers.losses + self.engines.losses + self.detokenizers.losses

    async def _check_every_replica(self) -> dict[str, list[bool]]:
        timeout = self._settings.health_timeout_s
        stages = (self.tokenizers, self.engines, self.detokenizers)
        results = await asyncio.gather(*(replicas.check_health(timeout) for replicas in stages))
        return {
            replicas.kind: list(result.values()) for replicas, result in zip(stages, results, strict=True)
        }

    async def close(self) -> None:
        if self._ready_check is not None:
            self._ready_check.cancel()
        links: list[EngineLink | DetokLink] = [*self._engine_links.values(), *self._detok_links.values()]
        self._engine_links.clear()
        self._detok_links.clear()
        for link in links:
            await link.close()
        for replicas in (self.tokenizers, self.engines, self.detokenizers):
            await replicas.close()
