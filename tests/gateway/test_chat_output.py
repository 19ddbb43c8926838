"""The chat output chain (reasoning, then content, then tool calls) is split invariant: however the
text arrives, the merged deltas equal the one-shot parse."""

from __future__ import annotations

import itertools

import pytest

from gateway.chat_output import ChatOutput
from gateway.tool_parsers.base import ParsedDelta, merge

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": [1, "</think>"]}}\n</tool_call>'
TEXTS = [
    "<think>\nplan it\n</think>\n\nSure.\n" + CALL,
    "no reasoning " + CALL + " after",
    "<think>unfinished",
    "plain",
]


def streamed(output: ChatOutput, pieces: list[str]) -> tuple[str, str, list[object]]:
    deltas = [output.feed(piece) for piece in pieces] + [output.finish()]
    content, calls = merge(ParsedDelta(d.content, d.tool_calls) for d in deltas)
    return "".join(d.reasoning for d in deltas), content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("reasoning", "tools"), [(True, "hermes"), (True, None), (False, "hermes")])
def test_every_two_cut_split_gives_the_one_shot_result(text: str, reasoning: bool, tools: str | None) -> None:
    reasoning_text, content, calls = ChatOutput(reasoning=reasoning, tool_parser=tools).parse(text)
    want = (reasoning_text, content, [(c.name, c.arguments) for c in calls])
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        output = ChatOutput(reasoning=reasoning, tool_parser=tools)
        assert streamed(output, [text[:i], text[i:j], text[j:]]) == want


def test_reasoning_then_content_then_calls() -> None:
    output = ChatOutput(reasoning=True, tool_parser="hermes")
    reasoning, content, calls = output.parse(TEXTS[0])
    assert (reasoning, content) == ("plan it", "Sure.")
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": [1, "</think>"]}')]
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


def test_without_parsers_the_text_is_content() -> None:
    output = ChatOutput(reasoning=False, tool_parser=None)
    assert output.parse(TEXTS[0]) == ("", TEXTS[0], [])
    assert output.finish_reason("stop") == "stop"
