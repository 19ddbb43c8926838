"""Incremental detokenizing: streams of token ids in, text deltas out, exact. Knows nothing of gRPC.

The invariant: for a request opened with context ids `C` (the tail of its prompt) that then receives
generated ids `G`, the concatenation of every delta it emits equals

    full_text(C, G) = decode(C + G)[len(decode(C)):]        (decode(G) when C is empty)

cut at the first stop string (`first_stop`), special tokens removed when asked; text that can still
change (an incomplete character, an open byte-fallback run, a possible stop-string prefix) is held back
until a later id settles it or the close flushes it. `Output.num_ids` counts the generated ids consumed,
never one past the id that completed a stop string. How: docs/architecture.md ("Detokenizer").
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Ids before the window start are dropped once this many have accumulated.
TRIM_AT = 64


class BadIds(ValueError):
    """Token ids outside the vocabulary."""


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that completes first in `text` (smallest end; ties: earliest start), as
    (start index, stop string), or None."""
    found = [(start + len(stop), start, stop) for stop in stops if (start := text.find(stop)) >= 0]
    if not found:
        return None
    _, start, stop = min(found, key=lambda f: f[:2])
    return start, stop


def stop_prefix_len(text: str, stops: Sequence[str], max_len: int) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    for length in range(min(len(text), max_len - 1), 0, -1):
        tail = text[-length:]
        if any(stop.startswith(tail) for stop in stops):
            return length
    return 0


def _uses(decoder: object, kind: str) -> bool:
    """Whether a decoder (JSON) has a step of type `kind`, at any depth."""
    if isinstance(decoder, dict):
        return decoder.get("type") == kind or any(_uses(v, kind) for v in decoder.values())
    if isinstance(decoder, list):
        return any(_uses(v, kind) for v in decoder)
    return False


def _gpt2_char_bytes() -> dict[str, int]:
    """The byte-level alphabet: the printable character that stands for each byte (GPT-2's table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _byte_table(tokenizer: Tokenizer, size: int) -> list[bytes]:
    """Bytes of every id under a ByteLevel decoder: each character of the token maps to its byte; a
    token with a character outside the alphabet (an added token like "\n\n") is its own UTF-8."""
    char_bytes = _gpt2_char_bytes()
    table = []
    for i in range(size):
        token = tokenizer.id_to_token(i) or ""
        mapped = [char_bytes.get(c) for c in token]
        table.append(token.encode() if None in mapped else bytes(mapped))  # type: ignore[arg-type]
    return table


class Vocabulary:
    """A tokenizer shared by every decoding state (read-only after loading, so thread-safe).

    `byte_table` is set when the decoder is exactly ByteLevel: then the text of ids is the UTF-8
    decoding (invalid sequences replaced) of their concatenated bytes, and an incremental UTF-8
    decoder produces it without calling the tokenizer. `byte_ids` are the byte-fallback tokens
    (`<0x00>`…`<0xFF>`) when the decoder has a ByteFallback step: it decodes a run of them as UTF-8 only
    once the run ends, and an invalid run turns every byte of it into U+FFFD, so the text of a run can
    change until a non-byte token closes it.
    """

    def __init__(self, tokenizer: Tokenizer, *, byte_table: bool = True) -> None:
        self.tokenizer = tokenizer
        self.size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        self._byte_values: dict[int, int] = {}  # byte-fallback id → its byte
        if _uses(decoder, "ByteFallback"):
            vocab = tokenizer.get_vocab(with_added_tokens=False)
            self._byte_values = {i: int(t[3:5], 16) for t, i in vocab.items() if BYTE_TOKEN.fullmatch(t)}
        self.byte_ids = frozenset(self._byte_values)
        self._byte_level = _uses(decoder, "ByteLevel")
        pure_byte_level = isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"
        self.byte_table = _byte_table(tokenizer, self.size) if byte_table and pure_byte_level else None

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> Vocabulary:
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found (need a Hugging Face fast tokenizer)")
        return cls(Tokenizer.from_file(str(path)))

    def check(self, ids: Sequence[int]) -> None:
        """Raises BadIds unless every id is in [0, size)."""
        size = self.size
        if len(ids) == 1:
            if 0 <= ids[0] < size:
                return
        elif not ids or (min(ids) >= 0 and max(ids) < size):
            return
        bad = next(i for i in ids if not 0 <= i < size)
        raise BadIds(f"token id {bad} is outside the vocabulary [0, {size})")

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> bytes:
        """The bytes token `token_id` adds to the text of the tokens before it (an id already checked).

        A byte-fallback token is its one byte (`<0xE2>` is b"\\xe2"); under a ByteLevel decoder a token is
        its bytes in the byte alphabet, part of a character included; a special token is its text.
        Otherwise it is what the token adds to the text of a plain token before it, so a SentencePiece
        "▁the" is b" the" and a WordPiece "##s" b"s". The pieces of a sequence join to the UTF-8 of its
        decoded text (a leading space a decoder strips at the start included)."""
        byte = self._byte_values.get(token_id)
        if byte is not None:
            return bytes((byte,))
        if self._piece_table is not None:
            return self._piece_table[token_id]
        if self._anchor is None:
            return self.decode([token_id]).encode()
        anchor_id, anchor_text = self._anchor
        text = self.decode([anchor_id, token_id])
        if not text.startswith(anchor_text):
            return self.decode([token_id]).encode()
        return text[len(anchor_text) :].encode()

    @functools.cached_property
    def _piece_table(self) -> list[bytes] | None:
        """Every id's bytes when the decoder maps the byte alphabet back to bytes (ByteLevel)."""
        if self.byte_table is not None:
            return self.byte_table
        return _byte_table(self.tokenizer, self.size) if self._byte_level else None

    @functools.cached_property
    def _anchor(self) -> tuple[int, str] | None:
        """A plain token (its id and text: one ASCII letter or digit) to decode other tokens after."""
        for token_id in range(self.size):
            if token_id in self.special_ids or token_id in self._byte_values:
                continue
            text = self.decode([token_id])
            if len(text) == 1 and text.isascii() and text.isalnum():
                return token_id, text
        return None

    def text_source(self, context: Sequence[int]) -> TextSource:
        """A fresh source for a request whose prompt ends with `context` (special tokens to skip
        already removed)."""
        if self.byte_table is not None:
            return ByteSource(self.byte_table)
        return WindowSource(self, context)


