"""The `mistral` tool-call format: calls follow a `[TOOL_CALLS]` marker, in either form Mistral's chat
templates write: a JSON array of call objects, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
(v3 templates: Mistral 7B v0.3, Mixtral 8x22B, Nemo), or `[TOOL_CALLS]NAME[ARGS]{...}`, one marker per
call (v11 and later: Mistral Small 3.2, Magistral, Devstral). The array may also start the output
without the marker, as when the marker, a special token, was skipped from the text (the gateway asks the
detokenizer to keep `MARKS`, but a client may decode ids itself). Text before the first marker, and
after the calls, is content. An object without a string "name" makes it and the rest content; a broken
object or value after its name ends the calls (the rest is dropped), as in `llama3_json`. A required
call's grammar writes the v3 array form. Streaming follows the contract of `gateway.tool_parsers.base`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gateway.tool_parsers.base import (
    JsonValue,
    PendingCall,
    ToolCallDelta,
    ToolCallStream,
    emittable,
    new_call_id,
    tag_prefix_len,
)

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ARRAY_SEPARATORS = re.compile(r"[\s,]*")


class MistralToolCalls(ToolCallStream):
    """`[TOOL_CALLS]` calls (see the module docstring). One instance per request."""

    NAME = "mistral"
    # How the grammar of a required call writes calls: the v3 array form.
    CALLS_OPEN, CALLS_SEPARATOR, CALLS_CLOSE = MARK + "[", ", ", "]"
    CALL_OPEN, CALL_CLOSE = '{{"name": "{name}", "arguments": ', "}"
    MARKS = (MARK, ARGS)  # special tokens in Mistral's tokenizers, kept in the text for the parser

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        # start (nothing seen yet), text, marked (after a marker), array, name, args, after, drop
        self._mode = "start"
        self._value = JsonValue()
        self._index = 0  # the call whose [ARGS] value is being read

    @classmethod
    def recognises(cls, chat_template: str) -> bool:
        return MARK in chat_template

    def _advance(self, *, final: bool) -> None:
        while self._buf and getattr(self, f"_{self._mode}")(final):
            pass
        if final and self._mode == "args" and not self._value.kind:  # the text ended after [ARGS]
            self._arguments(self._index, "{}")

    # Each state reads from the buffer; False = it needs more text (or `final`) to go on.

    def _start(self, final: bool) -> bool:
        """An output that opens with `[` then `{` (whitespace aside) is the bare array form."""
        text = self._buf.lstrip()
        if not final and (not text or MARK.startswith(text)):
            return False  # whitespace so far, or perhaps the start of the marker
        if text.startswith("[") and not text.startswith(MARK):
            rest = text[1:].lstrip()
            if not rest and not final:
                return False
            if rest.startswith("{"):
                self._call = PendingCall(self._buf[: len(self._buf) - len(rest)])
                self._buf, self._mode = rest, "array"
                return True
        self._mode = "text"
        return True

    def _text(self, final: bool) -> bool:
        at = self._buf.find(MARK)
        if at < 0:
            emit = emittable(self._buf, MARK, final=final)
            self._content(self._buf[:emit])
            self._buf = self._buf[emit:]
            return False
        self._content(self._buf[:at].rstrip())
        self._buf, self._mode = self._buf[at + len(MARK) :], "marked"
        return True

    def _marked(self, final: bool) -> bool:
        text = self._buf.lstrip()
        if not text:
            self._buf = ""
            return False
        if text.startswith("["):
            self._buf, self._mode = text[1:], "array"
        else:
            self._buf, self._mode = text, "name"
        return True

    def _array(self, final: bool) -> bool:
        """Between the objects of the array form: separators, then an object or the closing `]`."""
        if self._call is None:
            text = self._buf[_ARRAY_SEPARATORS.match(self._buf).end() :]  # type: ignore[union-attr]
            self._buf = text
            if not text:
                return False
            if text.startswith("]"):
                self._buf, self._mode = text[1:], "after"
                return True
            if not text.startswith("{"):
                self._mode = "after"
                return True
            self._call = PendingCall("")
        call = self._call
        used = call.obj.feed(self._buf)
        call.raw.append(self._buf[:used])
        self._buf = self._buf[used:]
        self._progress(call)
        if not call.obj.ended:
            return False
        self._call = None
        if not self._close(call):
            self._mode = "text"  # an object without a name: it and the rest are content
        elif call.obj.state != "done":
            self._mode = "drop"
        return True

    def _name(self, final: bool) -> bool:
        """`NAME[ARGS]`: the call opens once its name is whole; anything else is content."""
        at = self._buf.find(ARGS)
        if at >= 0 and _NAME.fullmatch(self._buf[:at].strip()):
            self._index = self._count
            self._count += 1
            name = self._buf[:at].strip()
            self._out.tool_calls.append(ToolCallDelta(self._index, "", self._new_id(), name))
            self._buf, self._mode, self._value = self._buf[at + len(ARGS) :], "args", JsonValue()
            return True
        head = self._buf[: len(self._buf) - tag_prefix_len(self._buf, ARGS)].strip()
        if at < 0 and not final and (not head or _NAME.fullmatch(head)):
            return False  # the name, or [ARGS], may still be arriving
        self._content(MARK + self._buf)  # not a call after all
        self._buf, self._mode = "", "text"
        return True

    def _args(self, final: bool) -> bool:
        """The call's arguments: one JSON value, passed on as it comes."""
        if not self._value.kind:
            self._buf = self._buf.lstrip()
        for i, c in enumerate(self._buf):
            if not self._value.take(c):  # a scalar ended before c, or no value starts with c
                self._arguments(self._index, self._buf[:i])
                self._buf = self._buf[i:]
                self._end_args(ended=self._value.done)
                return True
            if self._value.done:
                self._arguments(self._index, self._buf[: i + 1])
                self._buf = self._buf[i + 1 :]
                self._end_args(ended=True)
                return True
        self._arguments(self._index, self._buf)
        self._buf = ""
        if final:
            self._end_args(ended=self._value.kind == "scalar")
        return False

    def _end_args(self, *, ended: bool) -> None:
        if not self._value.kind:
            self._arguments(self._index, "{}")
        self._mode = "after" if ended else "drop"

    def _after(self, final: bool) -> bool:
        """After the calls: another marker opens one more; other text is content."""
        text = self._buf.lstrip()
        if not text or (not final and MARK.startswith(text)):
            return False
        if text.startswith(MARK):
            self._buf, self._mode = text[len(MARK) :], "marked"
        else:
            self._buf, self._mode = text, "text"
        return True

    def _drop(self, final: bool) -> bool:
        self._buf = ""
        return False
