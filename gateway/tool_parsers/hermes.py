"""The `hermes` tool-call format (Qwen 2.5 and 3, Hermes, the tiny model): a call is a block
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text, one or more. The text
outside the blocks is content, less the whitespace touching a block. The end of a block is the first
`</tool_call>`, even inside a JSON string.

A required call's grammar writes each call as `<tool_call>\\n{"name": "NAME", "arguments": ` then its
arguments then `}\\n</tool_call>`, calls separated by "\\n": byte for byte what the tiny model's chat
template writes for a call in the history, and what the parser reads. Streaming follows the contract
of `gateway.tool_parsers.base`.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_parsers.base import PendingCall, ToolCallStream, emittable, new_call_id, tag_prefix_len

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class HermesToolCalls(ToolCallStream):
    """`<tool_call>{json}</tool_call>` blocks; the text around them is content, except whitespace
    that touches a block (a piece before a block loses its trailing whitespace, one after it its
    leading whitespace)."""

    NAME = "hermes"
    CALLS_OPEN, CALLS_SEPARATOR, CALLS_CLOSE = "", "\n", ""
    CALL_OPEN, CALL_CLOSE = OPEN_TAG + '\n{{"name": "{name}", "arguments": ', "}\n" + CLOSE_TAG
    MARKS = (OPEN_TAG, CLOSE_TAG)

    @classmethod
    def recognises(cls, chat_template: str) -> bool:
        return OPEN_TAG in chat_template

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._after_block = False  # the current content piece follows a block

    def _advance(self, *, final: bool) -> None:
        while True:
            if self._call is None:
                start = self._buf.find(OPEN_TAG)
                if start < 0:  # emits all but what may still precede a block
                    emit = emittable(self._buf, OPEN_TAG, final=final)
                    self._piece(self._buf[:emit])
                    self._buf = self._buf[emit:]
                    return
                self._piece(self._buf[:start].rstrip())
                self._buf = self._buf[start + len(OPEN_TAG) :]
                self._call = PendingCall(OPEN_TAG)
                continue
            end = self._buf.find(CLOSE_TAG)
            if end < 0:
                keep = 0 if final else tag_prefix_len(self._buf, CLOSE_TAG)
                self._read_call(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return
            self._read_call(self._buf[:end])
            self._call.raw.append(CLOSE_TAG)
            self._close(self._call)
            self._call, self._after_block = None, True
            self._buf = self._buf[end + len(CLOSE_TAG) :]

    def _read_call(self, text: str) -> None:
        assert self._call is not None
        self._call.raw.append(text)
        self._call.obj.feed(text)  # what follows the object, up to the closing tag, is ignored
        self._progress(self._call)

    def _piece(self, text: str) -> None:
        if self._after_block:
            text = text.lstrip()
            self._after_block = not text
        self._content(text)