class TextSource(Protocol):
    """Ids in, settled text out: `push` returns the text that no later id can change; `flush`
    returns the rest at the end of the stream."""

    def push(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class ByteSource:
    """For ByteLevel decoders: table bytes through UTF-8 decoding that holds back an incomplete
    character and replaces invalid bytes as the full decode does. The context needs no decoding: text
    after a complete character does not depend on what came before."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._pending = b""  # the start of an incomplete character

    def push(self, ids: Sequence[int]) -> str:
        table = self._table
        data = table[ids[0]] if len(ids) == 1 else b"".join([table[i] for i in ids])
        if self._pending:
            data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[used:] if used != len(data) else b""
        return text

    def flush(self) -> str:
        text, _ = codecs.utf_8_decode(self._pending, "replace", True)
        self._pending = b""
        return text


class WindowSource:
    """For any decoder: the prefix/read-offset method over a window of ids, decoded by the tokenizer."""

    def __init__(self, vocab: Vocabulary, context: Sequence[int]) -> None:
        self._decode = functools.partial(vocab.tokenizer.decode, skip_special_tokens=False)
        self._byte_ids = vocab.byte_ids
        ids = list(context)
        while ids and ids[-1] in self._byte_ids:
            ids.pop()  # an open byte run could still change with the generated bytes
        prefix_text = self._decode(ids) if ids else ""
        if prefix_text.endswith(REPLACEMENT):
            ids, prefix_text = [], ""
        self._ids = ids
        self._prefix_offset = 0
        self._read_offset = len(ids)
        self._emitted = len(prefix_text)  # characters of the window's text already emitted (or context)

    def push(self, ids: Sequence[int]) -> str:
        """Only a trailing run of U+FFFD (or an open byte-fallback run) can still change as ids
        arrive, so everything before it is returned now."""
        self._ids.extend(ids)
        if self._ids[-1] in self._byte_ids:
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        if text.endswith(REPLACEMENT):
            stable = len(text.rstrip(REPLACEMENT))
            if stable <= self._emitted:
                return ""
            delta = text[self._emitted : stable]
            self._emitted = stable
            return delta
        if len(text) <= self._emitted:
            return ""
        delta = text[self._emitted :]
        self._emitted = len(self._decode(self._ids[self._read_offset :]))
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def flush(self) -> str:
        text = self._decode(self._ids[self._prefix_offset :])
        tail = text[self._emitted :]
        self._ids.clear()
        self._prefix_offset = self._read_offset = self._emitted = 0
        return tail


class DecodeState:
    """Decoding state of one request.

    `add(ids)` returns the text those ids complete (possibly ""); `close()` returns what was held back.
    After a stop string matched, `stop` names it, `num_ids_consumed` counts the generated ids up to and
    including the one that completed it, and every later call returns "".
    With `skip_special_tokens` the text leaves out special tokens, except `keep_special_ids`.
    """

    def __init__(
        self,
        vocab: Vocabulary,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        keep_special_ids: Sequence[int] = (),
    ) -> None:
        self._skip = vocab.special_ids - frozenset(keep_special_ids) if skip_special_tokens else frozenset()
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._source = vocab.text_source([i for i in prompt_ids if i not in self._skip])
        self._held = ""  # settled text kept back as a possible stop-string start
        self.num_ids_consumed = 0
        self.stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def add(self, ids: Sequence[int]) -> str:
        """Appends generated ids; returns the text they complete."""
        if self.stop is not None:
            return ""
        if not self._stops:
            self.num_ids_consumed += len(ids)
            kept = [i for i in ids if i not in self._skip] if self._skip else ids
            return self._source.push(kept) if kept else ""
        out: list[str] = []
        for token_id in ids:
            self.num_ids_consumed += 1
            if token_id in self._skip:
                continue
            out.append(self._match(self._source.push((token_id,))))
            if self.stop is not None:
                break
        return "".join(out)

    def close(self) -> str:
        """The rest of the text, including an incomplete character at the end (as U+FFFD) and a held
        tail that did not become a stop string."""
        if self.stop is not None:
            return ""
        tail = self._source.flush()
        if not self._stops:
            return tail
        out = self._match(tail)
        if self.stop is None:
            out += self._held
            self._held = ""
        return out

    def _match(self, text: str) -> str:
        """Stop matching on newly settled text: returns what may be emitted now."""
        if not text:
            return ""
        buf = self._held + text
        found = first_stop(buf, self._stops)
        if found is not None:
            start, stop = found
            self.stop = stop
            self._held = ""
            return buf[: start + len(stop)] if self._include_stop else buf[:start]
        keep = stop_prefix_len(buf, self._stops, self._max_stop_len)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]


@dataclass(frozen=True)
class Final:
    """The last word on a request: after a close, a stop string, or an error."""

    request_id: str
    stopped: bool = False
    stop: str = ""
    num_ids_consumed: int = 0
    error: str = ""


class Output(NamedTuple):
    """What one chunk or close of a request gives: its new text (possibly ""), the generated ids
    consumed so far (a running count, never past the id that completed a stop string; 0 when the
    request is unknown or already finished), and the request's Final if this ended it."""

    text: str
    num_ids: int
    final: Final | None


class Session:
    """The open requests of one caller (one multiplexed call, or one per-request call).

    Every request gets exactly one Final: after its close, its stop string, or an error. After its
    Final, chunks and a close for the same id are ignored (a bounded memory of finished ids), until a
    new start reopens the id. Not thread-safe: one caller's entries are processed in order.
    """

    def __init__(self, vocab: Vocabulary, *, remember_finished: int = 65536) -> None:
        self.vocab = vocab
        self.states: dict[str, DecodeState] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_finished

    def start(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        keep_special_ids: Sequence[int] = (),
    ) -> Final | None:
        """Opens a request; returns a Final with `error` if it cannot be opened."""
        if not request_id:
            return Final(request_id, error="start without a request_id")
        if request_id in self.states:
            return Final(request_id, error=f"request {request_id!r} is already open")
        try:
            self.vocab.check(prompt_ids)
        except BadIds as exc:
            return self._finish(Final(request_id, error=f"prompt_ids: {exc}"))
        self._finished.pop(request_id, None)
        self.states[request_id] = DecodeState(
            self.vocab,
            prompt_ids=prompt_ids,
            skip_special_tokens=skip_special_tokens,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            keep_special_ids=keep_special_ids,
        )
        return None

    def chunk(self, request_id: str, ids: Sequence[int]) -> Output:
        """Text completed by `ids`, and a Final if a stop string matched or the chunk is invalid."""
        state = self.states.get(request_id)
        if state is None:
            if request_id in self._finished:
                return Output("", 0, None)
            unknown = Final(request_id, error=f"chunk for unknown request {request_id!r}")
            return Output("", 0, self._finish(unknown))
        try:
            self.vocab.check(ids)
        except BadIds as exc:
            del self.states[request_id]
            final = Final(request_id, num_ids_consumed=state.num_ids_consumed, error=str(exc))
            return Output("", state.num_ids_consumed, self._finish(final))
        text = state.add(ids)
        if state.stop is None:
            return Output(text, state.num_ids_consumed, None)
        del self.states[request_id]
        final = Final(request_id, stopped=True, stop=state.stop, num_ids_consumed=state.num_ids_consumed)
        return Output(text, state.num_ids_consumed, self._finish(final))

    def close(self, request_id: str) -> Output:
        """Flushes and forgets a request: the rest of its text and its Final."""
        state = self.states.pop(request_id, None)
        if state is None:
            if request_id in self._finished:
                return Output("", 0, None)
            unknown = Final(request_id, error=f"close for unknown request {request_id!r}")
            return Output("", 0, self._finish(unknown))
        text = state.close()
        final = Final(
            request_id, stopped=state.stopped, stop=state.stop or "", num_ids_consumed=state.num_ids_consumed
        )
        return Output(text, state.num_ids_consumed, self._finish(final))

    def _finish(self, final: Final) -> Final:
        if final.request_id:
            self._finished[final.request_id] = None
            self._finished.move_to_end(final.request_id)
            while len(self._finished) > self._remember:
                self._finished.popitem(last=False)
        return final
