"""What a chat completion's generated text becomes for the client: reasoning (`--reasoning-parser`),
then content, then tool calls (`--tool-call-parser`, when the request's tools are read for calls).

`ChatOutput` chains the two incremental parsers: the text goes to the reasoning splitter when one is on,
and the content it gives to the tool-call parser when there is one. Both are split invariant
(`gateway.reasoning`, `gateway.tool_parsers.base`), so the chain is: however the text arrives, the
merged deltas are the same. `chosen` gives the served model's `ChatParsers` from its chat template and
generation prompt (the tokenizer's `Info`): under `auto`, the tool-call format the template writes
(`tool_parsers.infer_parser`; hermes when none or several do), and `<think>` splitting when the template
writes `<think>`, a reply starting inside a block when the generation prompt opens one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningDelta, ReasoningStream, opens_reasoning
from gateway.tool_parsers import DEFAULT_PARSER, PARSERS, infer_parser, tool_call_stream
from gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolCallStream, finish_reason, merge


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


@dataclass(frozen=True)
class ChatParsers:
    """How the served model's chat replies are read: `tool_parser` (a name of `tool_parsers.PARSERS`),
    `reasoning` (split `<think>` text out) and `in_reasoning` (a reply starts inside a think block: the
    generation prompt opened it). `special_ids` maps the text of the tokenizer's special tokens to
    their ids, to keep the parsers' marks in the text (`keep_special_ids`)."""

    tool_parser: str = DEFAULT_PARSER
    reasoning: bool = False
    in_reasoning: bool = False
    special_ids: Mapping[str, int] = field(default_factory=dict, compare=False)

    @property
    def tool_format(self) -> type[ToolCallStream]:
        """The format's class, whose grammar a required call follows."""
        return PARSERS[self.tool_parser]

    def keep_special_ids(self, *, reads_calls: bool) -> tuple[int, ...]:
        """The special tokens a reply's text must keep for its parsers (the detokenizer skips the
        others): the tool-call format's marks when the request reads calls, the think tags when
        reasoning is split."""
        marks = (
            *(self.tool_format.MARKS if reads_calls else ()),
            *((THINK_OPEN, THINK_CLOSE) if self.reasoning else ()),
        )
        return tuple(sorted({self.special_ids[m] for m in marks if m in self.special_ids}))


def chosen(
    tool_setting: str,
    reasoning_setting: str,
    chat_template: str,
    generation_prompt: str,
    special_ids: Mapping[str, int] | None = None,
) -> ChatParsers:
    """The parsers for a model whose chat template, generation prompt and special tokens (text → id)
    are these, under the settings `--tool-call-parser` (auto or a name) and `--reasoning-parser` (auto,
    think or none)."""
    tool_parser = tool_setting
    if tool_setting == "auto":
        tool_parser = infer_parser(chat_template) or DEFAULT_PARSER
    thinks = reasoning_setting == "think" or (reasoning_setting == "auto" and THINK_OPEN in chat_template)
    in_reasoning = thinks and opens_reasoning(generation_prompt)
    return ChatParsers(tool_parser, thinks, in_reasoning, dict(special_ids or {}))
