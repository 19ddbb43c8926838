"""What a chat completion's generated text becomes for the client: reasoning (`--reasoning-parser`),
then content, then tool calls (`--tool-call-parser`, when the request's tools are read for calls).

`ChatOutput` chains the two incremental parsers: the text goes to the reasoning splitter when one is
on, and what it gives as content goes to the tool-call parser when there is one. Both parsers are
split invariant (see `gateway.reasoning` and `gateway.tool_calls`), so the chain is: however the text
arrives, the merged deltas are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.reasoning import ReasoningStream
from gateway.tool_calls import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    finish_reason,
    merge,
    tool_call_stream,
)

REASONING_PARSERS = ("think",)


@dataclass
class ChatDelta:
    """One step of output: reasoning text, content text and tool-call deltas (OpenAI's streaming
    shape), any of them empty."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutput:
    """Splits one chat generation's text, incrementally. `reasoning`: split `<think>` text out;
    `tool_parser`: a name of `tool_calls.PARSERS`, or None to read no tool calls. One per request."""

    def __init__(self, *, reasoning: bool, tool_parser: str | None) -> None:
        self._reasoning = ReasoningStream() if reasoning else None
        self._tools: ToolCallStream | None = tool_call_stream(tool_parser) if tool_parser else None

    @property
    def splits_reasoning(self) -> bool:
        """Whether reasoning text is split out (the message then has `reasoning_content`)."""
        return self._reasoning is not None

    def feed(self, text: str) -> ChatDelta:
        """Takes the next text delta; returns what can be emitted now."""
        if self._reasoning is None:
            return self._content(text, "", final=False)
        split = self._reasoning.feed(text)
        return self._content(split.content, split.reasoning, final=False)

    def finish(self) -> ChatDelta:
        """The end of the text: emits what was held back. Call once, after the last `feed`."""
        if self._reasoning is None:
            return self._content("", "", final=True)
        split = self._reasoning.finish()
        return self._content(split.content, split.reasoning, final=True)

    def parse(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """One-shot: (reasoning, content, calls) of a whole text (on a fresh instance)."""
        first, last = self.feed(text), self.finish()
        content, calls = merge(
            [ParsedDelta(first.content, first.tool_calls), ParsedDelta(last.content, last.tool_calls)]
        )
        return first.reasoning + last.reasoning, content, calls

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: `tool_calls` for an output that ended by itself with calls."""
        return reason if self._tools is None else finish_reason(reason, self._tools)

    def _content(self, text: str, reasoning: str, *, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(reasoning, text)
        parsed = self._tools.feed(text)
        if final:
            last = self._tools.finish()
            parsed = ParsedDelta(parsed.content + last.content, parsed.tool_calls + last.tool_calls)
        return ChatDelta(reasoning, parsed.content, parsed.tool_calls)
