"""The shared part of the tool-call formats: what a parser gives, the readers of one call's JSON object,
and `ToolCallStream`, every format's base: its incremental parser and its required call's `grammar`.

`feed(text)` returns a `ParsedDelta`: content, and tool-call deltas in OpenAI's streaming shape (a call's
first delta has its index, id, name and empty arguments, the next ones argument fragments); `finish()`
flushes what was held back; `parse(text)` does both and merges the deltas into (content, calls).
Contract: however a text is split into deltas, the merged deltas equal `parse(text)`; nothing is emitted
that may yet belong to a call (a possible opening and the whitespace before it, a call until its name is
known); a call's `arguments` is its arguments' JSON text as written (a JSON string value decoded), "{}"
when none, only nesting checked while streaming; an object without a string "name" is content. What
`grammar` makes the model write, the same class reads as calls (its form: docs/architecture.md).
"""

from __future__ import annotations

import abc
import json
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


# ---- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of a streamed delta's `tool_calls`: the first of a call carries id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ParsedDelta:
    """What one `feed` or `finish` gives: content text and tool-call deltas, in that order."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def merge(deltas: Iterable[ParsedDelta]) -> tuple[str, list[ToolCall]]:
    """Content and whole calls from a stream's deltas (in order)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name is not None
                calls.append(ToolCall(d.id, d.name, d.arguments))
            else:
                calls[d.index] = replace(calls[d.index], arguments=calls[d.index].arguments + d.arguments)
    return "".join(content), calls


# ---- reading one call's JSON object --------------------------------------------------------------

_SCALAR_CHARS = frozenset("-+0123456789.eEtrufalsn")
_ARGUMENT_KEYS = ("arguments", "parameters")


class JsonValue:
    """Finds where one JSON value ends, read a character at a time (only nesting is checked)."""

    def __init__(self) -> None:
        self.kind = ""  # "container", "string" or "scalar" once the first character is read
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def take(self, c: str) -> bool:
        """Whether `c` belongs to the value (then `done` tells whether it was the last). False when
        `c` ends a scalar (`done` is set, `c` is not the value's) or no value starts with `c`."""
        if not self.kind:
            return self._start(c)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                self.done = self.kind == "string"
            return True
        if self.kind == "scalar":
            if c in _SCALAR_CHARS:
                return True
            self.done = True
            return False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True

    def _start(self, c: str) -> bool:
        if c in "{[":
            self.kind, self.depth = "container", 1
        elif c == '"':
            self.kind, self.in_string = "string", True
        elif c in _SCALAR_CHARS:
            self.kind = "scalar"
        else:
            return False
        return True


class _CallObject:
    """Reads one JSON object a character at a time and picks out its "name" (a string) and its first
    "arguments" or "parameters" value. The object ends at its closing brace (`state` "done") or at
    the first character that breaks the JSON syntax ("broken"); later characters are not read."""

    def __init__(self) -> None:
        self.state = "open"
        self.name: str | None = None
        self.has_arguments = False
        self._key: list[str] = []
        self._key_escaped = False
        self._field = ""  # what the value being read is: "name", "arguments", "quoted" (arguments) or ""
        self._value = JsonValue()
        self._raw: list[str] = []  # the name's or quoted arguments' JSON text
        self._arguments: list[str] = []  # arguments text not yet taken

    @property
    def ended(self) -> bool:
        return self.state in ("done", "broken")

    def feed(self, text: str) -> int:
        """Reads `text`; returns how many characters belong to the object (all unless it ends)."""
        for i, c in enumerate(text):
            if self.ended:
                return i
            self._step(c)
        return len(text)

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def _step(self, c: str) -> None:
        state = self.state
        if state in ("open", "key_or_end", "colon", "value_start", "after_value") and c.isspace():
            return
        if state == "open":
            self.state = "key_or_end" if c == "{" else "broken"
        elif state == "key_or_end":
            self.state = {'"': "key", "}": "done"}.get(c, "broken")
        elif state == "key":
            self._key_char(c)
        elif state == "colon":
            self.state = "value_start" if c == ":" else "broken"
        elif state == "value_start":
            self._value = JsonValue()
            self._start_field()
            self.state = "value"
            self._value_char(c)
        elif state == "value":
            self._value_char(c)
        elif state == "after_value":
            self.state = {",": "key_or_end", "}": "done"}.get(c, "broken")

    def _key_char(self, c: str) -> None:
        if self._key_escaped:
            self._key_escaped = False
        elif c == "\\":
            self._key_escaped = True
        elif c == '"':
            self.state = "colon"
            return
        self._key.append(c)

    def _start_field(self) -> None:
        try:
            key = json.loads('"' + "".join(self._key) + '"')
        except ValueError:
            key = ""
        self._key.clear()
        self._raw.clear()
        self._field = ""
        if key == "name" and self.name is None:
            self._field = "name"
        elif key in _ARGUMENT_KEYS and not self.has_arguments:
            self._field = "arguments"
            self.has_arguments = True

    def _value_char(self, c: str) -> None:
        if not self._value.take(c):
            if not self._value.done:  # no JSON value starts with c
                self.state = "broken"
                return
            self._end_value()
            self._step(c)  # the character after a number or literal
            return
        if self._field == "arguments" and self._value.kind == "string":
            self._field = "quoted"
        if self._field == "arguments":
            self._arguments.append(c)
        elif self._field:
            self._raw.append(c)
        if self._value.done:
            self._end_value()

    def _end_value(self) -> None:
        self.state = "after_value"
        raw = "".join(self._raw)
        if self._field == "name" and self._value.kind == "string":
            self.name = _json_string(raw)
        elif self._field == "quoted":
            decoded = _json_string(raw)
            self._arguments.append(raw if decoded is None else decoded)
        self._field = ""


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def emittable(text: str, tag: str, *, final: bool) -> int:
    """How much of `text`, which holds no whole `tag`, may go out as it is now: all of it at the end
    (`final`); else all but a possible start of `tag` and the whitespace before it (whitespace that
    touches a tag goes out on neither side)."""
    return len(text) if final else len(text[: len(text) - tag_prefix_len(text, tag)].rstrip())


