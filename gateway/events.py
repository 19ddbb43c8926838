"""What a generation looks like from the edges: its input (`GenerateInput`), its events (`Delta`s, then
exactly one `Done` or `Failed`), the slot that holds them for one consumer, and the handle that reads
them (`Generation`). Also how an upstream failure becomes a `Failed`: error codes are those of
`services.common.errors`, which the edges map to their own vocabulary.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import grpc

from services.common import errors
from services.common.pb import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateInput:
    """One generation as the edges hand it over. Exactly one of `prompt`, `messages` and `prompt_ids` (a
    prompt already tokenized, sent to the engine as it is) is set; `tools_json` (the OpenAI `tools` array as
    JSON text, "" = none) goes with messages to the chat template. `user` is the caller's end-user id
    (OpenAI `user`), recorded on the request's span. `stopping.max_new_tokens` 0 means the rest of the
    context (the engine's `max_model_len` less the prompt's tokens). `timeout_s` is the caller's own
    deadline; the gateway's `request_timeout_s` caps it. `api` names the edge (metrics label);
    `trace_context` is the caller's W3C context (traceparent, tracestate), empty for none; `request_id` the
    caller's own id for the request (its trace span's `sluice.request_id`, the gateway's own id, which the
    stages' spans carry, then in `sluice.upstream_request_id`), "" for none (the span takes the gateway's)."""

    prompt: str | None = None
    messages: tuple[common_pb2.ChatMessage, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    tools_json: str = ""
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    stopping: common_pb2.StoppingParams = field(default_factory=common_pb2.StoppingParams)
    skip_special_tokens: bool = True
    keep_special_ids: tuple[int, ...] = ()  # kept even when skipping: markers the reply's parsers read
    return_token_ids: bool = False
    timeout_s: float | None = None
    api: str = ""
    user: str = ""
    trace_context: Mapping[str, str] = field(default_factory=dict)
    request_id: str = ""


@dataclass
class Delta:
    """New text since the previous event, merged if the consumer lagged. `token_ids` (and
    `logprobs`, one per id) only when asked for. Over a generation the ids are exactly those of its
    text: through the one that completed a stop string, none after it. In one delta they may lead
    the text by the tokens whose text is still held back (part of a character, a possible start of a
    stop string); they never lag it. The first delta of a generation that asked for prompt
    logprobs (`SamplingParams.prompt_logprobs`) carries the prompt's ids and their logprobs (one per
    id after the first, as the engine sent them); no other delta does."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled" (`errors.FINISH_REASONS`)
    prompt_tokens: int
    completion_tokens: int  # the generated ids handed out (whether or not they were asked for)
    stop: str = ""  # the stop string that matched, if any
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


@dataclass(frozen=True)
class Failed:
    code: str  # an error code of `services.common.errors` (a key of `errors.STATUS_CODES`)
    message: str


Event = Delta | Done | Failed


@dataclass(frozen=True)
class TokenPiece:
    """One token on its own, for logprobs: its bytes (a byte token's one byte, part of a character's
    bytes) and those as text (an incomplete character as U+FFFD)."""

    text: str
    data: bytes


class EventSlot:
    """Events of one generation for one consumer. Deltas pushed while the consumer is busy merge
    into one, so a slow client costs memory for the text only, never a growing queue of events.
    The terminal event comes after every delta and only once."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[common_pb2.TokenLogprob] = []
        self._prompt: tuple[list[int], list[common_pb2.TokenLogprob]] | None = None  # not yet taken
        self._terminal: Done | Failed | None = None
        self._terminal_taken = False
        self._wake = asyncio.Event()

    def push(self, text: str, ids: list[int], logprobs: list[common_pb2.TokenLogprob]) -> None:
        assert self._terminal is None
        if text:
            self._text.append(text)
        self._ids.extend(ids)
        self._logprobs.extend(logprobs)
        self._wake.set()

    def push_prompt(self, ids: list[int], logprobs: list[common_pb2.TokenLogprob]) -> None:
        """The prompt's ids and logprobs, for the next delta (the pipeline pushes them once)."""
        assert self._terminal is None and self._prompt is None
        self._prompt = (ids, logprobs)
        self._wake.set()

    def finish(self, event: Done | Failed) -> None:
        assert self._terminal is None
        self._terminal = event
        self._wake.set()

    @property
    def ended(self) -> bool:
        return self._terminal_taken

    async def get(self) -> Event:
        """The next event; raises EOFError after the terminal event was taken."""
        while True:
            if self._text or self._ids or self._prompt is not None:
                delta = Delta("".join(self._text), self._ids, self._logprobs)
                if self._prompt is not None:
                    delta.prompt_ids, delta.prompt_logprobs = self._prompt
                    self._prompt = None
                self._text, self._ids, self._logprobs = [], [], []
                return delta
            if self._terminal is not None:
                if self._terminal_taken:
                    raise EOFError("generation already ended")
                self._terminal_taken = True
                return self._terminal
            self._wake.clear()
            await self._wake.wait()


