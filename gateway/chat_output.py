"""What a chat completion's generated text becomes for the client: reasoning (`--reasoning-parser`),
then content, then tool calls (`--tool-call-parser`, when the request's tools are read for calls).

`ChatOutput` chains the two incremental parsers: the text goes to the reasoning splitter when one is
on, and what it gives as content goes to the tool-call parser when there is one. Both parsers are
split invariant (see `gateway.reasoning` and `gateway.tool_calls`), so the chain is: however the text
arrives, the merged deltas are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.reasoning import ReasoningDelta, ReasoningStream
from gateway.tool_calls import ParsedDelta, ToolCall, ToolCallStream, finish_reason, merge
from gateway.tool_parsers import tool_call_stream


@dataclass
class ChatDelta(ParsedDelta):
    """One step of output: reasoning text, content text and tool-call deltas (OpenAI's streaming
    shape), any of them empty."""

    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning) or super().__bool__()


class ChatOutput:
    """Splits one chat generation's text, incrementally. `reasoning`: split `<think>` text out
    (`in_reasoning`: the text starts inside a think block, its prompt having opened it);
    `tool_parser`: a name of `tool_parsers.PARSERS`, or None to read no tool calls. One per request."""

    def __init__(self, *, reasoning: bool, tool_parser: str | None, in_reasoning: bool = False) -> None:
        self._reasoning = ReasoningStream(in_reasoning=in_reasoning) if reasoning else None
        self._tools: ToolCallStream | None = tool_call_stream(tool_parser) if tool_parser else None

    @property
    def splits_reasoning(self) -> bool:
        """Whether reasoning text is split out (the message then has `reasoning_content`)."""
        return self._reasoning is not None

    def feed(self, text: str) -> ChatDelta:
        """Takes the next text delta; returns what can be emitted now."""
        split = ReasoningDelta(content=text) if self._reasoning is None else self._reasoning.feed(text)
        return self._content(split, final=False)

    def finish(self) -> ChatDelta:
        """The end of the text: emits what was held back. Call once, after the last `feed`."""
        return self._content(
            ReasoningDelta() if self._reasoning is None else self._reasoning.finish(), final=True
        )

    def parse(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """One-shot: (reasoning, content, calls) of a whole text (on a fresh instance)."""
        first, last = self.feed(text), self.finish()
        content, calls = merge([first, last])
        return first.reasoning + last.reasoning, content, calls

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: `tool_calls` for an output that ended by itself with calls."""
        return reason if self._tools is None else finish_reason(reason, self._tools)

    def _content(self, split: ReasoningDelta, *, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(split.content, reasoning=split.reasoning)
        parsed = self._tools.feed(split.content)
        if final:
            last = self._tools.finish()
            parsed = ParsedDelta(parsed.content + last.content, parsed.tool_calls + last.tool_calls)
        return ChatDelta(parsed.content, parsed.tool_calls, split.reasoning)
