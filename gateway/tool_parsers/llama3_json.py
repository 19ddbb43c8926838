"""The `llama3_json` tool-call format (Llama 3.1 to 3.3): an output that starts (after whitespace and an
optional `<|python_tag|>`) with `{` is a list of JSON objects `{"name": ..., "parameters"|"arguments":
{...}}` separated by `;`; the text after the last one, if any, is content. Any other output is content.

A required call's grammar writes the calls as `{"name": "NAME", "parameters": ...}` objects separated
by "; " (no `<|python_tag|>`: the parser reads calls with or without it), so the output starts with `{`
and the parser reads every call. Streaming follows the contract of `gateway.tool_parsers.base`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gateway.tool_parsers.base import PendingCall, ToolCallStream, new_call_id

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"[\s;]*")  # between calls


class Llama3JsonToolCalls(ToolCallStream):
    """JSON objects `{"name": ..., "parameters": ...}` separated by `;` when the output starts with
    one (after whitespace and an optional `<|python_tag|>`); otherwise all content. After the last
    object, the text from the first character that is neither whitespace nor `;` is content. An object
    without a name makes it and the rest content; a broken one after its name ends the calls (the rest
    is dropped)."""

    NAME = "llama3_json"
    CALLS_OPEN, CALLS_SEPARATOR, CALLS_CLOSE = "", "; ", ""
    CALL_OPEN, CALL_CLOSE = '{{"name": "{name}", "parameters": ', "}"
    MARKS = (PYTHON_TAG,)

    @classmethod
    def recognises(cls, chat_template: str) -> bool:
        """`<|python_tag|>` (Llama 3.1, 3.3), or Llama 3's headers with calls written as
        `{"name": ..., "parameters": ...}` (Llama 3.2)."""
        headers = "<|start_header_id|>" in chat_template and '"parameters"' in chat_template
        return PYTHON_TAG in chat_template or headers

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._mode = "start"  # start, call, between, content or drop

    def _advance(self, *, final: bool) -> None:
        while self._buf:
            if self._mode == "start" and not self._start(final=final):
                return
            if self._mode == "call":
                self._read_call()
            elif self._mode == "between":
                self._between()
            elif self._mode == "content":
                self._content(self._buf)
                self._buf = ""
            elif self._mode == "drop":
                self._buf = ""

    def _start(self, *, final: bool) -> bool:
        """Decides between calls and content once the first telling character is in; False while
        it is not (the buffer is whitespace, or whitespace and a part of `<|python_tag|>`)."""
        text = self._buf.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(text):
            text = ""
        if not text and not final:
            return False
        if text.startswith("{"):
            opening = self._buf[: len(self._buf) - len(text)]
            self._call, self._buf, self._mode = PendingCall(opening), text, "call"
        else:
            self._mode = "content"
        return True

    def _read_call(self) -> None:
        call = self._call
        assert call is not None
        used = call.obj.feed(self._buf)
        call.raw.append(self._buf[:used])
        self._buf = self._buf[used:]
        self._progress(call)
        if not call.obj.ended:
            return
        named = self._close(call)
        self._call = None
        if not named:
            self._mode = "content"
        else:
            self._mode = "between" if call.obj.state == "done" else "drop"

    def _between(self) -> None:
        text = self._buf[_SEPARATORS.match(self._buf).end() :]  # type: ignore[union-attr]
        if text.startswith("{"):
            self._call, self._mode = PendingCall(""), "call"
        elif text:
            self._mode = "content"
        self._buf = text
