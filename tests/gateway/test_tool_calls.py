"""Tool calling in the gateway: the hermes and llama3_json parsers (one-shot and streamed in every split),
the request's tools and tool_choice, and the grammar for required calls, checked against the parser and
the tiny model's chat template."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.params import ParamError, history_tool_calls
from gateway.tool_parsers import PARSERS, infer_parser, tool_call_stream
from gateway.tool_parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    finish_reason,
    merge,
    new_call_id,
)
from gateway.tool_parsers.hermes import HermesToolCalls
from gateway.tools import tool_request
from services.tokenizer.core import TokenizerCore, chat_message
from sluice.model.tokenizer import CHAT_TEMPLATE


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def fresh(parser: str) -> ToolCallStream:
    return tool_call_stream(parser, counting_ids())


def streamed(parser: str, pieces: list[str]) -> list[ParsedDelta]:
    stream = fresh(parser)
    return [stream.feed(p) for p in pieces] + [stream.finish()]


def calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(pairs)]


HERMES_CASES: list[tuple[str, str, list[ToolCall]]] = [
    ("Just text, no call.", "Just text, no call.", []),
    ("trailing space kept \n", "trailing space kept \n", []),
    ("a < b and <tool", "a < b and <tool", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        calls(("get_weather", '{"city": "Paris"}')),
    ),
    (
        'Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}]"}]}}\n</tool_call>\n'
        '<tool_call>{"name":"b","arguments":{}}</tool_call>\n',
        "Let me check.",
        calls(("a", '{"x": [1, {"y": "}]"}]}'), ("b", "{}")),
    ),
    (
        '<tool_call>{"arguments": {"q": "\\"quoted\\" \\u00e9"}, "name": "search"}</tool_call> Done.',
        "Done.",
        calls(("search", '{"q": "\\"quoted\\" \\u00e9"}')),
    ),
    ('<tool_call>{"name": "now"}</tool_call>', "", calls(("now", "{}"))),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", calls(("f", '{"a": 1}'))),
    (
        '<tool_call>{"name": "f", "parameters": {"n": -1.5e3, "ok": true}}</tool_call>',
        "",
        calls(("f", '{"n": -1.5e3, "ok": true}')),
    ),
    (
        'before <tool_call>{"nom": "f"}</tool_call> after',
        'before<tool_call>{"nom": "f"}</tool_call>after',
        [],
    ),
    ("<tool_call>not json</tool_call>x", "<tool_call>not json</tool_call>x", []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1', "", calls(("f", '{"a": 1'))),
    ('<tool_call>{"name": "f", "argu', "", calls(("f", "{}"))),
    ('<tool_call>{"na', '<tool_call>{"na', []),
    ('<tool_call>{"name": "f", "arguments": {}} trailing junk</tool_call>', "", calls(("f", "{}"))),
    ('<tool_call>{"name": "f", "arguments": 12}</tool_call>', "", calls(("f", "12"))),
]

LLAMA_CASES: list[tuple[str, str, list[ToolCall]]] = [
    ("Hello {there}", "Hello {there}", []),
    ("  ", "  ", []),
    ("<|python", "<|python", []),
    ('{"name": "a", "parameters": {"x": 1}}', "", calls(("a", '{"x": 1}'))),
    ('\n<|python_tag|>{"name": "a", "arguments": {}}', "", calls(("a", "{}"))),
    (
        '{"name": "a", "parameters": {"x": "; {"}}; {"name": "b", "parameters": {}} ;',
        "",
        calls(("a", '{"x": "; {"}'), ("b", "{}")),
    ),
    ('{"name": "a", "parameters": {}} and then text', "and then text", calls(("a", "{}"))),
    ('{"type": "function", "nome": 1} rest', '{"type": "function", "nome": 1} rest', []),
    ('{"name": "a", "parameters": {}}; {"oops": 2}', '{"oops": 2}', calls(("a", "{}"))),
    ('{"name": "a" oops', "", calls(("a", "{}"))),
    ('{"name": "a", "parameters": {"k": [1, 2', "", calls(("a", '{"k": [1, 2'))),
]

MISTRAL_CASES: list[tuple[str, str, list[ToolCall]]] = [
    ("Plain [text] here", "Plain [text] here", []),
    ("[1] first, [2] second", "[1] first, [2] second", []),
    ("[TOOL", "[TOOL", []),
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        calls(("get_weather", '{"city": "Paris"}')),
    ),
    (
        'Let me check. [TOOL_CALLS] [{"name": "a", "arguments": {"x": "]"}}, {"name":"b","arguments":{}}]',
        "Let me check.",
        calls(("a", '{"x": "]"}'), ("b", "{}")),
    ),
    # The marker is a special token: skipped from the text, the array starts the output.
    (' [ {"name": "a", "arguments": {"k": [1, 2]}}]', "", calls(("a", '{"k": [1, 2]}'))),
    ('[TOOL_CALLS][{"name": "a"}] and after', "and after", calls(("a", "{}"))),
    ('[TOOL_CALLS][{"nom": "a"}]', '{"nom": "a"}]', []),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"k": 1', "", calls(("a", '{"k": 1'))),
    # v11 and later: NAME[ARGS]{...}, one marker per call.
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", calls(("get_weather", '{"city": "Paris"}'))),
    (
        'Sure.[TOOL_CALLS]a[ARGS]{"x": "[TOOL_CALLS]"}[TOOL_CALLS]b[ARGS]{}',
        "Sure.",
        calls(("a", '{"x": "[TOOL_CALLS]"}'), ("b", "{}")),
    ),
    ("[TOOL_CALLS]now[ARGS]", "", calls(("now", "{}"))),
    ("[TOOL_CALLS]a b c", "[TOOL_CALLS]a b c", []),
    ('[TOOL_CALLS]f[ARGS]{"a": 1} then text', "then text", calls(("f", '{"a": 1}'))),
]

CASES = (
    [("hermes", *case) for case in HERMES_CASES]
    + [("llama3_json", *case) for case in LLAMA_CASES]
    + [("mistral", *case) for case in MISTRAL_CASES]
)


@pytest.mark.parametrize(("parser", "text", "content", "want"), CASES)
def test_parse(parser: str, text: str, content: str, want: list[ToolCall]) -> None:
    assert fresh(parser).parse(text) == (content, want)


@pytest.mark.parametrize(("parser", "text", "content", "want"), CASES)
def test_every_two_cut_split_streams_to_the_one_shot_result(
    parser: str, text: str, content: str, want: list[ToolCall]
) -> None:
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert merge(streamed(parser, [text[:i], text[i:j], text[j:]])) == (content, want), (i, j)
    assert merge(streamed(parser, list(text))) == (content, want)  # one character at a time


def test_stream_deltas_have_openai_shape() -> None:
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas = [d for d in streamed("hermes", list(text)) if d]
    tool_deltas = [t.to_openai() for d in deltas for t in d.tool_calls]
    assert tool_deltas[0] == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(
        set(t) == {"index", "function"} and set(t["function"]) == {"arguments"} for t in tool_deltas[1:]
    )
    assert "".join(t["function"]["arguments"] for t in tool_deltas) == '{"city": "Paris"}'
    assert len(tool_deltas) > 5  # the arguments came in fragments as they were generated
    assert "".join(d.content for d in deltas) == "Sure."


def test_held_back_text_is_released_only_when_it_cannot_open_a_call() -> None:
    stream = fresh("hermes")
    assert stream.feed("Hi <tool_") == ParsedDelta("Hi")
    assert stream.feed("cal") == ParsedDelta()
    assert stream.feed("x") == ParsedDelta(" <tool_calx")
    assert stream.feed('\n<tool_call>{"name": "f"') == ParsedDelta(
        tool_calls=[ToolCallDelta(0, "", "call_0", "f")]
    )
    assert not stream.finish().content
    assert stream.called


def test_a_call_is_emitted_only_once_its_name_is_known() -> None:
    stream = fresh("hermes")
    assert stream.feed('<tool_call>{"arguments": {"a": 1}, ') == ParsedDelta()
    assert not stream.called
    out = stream.feed('"name": "f"}</tool_call>')
    assert [t.to_openai() for t in out.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_finish_reason(reason: str) -> None:
    with_call, without = fresh("hermes"), fresh("hermes")
    with_call.parse('<tool_call>{"name": "f"}</tool_call>')
    without.parse("text")
    assert finish_reason(reason, with_call) == ("tool_calls" if reason == "stop" else reason)
    assert finish_reason(reason, without) == reason


def test_call_ids_are_openai_style_and_distinct() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)
    _, found = tool_call_stream("hermes").parse('<tool_call>{"name": "f"}</tool_call>' * 2)
    assert len({c.id for c in found}) == 2


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_call_stream("pythonic")


def test_infer_parser_from_template() -> None:
    assert infer_parser(CHAT_TEMPLATE) == "hermes"
    llama = "{{- '<|python_tag|>' + tool_call.name }}{{ '\"parameters\": ' }}"
    assert infer_parser(llama) == "llama3_json"
    assert infer_parser(CHAT_TEMPLATE + llama) is None
    assert infer_parser("{{ '[TOOL_CALLS][' + calls | tojson }}") == "mistral"
    assert infer_parser("{{ messages }}") is None
    assert infer_parser(None) is None


# ---- property: random outputs, random splits ------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
# Content that cannot open a call, and whitespace to put around calls.
CONTENT = st.text(alphabet=st.characters(blacklist_characters="<"), max_size=12)
BLANKS = st.sampled_from(["", "\n", " ", "\n\n", " \t\n"])


@st.composite
def hermes_outputs(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, Any]]]:
    """(text, its content, its calls as (name, arguments value))."""
    pieces = [draw(CONTENT)]
    found: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(0, 3))):
        name, arguments = draw(NAMES), draw(ARGUMENTS)
        separators = None if draw(st.booleans()) else (",", ":")
        body = json.dumps(
            {"name": name, "arguments": arguments}, separators=separators, ensure_ascii=draw(st.booleans())
        )
        pieces.append(
            f"{draw(BLANKS)}<tool_call>{draw(BLANKS)}{body}{draw(BLANKS)}</tool_call>{draw(BLANKS)}"
        )
        found.append((name, arguments))
        pieces.append(draw(CONTENT))
    text = "".join(pieces)
    if not found:
        return text, text, found
    # Content: the pieces between blocks, stripped where they touch a block.
    blocks = text.split("<tool_call>")
    content = blocks[0].rstrip()
    for k, block in enumerate(blocks[1:], start=1):
        after = block.split("</tool_call>", 1)[1].lstrip()
        content += after if k == len(blocks) - 1 else after.rstrip()
    return text, content, found


@st.composite
def splits(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), output=hermes_outputs())
def test_hermes_random_outputs_in_random_splits(
    data: st.DataObject, output: tuple[str, str, list[tuple[str, Any]]]
) -> None:
    text, content, want = output
    one_shot = fresh("hermes").parse(text)
    assert one_shot[0] == content
    assert [(c.name, json.loads(c.arguments)) for c in one_shot[1]] == want
    assert merge(streamed("hermes", data.draw(splits(text)))) == one_shot


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    found=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    tail=CONTENT,
    key=st.sampled_from(["parameters", "arguments"]),
)
def test_llama3_json_random_outputs_in_random_splits(
    data: st.DataObject, found: list[tuple[str, Any]], tail: str, key: str
) -> None:
    text = "; ".join(json.dumps({"name": n, key: a}) for n, a in found)
    text += f" {tail}" if tail.strip() and tail.strip()[0] not in "{;" else ""
    one_shot = fresh("llama3_json").parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in one_shot[1]] == found
    assert merge(streamed("llama3_json", data.draw(splits(text)))) == one_shot


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    found=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    head=CONTENT,
    form=st.sampled_from(["array", "bare", "args"]),
)
def test_mistral_random_outputs_in_random_splits(
    data: st.DataObject, found: list[tuple[str, Any]], head: str, form: str
) -> None:
    if form == "args":
        text = head + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in found)
    else:
        array = json.dumps([{"name": n, "arguments": a} for n, a in found])
        text = array if form == "bare" else f"{head}[TOOL_CALLS]{array}"
    one_shot = fresh("mistral").parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in one_shot[1]] == found
    if form != "bare":
        assert one_shot[0] == head.rstrip()
    assert merge(streamed("mistral", data.draw(splits(text)))) == one_shot


# ---- request validation --------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def test_tool_request_defaults() -> None:
    assert tool_request({}) is None
    assert tool_request({"tool_choice": "none"}) is None
    request = tool_request({"tools": [WEATHER, NOW]})
    assert request is not None
    assert (request.choice, request.function, request.parallel, request.parses_calls) == (
        "auto",
        "",
        True,
        True,
    )
    assert json.loads(request.tools_json()) == [WEATHER, NOW]
    assert request.grammar(HermesToolCalls) is None
    off = tool_request({"tools": [NOW], "tool_choice": "none", "parallel_tool_calls": False})
    assert off is not None and not off.parses_calls and not off.parallel
    assert off.grammar(HermesToolCalls) is None
    assert off.grammar(HermesToolCalls) is None
    named = tool_request(
        {"tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}}
    )
    assert named is not None and (named.choice, named.function) == ("function", "now")


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tools": []}, "tools", "non-empty array"),
        ({"tools": {"type": "function"}}, "tools", "non-empty array"),
        ({"tools": [NOW] * 129}, "tools", "at most 128"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", '"type": "function"'),
        ({"tools": [NOW, {"type": "function", "function": "f"}]}, "tools[1].function", "must be an object"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "1 to 64 letters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools[0].function.name",
            "1 to 64",
        ),
        ({"tools": [NOW, NOW]}, "tools[1].function.name", "'now' is used twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
            "tools[0].function.description",
            "must be a string",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "true or false",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "JSON Schema object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters.type",
            'must be "object"',
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters.properties.a.type",
            "must be one of array, boolean",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"properties": {"a": {"items": {"anyOf": []}}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters.properties.a.items.anyOf",
            "non-empty array of schemas",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}]},
            "tools[0].function.parameters.required",
            "array of property names",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 1}}}]},
            "tools[0].function.parameters.properties",
            "object of schemas",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"a": {"enum": []}}}},
                    }
                ]
            },
            "tools[0].function.parameters.properties.a.enum",
            "non-empty",
        ),
        ({"tools": [NOW], "tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "now"}}},
            "tool_choice.function.name",
            "not among the tools",
        ),
        (
            {"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}},
            "tool_choice.function.name",
            "'later', which is not among the tools",
        ),
        ({"tools": [NOW], "tool_choice": {"type": "function"}}, "tool_choice", '{"type": "function"'),
        ({"tools": [NOW], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ],
)
def test_bad_tool_settings_name_the_field(body: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(ParamError) as info:
        tool_request(body)
    assert info.value.param == param
    assert needle in info.value.message


def test_deep_schemas_are_refused() -> None:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ParamError, match="nests more than 32 levels"):
        tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})


def test_history_tool_calls() -> None:
    raw = [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    assert json.loads(history_tool_calls(raw, "messages[1]")) == raw
    cut = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "unfini'}}]
    assert json.loads(history_tool_calls(cut, "messages[1]")) == cut  # cut by max_tokens: taken as it is
    for bad, param in [
        ([], "messages[1].tool_calls"),
        ([{"function": {"name": "f", "arguments": "{}"}}], "messages[1].tool_calls[0]"),
        (
            [{"id": "c", "function": {"name": 1, "arguments": "{}"}}],
            "messages[1].tool_calls[0].function.name",
        ),
        (
            [{"id": "c", "function": {"name": "f", "arguments": {}}}],
            "messages[1].tool_calls[0].function.arguments",
        ),
    ]:
        with pytest.raises(ParamError) as info:
            history_tool_calls(bad, "messages[1]")
        assert info.value.param == param


# ---- the grammar, the template and the parser agree ---------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_model_dir: Path) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))


def matcher(
    tokenizer: llguidance.LLTokenizer, body: dict[str, Any], parser: str = "hermes"
) -> llguidance.LLMatcher:
    request = tool_request(body)
    assert request is not None
    kind, text = request.grammar(PARSERS[parser]) or ("", "")
    assert kind == "grammar"
    grammar = llguidance.grammar_from("grammar", text)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # no error
    return llguidance.LLMatcher(tokenizer, grammar)


def accepts(tokenizer: llguidance.LLTokenizer, body: dict[str, Any], text: str) -> bool:
    m = matcher(tokenizer, body)
    return m.consume_tokens(tokenizer.tokenize_str(text)) and m.is_accepting()


def rendered_calls(tiny_model_dir: Path, *pairs: tuple[str, dict[str, Any]]) -> str:
    """What the chat template writes for an assistant turn of these calls (between its opening and end)."""
    raw = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(pairs)
    ]
    message = chat_message("assistant", None, tool_calls_json=json.dumps(raw))
    text = TokenizerCore(tiny_model_dir).render_chat([message], add_generation_prompt=False)
    return text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")


def test_grammar_accepts_what_the_template_writes(
    ll_tokenizer: llguidance.LLTokenizer, tiny_model_dir: Path
) -> None:
    required = {"tools": [WEATHER, NOW], "tool_choice": "required"}
    one = rendered_calls(tiny_model_dir, ("get_weather", {"city": "Paris", "unit": "C"}))
    two = rendered_calls(tiny_model_dir, ("get_weather", {"city": "Rome"}), ("now", {}))
    assert accepts(ll_tokenizer, required, one)
    assert accepts(ll_tokenizer, required, two)
    assert not accepts(ll_tokenizer, {**required, "parallel_tool_calls": False}, two)
    assert accepts(ll_tokenizer, {**required, "parallel_tool_calls": False}, one)
    named_now = {"tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}}
    assert not accepts(ll_tokenizer, named_now, one)
    assert accepts(ll_tokenizer, named_now, rendered_calls(tiny_model_dir, ("now", {})))
    assert not accepts(
        ll_tokenizer, required, rendered_calls(tiny_model_dir, ("get_weather", {"town": "Rome"}))
    )
    assert not accepts(ll_tokenizer, required, "I will not call anything.")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_random_walks_under_the_grammar_parse_into_valid_calls(
    ll_tokenizer: llguidance.LLTokenizer, parallel: bool, parser: str
) -> None:
    """A required call's grammar, in each parser's format, writes only what that parser reads as calls."""
    # Bounded schemas, so that a walk ends: a closed empty object, a short string, an enum.
    now = {
        "type": "function",
        "function": {
            "name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    body = {"tools": [WEATHER, now], "tool_choice": "required", "parallel_tool_calls": parallel}
    rng = random.Random(0)
    counts = []
    for _ in range(30):
        m = matcher(ll_tokenizer, body, parser)
        tokens: list[int] = []
        while not (m.is_accepting() and (m.is_stopped() or rng.random() < 0.5)):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: ll_tokenizer.vocab_size]).tolist()
            allowed = [t for t in allowed if t != ll_tokenizer.eos_token] or allowed
            token = rng.choice(allowed)
            assert m.consume_token(token)
            tokens.append(token)
            assert len(tokens) < 2000
        text = ll_tokenizer.decode_str(tokens)
        content, found = fresh(parser).parse(text)
        assert content == "" and found, text
        for call in found:
            arguments = json.loads(call.arguments)
            assert call.name in ("get_weather", "now")
            if call.name == "get_weather":
                assert set(arguments) <= {"city", "unit"} and isinstance(arguments["city"], str), text
                assert len(arguments["city"]) <= 8 and arguments.get("unit", "C") in ("C", "F")
        counts.append(len(found))
    assert max(counts) == 1 if not parallel else max(counts) > 1


@pytest.mark.parametrize("strict", [False, True])
def test_strict_tools_refuse_keywords_the_grammar_cannot_enforce(strict: bool) -> None:
    parameters = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    body = {
        "tools": [
            {"type": "function", "function": {"name": "f", "strict": strict, "parameters": parameters}}
        ],
        "tool_choice": "required",
    }
    request = tool_request(body)
    grammar = request.grammar(HermesToolCalls) if request is not None else None
    assert grammar is not None
    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar[1]))
    assert ("uniqueItems" in error) if strict else error == ""