class PendingCall:
    """A call being read: its object, its text so far (content if it turns out to have no name) and
    its index once its name is known."""

    def __init__(self, opening: str) -> None:
        self.obj = _CallObject()
        self.raw = [opening]
        self.index: int | None = None


# ---- the base of every format ------------------------------------------------------------------


class ToolCallStream(abc.ABC):
    """An incremental tool-call parser for one generated text (see the module docstring), and the
    grammar of its format. Not thread-safe; one instance per request. Every format's class sets the
    class attributes: `NAME` (its `--tool-call-parser` name); how its format writes calls, for the
    grammar of a required call: CALLS_OPEN, then each call as CALL_OPEN (with `{name}`), the arguments
    and CALL_CLOSE, separated by CALLS_SEPARATOR, then CALLS_CLOSE; and `MARKS`, the marks its parser
    reads, kept in the text where the tokenizer has them as special tokens."""

    NAME: str
    CALLS_OPEN: str
    CALLS_SEPARATOR: str
    CALLS_CLOSE: str
    CALL_OPEN: str
    CALL_CLOSE: str
    MARKS: tuple[str, ...]

    @classmethod
    def recognises(cls, chat_template: str) -> bool:
        """Whether a chat template writes calls in this format."""
        return False

    @classmethod
    def grammar(cls, tools: Sequence[tuple[str, str]], *, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of one or more calls in this format (exactly one
        when not `parallel`), each to one of `tools`: (name, the `%json` schema text of its arguments
        object). The form of a call: the class docstring above."""
        calls = "call" + (f" ({json.dumps(cls.CALLS_SEPARATOR)} call)*" if parallel else "")
        start = [json.dumps(cls.CALLS_OPEN), calls, json.dumps(cls.CALLS_CLOSE)]
        rules = [
            "start: " + " ".join(part for part in start if part != '""'),
            "call: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
        ]
        for i, (name, schema) in enumerate(tools):
            opening = json.dumps(cls.CALL_OPEN.format(name=name))
            rules.append(f"tool_{i}: {opening} %json {schema} {json.dumps(cls.CALL_CLOSE)}")
        return "\n".join(rules) + "\n"

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._count = 0
        self._out = ParsedDelta()
        self._buf = ""  # received, not yet emitted or read into a call
        self._call: PendingCall | None = None

    @property
    def called(self) -> bool:
        """Whether a tool call has begun (the finish reason is then `tool_calls`)."""
        return self._count > 0

    def feed(self, text: str) -> ParsedDelta:
        """Takes the next text delta; returns what can be emitted now."""
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """The end of the text: emits what was held back. Call once, after the last `feed`."""
        self._advance(final=True)
        if self._call is not None:  # the text ended inside a call
            self._close(self._call)
            self._call = None
        return self._take()

    @abc.abstractmethod
    def _advance(self, *, final: bool) -> None:
        """Reads the buffer as far as it can be read now; all of it when `final` (the text ended)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """One-shot: the content and calls of a whole text (on a fresh instance)."""
        return merge([self.feed(text), self.finish()])

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text

    def _progress(self, call: PendingCall) -> None:
        """Emits a call's opening once its name is known, then its arguments as they come."""
        if call.index is None and call.obj.name is not None:
            call.index = self._count
            self._count += 1
            self._out.tool_calls.append(ToolCallDelta(call.index, "", self._new_id(), call.obj.name))
        if call.index is not None:
            self._arguments(call.index, call.obj.take_arguments())

    def _arguments(self, index: int, text: str) -> None:
        if not text:
            return
        deltas = self._out.tool_calls
        if deltas and deltas[-1].index == index and deltas[-1].id is None:
            deltas[-1] = replace(deltas[-1], arguments=deltas[-1].arguments + text)
        else:
            deltas.append(ToolCallDelta(index, text))

    def _close(self, call: PendingCall) -> bool:
        """Ends a call: True when it was one, else its text becomes content."""
        self._progress(call)
        if call.index is None:
            self._content("".join(call.raw))
            return False
        if not call.obj.has_arguments:
            self._arguments(call.index, "{}")
        return True


def finish_reason(reason: str, stream: ToolCallStream) -> str:
    """OpenAI's finish reason: `tool_calls` for an output that ended by itself (`stop`) with calls."""
    return "tool_calls" if reason == "stop" and stream.called else reason
