"""The `<think>` splitter: reasoning and content, one-shot and streamed in every split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reasoning import ReasoningDelta, ReasoningStream, opens_reasoning
from gateway.tool_parsers import tool_call_stream
from gateway.tool_parsers.base import ToolCall, merge

CASES: list[tuple[str, bool, str, str]] = [
    ("plain answer", False, "", "plain answer"),
    ("  spaced answer \n", False, "", "  spaced answer \n"),
    ("<think>\nplan it\n</think>\n\nThe answer.", False, "plan it", "The answer."),
    ("Intro <think>why</think> outro", False, "why", "Introoutro"),
    ("<think>a</think>b<think>c</think>d", False, "ac", "bd"),
    ("<think>still thinking when cut off ", False, "still thinking when cut off ", ""),
    ("<think></think>answer", False, "", "answer"),
    ("a < b, <thin and </think> x", False, "", "a < b, <thin and </think> x"),
    ("<think>1 < 2 and </thinking> too</think>ok", False, "1 < 2 and </thinking> too", "ok"),
    ("\nopened by the template\n</think>\n\nanswer", True, "opened by the template", "answer"),
    ("no closing tag at all", True, "no closing tag at all", ""),
    ("</think>", True, "", ""),
    ("<think>", False, "", ""),
    ("é😀<think>世界</think>ü", False, "世界", "é😀ü"),
]


def streamed(pieces: list[str], in_reasoning: bool) -> tuple[str, str]:
    stream = ReasoningStream(in_reasoning=in_reasoning)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_parse(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    assert ReasoningStream(in_reasoning=in_reasoning).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_every_split_streams_to_the_one_shot_result(
    text: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert streamed([text[:i], text[i:j], text[j:]], in_reasoning) == (reasoning, content), (i, j)
    assert streamed(list(text), in_reasoning) == (reasoning, content)


def test_a_split_tag_is_held_back_until_it_is_whole() -> None:
    stream = ReasoningStream()
    assert stream.feed("Hello <thi") == ReasoningDelta(content="Hello")
    assert stream.feed("nk>\nstep one") == ReasoningDelta(reasoning="step one")
    assert stream.feed(" </th") == ReasoningDelta()
    assert stream.feed("ink>\n\nDone") == ReasoningDelta(content="Done")
    assert stream.feed("!") == ReasoningDelta(content="!")
    assert not stream.finish()


def test_opens_reasoning() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert not opens_reasoning("<think>old</think><|im_start|>assistant\n")
    assert opens_reasoning("<think>old</think> then <think>")


def test_content_feeds_the_tool_call_parser() -> None:
    """Reasoning first, then tool calls on what is left: a call inside the thinking is not a call."""
    text = (
        '<think>maybe <tool_call>{"name": "no"}</tool_call></think>\n'
        'Checking.\n<tool_call>{"name": "yes", "arguments": {"a": 1}}</tool_call>'
    )
    for size in (1, 3, 7, len(text)):
        reasoning, tools = ReasoningStream(), tool_call_stream("hermes", lambda: "call_x")
        thoughts, parsed = [], []
        for k in range(0, len(text), size):
            delta = reasoning.feed(text[k : k + size])
            thoughts.append(delta.reasoning)
            parsed.append(tools.feed(delta.content))
        last = reasoning.finish()
        thoughts.append(last.reasoning)
        parsed += [tools.feed(last.content), tools.finish()]
        assert "".join(thoughts) == 'maybe <tool_call>{"name": "no"}</tool_call>'
        assert merge(parsed) == ("Checking.", [ToolCall("call_x", "yes", '{"a": 1}')])


# Random texts: pieces of words, blanks and both tags (whole or as near misses).
PARTS = st.sampled_from(
    ["<think>", "</think>", "<thin", "</", "<", ">", " ", "\n", "\t", "word", "é😀", "x<y"]
)


def oracle(text: str, inside: bool) -> tuple[str, str]:
    """The rule, applied to a whole text: pieces between toggling tags, stripped where they touch one."""
    out: dict[bool, list[str]] = {True: [], False: []}
    after_tag = inside
    while True:
        tag = "</think>" if inside else "<think>"
        at = text.find(tag)
        piece = text if at < 0 else text[:at].rstrip()
        out[inside].append(piece.lstrip() if after_tag else piece)
        if at < 0:
            return "".join(out[True]), "".join(out[False])
        text, inside, after_tag = text[at + len(tag) :], not inside, True


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(PARTS, max_size=16), in_reasoning=st.booleans(), data=st.data())
def test_random_texts_in_random_splits(parts: list[str], in_reasoning: bool, data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    want = oracle(text, in_reasoning)
    assert ReasoningStream(in_reasoning=in_reasoning).parse(text) == want
    assert streamed(pieces, in_reasoning) == want
