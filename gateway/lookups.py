"""What the edges look up from the stages besides generations, each cached: the model's `Info` from a
tokenizer and the engines' context length from an engine's `Stats` (each fetched once), and token
pieces from a detokenizer's vocabulary (for logprobs; at most `TOKEN_PIECE_CACHE` entries, cleared
when full).
"""

from __future__ import annotations

from gateway.events import TokenPiece
from gateway.settings import GatewaySettings
from gateway.stages import Stages
from services.common.pb import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

TOKEN_PIECE_CACHE = 200_000  # token id → piece entries kept for logprobs


class Lookups:
    """Cached look-ups through `stages`; `info` is the model's Info once fetched, else None."""

    def __init__(self, stages: Stages, settings: GatewaySettings) -> None:
        self._stages = stages
        self._settings = settings
        self.info: tokenizer_pb2.InfoResponse | None = None
        self._max_model_len = 0
        self._token_pieces: dict[int, TokenPiece] = {}

    async def model_info(self) -> tokenizer_pb2.InfoResponse:
        """The tokenizer's Info (model name, context length), fetched once. Raises AioRpcError."""
        if self.info is None:
            tokenizers = self._stages.tokenizers
            address = await tokenizers.pick_ready(self._settings.upstream_wait_s)
            stub = tokenizer_pb2_grpc.TokenizerStub(tokenizers.channels[address])
            self.info = await stub.Info(
                tokenizer_pb2.InfoRequest(), timeout=self._settings.tokenize_timeout_s
            )
        return self.info

    async def max_model_len(self) -> int:
        """The engines' context length (prompt and output tokens of one request), from the `Stats` of
        a connected engine replica, fetched once: every replica serves the same model with the same
        settings. Raises AioRpcError."""
        if not self._max_model_len:
            engines = self._stages.engines
            address = await engines.pick_ready(self._settings.upstream_wait_s)
            stub = engine_pb2_grpc.EngineStub(engines.channels[address])
            stats = await stub.Stats(engine_pb2.StatsRequest(), timeout=self._settings.tokenize_timeout_s)
            self._max_model_len = stats.max_model_len
        return self._max_model_len

    async def token_pieces(self, ids: list[int]) -> list[TokenPiece]:
        """Each token id on its own (special tokens kept), for logprobs: its text and bytes, from the
        detokenizer's vocabulary in one call for the ids not yet cached. Raises AioRpcError."""
        missing = sorted({i for i in ids if i not in self._token_pieces})
        if missing:
            detokenizers = self._stages.detokenizers
            stub = detokenizer_pb2_grpc.DetokenizerStub(detokenizers.channels[detokenizers.pick()])
            reply = await stub.TokenPieces(
                detokenizer_pb2.TokenPiecesRequest(ids=missing), timeout=self._settings.tokenize_timeout_s
            )
            if len(reply.pieces) != len(missing):
                raise RuntimeError(f"detokenizer gave {len(reply.pieces)} pieces for {len(missing)} ids")
            if len(self._token_pieces) + len(missing) > TOKEN_PIECE_CACHE:
                self._token_pieces.clear()
            self._token_pieces.update(
                (i, TokenPiece(p.text, p.bytes)) for i, p in zip(missing, reply.pieces, strict=True)
            )
        return [self._token_pieces[i] for i in ids]
