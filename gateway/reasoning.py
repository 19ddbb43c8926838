"""Reasoning text (`--reasoning-parser`): models that think inside `<think>…</think>` before they answer.
The text inside the tags goes to OpenAI's `reasoning_content`, the rest to `content`; the tags to neither.

`ReasoningStream.feed` takes text deltas and returns `ReasoningDelta`s; `finish()` flushes what was held
back; `parse(text)` does both at once. Contract: however a text is split into deltas, the concatenated
deltas equal `parse(text)` (a tag split across deltas is held back until whole or impossible). A block
still open at the end is reasoning to the end. Whitespace touching a tag belongs to neither side
(`<think>\\nplan\\n</think>\\n\\nanswer` is reasoning "plan", content "answer"); at the very start or end
of the text it is kept. `in_reasoning=True` starts inside a block, for templates whose generation prompt
opens it; `opens_reasoning(prompt)` tells whether a rendered prompt does.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_parsers.base import emittable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a `<think>` block (its generation prompt opened it)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningStream:
    """Splits one generated text into reasoning and content, incrementally. One instance per request."""

    def __init__(self, *, in_reasoning: bool = False) -> None:
        self._inside = in_reasoning
        self._after_tag = in_reasoning  # the current piece follows a tag: its leading whitespace goes
        self._buf = ""  # received, not yet emitted
        self._out = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        """Takes the next text delta; returns what can be emitted now."""
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The end of the text: emits what was held back. Call once, after the last `feed`."""
        self._advance(final=True)
        return self._take()

    def parse(self, text: str) -> tuple[str, str]:
        """One-shot: (reasoning, content) of a whole text (on a fresh instance)."""
        first, last = self.feed(text), self.finish()
        return first.reasoning + last.reasoning, first.content + last.content

    def _advance(self, *, final: bool) -> None:
        while True:
            tag = THINK_CLOSE if self._inside else THINK_OPEN
            at = self._buf.find(tag)
            if at < 0:
                break
            self._piece(self._buf[:at].rstrip())
            self._buf = self._buf[at + len(tag) :]
            self._inside, self._after_tag = not self._inside, True
        emit = emittable(self._buf, tag, final=final)
        self._piece(self._buf[:emit])
        self._buf = self._buf[emit:]

    def _piece(self, text: str) -> None:
        if self._after_tag:
            text = text.lstrip()
            self._after_tag = not text
        if self._inside:
            self._out.reasoning += text
        else:
            self._out.content += text

    def _take(self) -> ReasoningDelta:
        out, self._out = self._out, ReasoningDelta()
        return out