class Generation:
    """Handle of one generation: iterate it for its events (deltas, then exactly one `Done` or
    `Failed`); `cancel()` ends it with `Done("cancelled")` unless it already ended."""

    def __init__(self, request_id: str, slot: EventSlot, cancel: Callable[[], None]) -> None:
        self.id = request_id
        self._slot = slot
        self._cancel = cancel

    async def next(self) -> Event:
        return await self._slot.get()

    def cancel(self) -> None:
        self._cancel()

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self._slot.ended:
            yield await self._slot.get()


def tokenizer_failure(exc: grpc.aio.AioRpcError) -> Failed:
    """A failed Tokenize call as the client sees it: the tokenizer's own words when it refused the
    input, else only the class of the failure (the log has the details, addresses included). A
    cancelled call is a replica that went away (the gateway never cancels one it still waits for):
    "unavailable"."""
    status = exc.code()
    code = errors.UNAVAILABLE if status == grpc.StatusCode.CANCELLED else errors.code_of_status(status)
    if code in (errors.INVALID_ARGUMENT, errors.RESOURCE_EXHAUSTED):
        return Failed(code, f"tokenizer: {exc.details() or exc.code().name}")
    log.warning("tokenize failed: %s: %s", exc.code().name, exc.details())
    words = {errors.UNAVAILABLE: "unavailable", errors.DEADLINE_EXCEEDED: "deadline exceeded"}.get(
        code, "failed"
    )
    return Failed(code, f"tokenizer {words}")


def engine_failure(request_id: str, error: str, error_code: int) -> Failed:
    """An engine error final (`services.common.errors`) as the client sees it: its class, with the
    engine's words (`client_words`) only when it refused the request as given (the log has the rest)."""
    code = errors.code_name(error_code)
    if code == errors.INVALID_ARGUMENT:
        words = client_words(error)
        if words != error:
            log.info("engine refused request %s: %s", request_id, error)
        return Failed(code, f"engine: {words}")
    log.warning("engine failed request %s: %s", request_id, error)
    if code == errors.DEADLINE_EXCEEDED:
        return Failed(code, "the request ran past its deadline")
    return Failed(code, "engine unavailable" if code == errors.UNAVAILABLE else "engine failed")


# What a library appends to its error for its developers: a parser's state, a backtrace.
_DEVELOPER_PARTS = ("<state>", "<backtrace>", "stack backtrace:", "Traceback (most recent call last)")
MAX_ENGINE_WORDS = 400  # characters of an engine's refusal a client sees


def client_words(detail: str) -> str:
    """An engine's words for a request it refused, as a client may see them: what comes before a
    library's state dump or backtrace, at most `MAX_ENGINE_WORDS` characters; a grammar compiler's
    panic (a Rust assertion, never the client's words) becomes a plain sentence."""
    for part in _DEVELOPER_PARTS:
        detail = detail.split(part)[0]
    kind, _, rest = detail.partition(": ")
    if rest.startswith("panic") or detail.startswith("panic"):
        where = f"{kind}: " if rest else ""
        return f"{where}the grammar compiler could not build this constraint (too large or too complex)"
    return detail.strip()[:MAX_ENGINE_WORDS]
