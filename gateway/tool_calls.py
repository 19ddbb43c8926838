"""OpenAI tool calling in the gateway: the request's `tools`, `tool_choice` and `parallel_tool_calls`
validated, the grammar that makes the engine write a call when one is required, and the parsers that
turn generated text back into tool calls, whole or streamed.

Parsers (`--tool-call-parser`; the registry and the choice from a chat template are in
`gateway/tool_parsers/`, with `mistral`):

- `hermes`: a call is a block `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the
  text, one or more. The text outside the blocks is content, less the whitespace touching a block.
- `llama3_json`: an output that starts (after whitespace and an optional `<|python_tag|>`) with `{` is
  a list of JSON objects `{"name": ..., "parameters"|"arguments": {...}}` separated by `;`; the text
  after the last one, if any, is content. Any other output is content.

Each parser is a `ToolCallStream`: `feed(text)` takes the next text delta and returns a `ParsedDelta`
(content, and tool-call deltas in OpenAI's streaming shape: a call's first delta has its index, id,
name and empty arguments, the next ones argument fragments), `finish()` flushes what was held back,
and `parse(text)` does both at once and merges the deltas into (content, calls). Contract:

- Split invariance: however a text is split into deltas, the merged deltas equal `parse(text)`.
- Nothing is emitted that later turns out to belong to a call: text that may open one (a prefix of
  `<tool_call>`, the whitespace before it) is held back, and a call's text until its name is known.
- A call's `arguments` is the JSON text of its arguments value exactly as the model wrote it (a JSON
  string value is decoded: some models quote the object), "{}" when it has none. Only nesting is
  checked while streaming, so a malformed value is passed on as written.
- A block or object without a string "name" is not a call: its text is content.
- The end of a hermes block is the first `</tool_call>`, even inside a JSON string.

The grammar (`ToolRequest.grammar`, for `tool_choice` "required" or a named function) is a Lark
grammar in llguidance's dialect, the engine's grammar library (kind "grammar"): JSON Schema alone
cannot express a call's wrapper. It is written in the format of the parser in use (each parser class
says how: `CALLS_OPEN`, `CALL_OPEN`, `CALL_CLOSE`, `CALLS_SEPARATOR`, `CALLS_CLOSE`). Each allowed tool
is one rule, a fixed opening that holds its name (hermes: `<tool_call>\\n{"name": "NAME", "arguments": `),
then `%json` of its parameters schema, then the closing (hermes: `}\\n</tool_call>`); calls are
separated (hermes: "\\n"). For hermes that is byte for byte what the tiny model's chat template writes
for a call in the history, and what the parser reads.
"""

from __future__ import annotations

import abc
import json
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.params import ParamError
from services.common.constraints import (
    MAX_CONSTRAINT_CHARS,
    MAX_ROW_ITEMS,
    MAX_SCHEMA_DEPTH,
    SUBSCHEMA,
    SUBSCHEMA_LISTS,
    SUBSCHEMA_MAPS,
    closed_schema,
    schema_row_items,
)

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"[\s;]*")  # between llama3_json calls
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
TOOL_CHOICES = ("none", "auto", "required")
# JSON whitespace allowed between tokens of constrained arguments, as the engine allows in response
# formats (services/engine/core/grammar.py), so that a model cannot loop on blanks.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


# ---- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of a streamed delta's `tool_calls`: the first of a call carries id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ParsedDelta:
    """What one `feed` or `finish` gives: content text and tool-call deltas, in that order."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def merge(deltas: Iterable[ParsedDelta]) -> tuple[str, list[ToolCall]]:
    """Content and whole calls from a stream's deltas (in order)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name is not None
                calls.append(ToolCall(d.id, d.name, d.arguments))
            else:
                calls[d.index] = replace(calls[d.index], arguments=calls[d.index].arguments + d.arguments)
    return "".join(content), calls


# ---- reading one call's JSON object --------------------------------------------------------------

_SCALAR_CHARS = frozenset("-+0123456789.eEtrufalsn")
_ARGUMENT_KEYS = ("arguments", "parameters")


class _JsonValue:
    """Finds where one JSON value ends, read a character at a time (only nesting is checked)."""

    def __init__(self) -> None:
        self.kind = ""  # "container", "string" or "scalar" once the first character is read
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def take(self, c: str) -> bool:
        """Whether `c` belongs to the value (then `done` tells whether it was the last). False when
        `c` ends a scalar (`done` is set, `c` is not the value's) or no value starts with `c`."""
        if not self.kind:
            return self._start(c)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                self.done = self.kind == "string"
            return True
        if self.kind == "scalar":
            if c in _SCALAR_CHARS:
                return True
            self.done = True
            return False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True

    def _start(self, c: str) -> bool:
        if c in "{[":
            self.kind, self.depth = "container", 1
        elif c == '"':
            self.kind, self.in_string = "string", True
        elif c in _SCALAR_CHARS:
            self.kind = "scalar"
        else:
            return False
        return True


class _CallObject:
    """Reads one JSON object a character at a time and picks out its "name" (a string) and its first
    "arguments" or "parameters" value. The object ends at its closing brace (`state` "done") or at
    the first character that breaks the JSON syntax ("broken"); later characters are not read."""

    def __init__(self) -> None:
        self.state = "open"
        self.name: str | None = None
        self.has_arguments = False
        self._key: list[str] = []
        self._key_escaped = False
        self._field = ""  # what the value being read is: "name", "arguments", "quoted" (arguments) or ""
        self._value = _JsonValue()
        self._raw: list[str] = []  # the name's or quoted arguments' JSON text
        self._arguments: list[str] = []  # arguments text not yet taken

    @property
    def ended(self) -> bool:
        return self.state in ("done", "broken")

    def feed(self, text: str) -> int:
        """Reads `text`; returns how many characters belong to the object (all unless it ends)."""
        for i, c in enumerate(text):
            if self.ended:
                return i
            self._step(c)
        return len(text)

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def _step(self, c: str) -> None:
        state = self.state
        if state in ("open", "key_or_end", "colon", "value_start", "after_value") and c.isspace():
            return
        if state == "open":
            self.state = "key_or_end" if c == "{" else "broken"
        elif state == "key_or_end":
            self.state = {'"': "key", "}": "done"}.get(c, "broken")
        elif state == "key":
            self._key_char(c)
        elif state == "colon":
            self.state = "value_start" if c == ":" else "broken"
        elif state == "value_start":
            self._value = _JsonValue()
            self._start_field()
            self.state = "value"
            self._value_char(c)
        elif state == "value":
            self._value_char(c)
        elif state == "after_value":
            self.state = {",": "key_or_end", "}": "done"}.get(c, "broken")

    def _key_char(self, c: str) -> None:
        if self._key_escaped:
            self._key_escaped = False
        elif c == "\\":
            self._key_escaped = True
        elif c == '"':
            self.state = "colon"
            return
        self._key.append(c)

    def _start_field(self) -> None:
        try:
            key = json.loads('"' + "".join(self._key) + '"')
        except ValueError:
            key = ""
        self._key.clear()
        self._raw.clear()
        self._field = ""
        if key == "name" and self.name is None:
            self._field = "name"
        elif key in _ARGUMENT_KEYS and not self.has_arguments:
            self._field = "arguments"
            self.has_arguments = True

    def _value_char(self, c: str) -> None:
        if not self._value.take(c):
            if not self._value.done:  # no JSON value starts with c
                self.state = "broken"
                return
            self._end_value()
            self._step(c)  # the character after a number or literal
            return
        if self._field == "arguments" and self._value.kind == "string":
            self._field = "quoted"
        if self._field == "arguments":
            self._arguments.append(c)
        elif self._field:
            self._raw.append(c)
        if self._value.done:
            self._end_value()

    def _end_value(self) -> None:
        self.state = "after_value"
        raw = "".join(self._raw)
        if self._field == "name" and self._value.kind == "string":
            self.name = _json_string(raw)
        elif self._field == "quoted":
            decoded = _json_string(raw)
            self._arguments.append(raw if decoded is None else decoded)
        self._field = ""


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def emittable(text: str, tag: str, *, final: bool) -> int:
    """How much of `text`, which holds no whole `tag`, may go out as it is now: all of it at the end
    (`final`); else all but a possible start of `tag` and the whitespace before it (whitespace that
    touches a tag goes out on neither side)."""
    return len(text) if final else len(text[: len(text) - tag_prefix_len(text, tag)].rstrip())


class _Call:
    """A call being read: its object, its text so far (content if it turns out to have no name) and
    its index once its name is known."""

    def __init__(self, opening: str) -> None:
        self.obj = _CallObject()
        self.raw = [opening]
        self.index: int | None = None


# ---- the parsers -------------------------------------------------------------------------------


class ToolCallStream(abc.ABC):
    """An incremental tool-call parser for one generated text (see the module docstring). Not
    thread-safe; one instance per request. The class attributes say how its format writes calls, for
    the grammar of a required call: CALLS_OPEN, then each call as CALL_OPEN (with `{name}`), the
    arguments and CALL_CLOSE, separated by CALLS_SEPARATOR, then CALLS_CLOSE."""

    CALLS_OPEN, CALLS_SEPARATOR, CALLS_CLOSE = "", "\n", ""
    CALL_OPEN, CALL_CLOSE = OPEN_TAG + '\n{{"name": "{name}", "arguments": ', "}\n" + CLOSE_TAG
    # Marks the parser reads, kept in the text where the tokenizer has them as special tokens.
    MARKS: tuple[str, ...] = (OPEN_TAG, CLOSE_TAG)

    @classmethod
    def recognises(cls, chat_template: str) -> bool:
        """Whether a chat template writes calls in this format."""
        return False

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._count = 0
        self._out = ParsedDelta()
        self._buf = ""  # received, not yet emitted or read into a call
        self._call: _Call | None = None

    @property
    def called(self) -> bool:
        """Whether a tool call has begun (the finish reason is then `tool_calls`)."""
        return self._count > 0

    def feed(self, text: str) -> ParsedDelta:
        """Takes the next text delta; returns what can be emitted now."""
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """The end of the text: emits what was held back. Call once, after the last `feed`."""
        self._advance(final=True)
        if self._call is not None:  # the text ended inside a call
            self._close(self._call)
            self._call = None
        return self._take()

    @abc.abstractmethod
    def _advance(self, *, final: bool) -> None:
        """Reads the buffer as far as it can be read now; all of it when `final` (the text ended)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """One-shot: the content and calls of a whole text (on a fresh instance)."""
        return merge([self.feed(text), self.finish()])

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text

    def _progress(self, call: _Call) -> None:
        """Emits a call's opening once its name is known, then its arguments as they come."""
        if call.index is None and call.obj.name is not None:
            call.index = self._count
            self._count += 1
            self._out.tool_calls.append(ToolCallDelta(call.index, "", self._new_id(), call.obj.name))
        if call.index is not None:
            self._arguments(call.index, call.obj.take_arguments())

    def _arguments(self, index: int, text: str) -> None:
        if not text:
            return
        deltas = self._out.tool_calls
        if deltas and deltas[-1].index == index and deltas[-1].id is None:
            deltas[-1] = replace(deltas[-1], arguments=deltas[-1].arguments + text)
        else:
            deltas.append(ToolCallDelta(index, text))

    def _close(self, call: _Call) -> bool:
        """Ends a call: True when it was one, else its text becomes content."""
        self._progress(call)
        if call.index is None:
            self._content("".join(call.raw))
            return False
        if not call.obj.has_arguments:
            self._arguments(call.index, "{}")
        return True


class HermesToolCalls(ToolCallStream):
    """`<tool_call>{json}</tool_call>` blocks; the text around them is content, except whitespace
    that touches a block (a piece before a block loses its trailing whitespace, one after it its
    leading whitespace)."""

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
                self._call = _Call(OPEN_TAG)
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


class Llama3JsonToolCalls(ToolCallStream):
    """JSON objects `{"name": ..., "parameters": ...}` separated by `;` when the output starts with
    one (after whitespace and an optional `<|python_tag|>`); otherwise all content. After the last
    object, the text from the first character that is neither whitespace nor `;` is content. An object
    without a name makes it and the rest content; a broken one after its name ends the calls (the rest
    is dropped)."""

    CALLS_SEPARATOR = "; "
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
            self._call, self._buf, self._mode = _Call(opening), text, "call"
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
            self._call, self._mode = _Call(""), "call"
        elif text:
            self._mode = "content"
        self._buf = text


def finish_reason(reason: str, stream: ToolCallStream) -> str:
    """OpenAI's finish reason: `tool_calls` for an output that ended by itself (`stop`) with calls."""
    return "tool_calls" if reason == "stop" and stream.called else reason


# ---- the request: tools, tool_choice, parallel_tool_calls ----------------------------------------


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments object; None = any object
    strict: bool = False  # the schema's keywords the engine cannot enforce are refused, not ignored

    def to_openai(self) -> dict[str, Any]:
        """The tool as the chat template gets it: an OpenAI tool object."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tool settings. `choice` is "none", "auto", "required" or "function" (then
    `function` names the one tool to call); `parallel` allows more than one call."""

    tools: tuple[Tool, ...]
    choice: str
    function: str = ""
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls (not with `tool_choice: none`)."""
        return self.choice != "none"

    def tools_json(self) -> str:
        """The tools for the tokenizer (`TokenizeRequest.tools_json`)."""
        return json.dumps([t.to_openai() for t in self.tools], ensure_ascii=False)

    def grammar(self, parser: type[ToolCallStream] | None = None) -> tuple[str, str] | None:
        """The constraint for the engine as (kind, text), or None for `auto` and `none`: for
        `required` (any of the tools) or a named function (that one), ("grammar", a Lark grammar in
        llguidance's dialect) accepting one or more calls (exactly one when `parallel` is false) in the
        format of `parser` (default hermes). See the module docstring for the form of a call."""
        if self.choice not in ("required", "function"):
            return None
        fmt = parser or HermesToolCalls
        tools = [t for t in self.tools if self.choice == "required" or t.name == self.function]
        for i, tool in enumerate(self.tools):
            if tool in tools:
                check_schema_rows(tool.parameters or {}, f"tools[{i}].function.parameters")
        calls = "call" + (f" ({json.dumps(fmt.CALLS_SEPARATOR)} call)*" if self.parallel else "")
        start = [json.dumps(fmt.CALLS_OPEN), calls, json.dumps(fmt.CALLS_CLOSE)]
        rules = [
            "start: " + " ".join(part for part in start if part != '""'),
            "call: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            opening, closing = fmt.CALL_OPEN.format(name=tool.name), fmt.CALL_CLOSE
            rules.append(
                f"tool_{i}: {json.dumps(opening)} %json {_arguments_schema(tool)} {json.dumps(closing)}"
            )
        text = "\n".join(rules) + "\n"
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ParamError(
                "tools", f"the grammar of a required tool call (tool_choice {self.choice!r}) would have "
                f"{len(text)} characters, more than the {MAX_CONSTRAINT_CHARS} allowed: give fewer or "
                "smaller tools"
            )  # fmt: skip
        return "grammar", text


def _arguments_schema(tool: Tool) -> str:
    """A tool's parameters schema for `%json`, closed (`constraints.closed_schema`: only the declared
    properties unless the schema allows others; a strict tool's every object schema), with llguidance's
    options: JSON whitespace bounded as the engine bounds it for response formats, unsupported keywords
    ignored unless the tool is strict."""
    options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not tool.strict}
    schema = closed_schema(tool.parameters or {"type": "object"}, every_object=tool.strict)
    return json.dumps({**schema, "x-guidance": options})


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The tool settings of an OpenAI chat completions body (`tools`, `tool_choice`,
    `parallel_tool_calls`), or None when it has no tools and no tool_choice other than "none".
    tool_choice defaults to "auto" with tools; "required" and a named function need tools, and the
    name must be one of them. Raises ParamError naming the field."""
    tools = validate_tools(body.get("tools"))
    choice, function = validate_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if not tools:
        return None
    return ToolRequest(tuple(tools), choice, function, parallel is not False)


def validate_tools(raw: Any) -> list[Tool]:
    """OpenAI `tools` (null = none): at most `MAX_TOOLS` objects `{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}` with distinct names of 1-64 letters,
    digits, `_` or `-`, and parameters an object schema. Raises ParamError naming the field."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise ParamError("tools", "tools must be a non-empty array of tool objects")
    if len(raw) > MAX_TOOLS:
        raise ParamError("tools", f"tools takes at most {MAX_TOOLS} tools")
    tools = [_tool(item, f"tools[{i}]") for i, item in enumerate(raw)]
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            where = f"tools[{i}].function.name"
            raise ParamError(where, f"{where}: the function name {tool.name!r} is used twice")
        seen.add(tool.name)
    return tools


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function":
        raise ParamError(where, f'{where} must be an object with "type": "function"')
    function = item.get("function")
    if not isinstance(function, dict):
        raise ParamError(f"{where}.function", f"{where}.function must be an object")
    name, description, strict = named_schema_fields(function, f"{where}.function")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_parameters(parameters, f"{where}.function.parameters")
    return Tool(name, description, parameters, strict)


def named_schema_fields(obj: dict[str, Any], where: str) -> tuple[str, str | None, bool]:
    """The `name` (1 to 64 letters, digits, `_` or `-`), `description` (a string, optional) and
    `strict` (a boolean, default false) of a tool's function or a response format's json_schema.
    Raises ParamError naming the field."""
    name = obj.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ParamError(
            f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, underscores or dashes"
        )
    for key, kind, words in (("description", str, "a string"), ("strict", bool, "true or false")):
        if obj.get(key) is not None and not isinstance(obj[key], kind):
            raise ParamError(f"{where}.{key}", f"{where}.{key} must be {words}")
    return name, obj.get("description"), obj.get("strict") is True


def validate_tool_choice(raw: Any, tools: list[Tool]) -> tuple[str, str]:
    """(choice, function name) from OpenAI `tool_choice`: "none", "auto", "required" or
    `{"type": "function", "function": {"name": ...}}` (then choice "function"). Null = "auto" with
    tools, "none" without. Raises ParamError naming the field."""
    if raw is None:
        return ("auto" if tools else "none"), ""
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise ParamError(
                "tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function object"
            )
        if raw != "none" and not tools:
            raise ParamError("tool_choice", f"tool_choice {raw!r} needs tools")
        return raw, ""
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ParamError(
            "tool_choice", 'tool_choice must be a string or {"type": "function", "function": {"name": ...}}'
        )
    if name not in {t.name for t in tools}:
        raise ParamError(
            "tool_choice.function.name",
            f"tool_choice names the function {name!r}, which is not among the tools",
        )
    return "function", name


def _check_parameters(schema: Any, where: str) -> None:
    """A function's parameters: a JSON Schema object whose type, if given, is "object"."""
    if not isinstance(schema, dict):
        raise ParamError(where, f"{where} must be a JSON Schema object")
    if schema.get("type", "object") != "object":
        raise ParamError(f"{where}.type", f'{where}.type must be "object": the arguments are a JSON object')
    check_schema(schema, where)


def check_schema(schema: Any, where: str) -> None:
    """The shape of a JSON Schema's keywords that hold schemas, types, required names and enums
    (the engine's compiler checks the rest), nested at most `MAX_SCHEMA_DEPTH` deep. Raises
    ParamError naming the path of the fault."""
    _check_shape(schema, where, 0)


def check_schema_rows(schema: Any, where: str) -> None:
    """For a schema that becomes a grammar (its shape checked by `check_schema`): its alternatives at
    one point (`constraints.schema_row_items`) at most `MAX_ROW_ITEMS`. Raises ParamError naming
    `where`."""
    items = schema_row_items(schema)
    if items > MAX_ROW_ITEMS:
        raise ParamError(
            where, f"{where} has about {items} alternatives at one point (anyOf/oneOf branches, object or "
            f"array enum values, optional properties: 4 each), more than the {MAX_ROW_ITEMS} allowed"
        )  # fmt: skip


def _check_shape(schema: Any, where: str, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ParamError(where, f"{where} must be a JSON Schema (an object or a boolean)")
    if depth > MAX_SCHEMA_DEPTH:
        raise ParamError(where, f"{where}: the schema nests more than {MAX_SCHEMA_DEPTH} levels")
    _check_keywords(schema, where)
    for key, value in schema.items():
        path = f"{where}.{key}"
        if key in SUBSCHEMA and not (key == "items" and isinstance(value, list)):
            _check_shape(value, path, depth + 1)
        elif key in SUBSCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise ParamError(path, f"{path} must be a non-empty array of schemas")
            for i, item in enumerate(value):
                _check_shape(item, f"{path}[{i}]", depth + 1)
        elif key in SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                raise ParamError(path, f"{path} must be an object of schemas")
            for name, item in value.items():
                _check_shape(item, f"{path}.{name}", depth + 1)


def _check_keywords(schema: dict[str, Any], where: str) -> None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and (not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds)):
        raise ParamError(
            f"{where}.type",
            f"{where}.type must be one of {', '.join(sorted(JSON_TYPES))} or an array of them",
        )
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise ParamError(f"{where}.required", f"{where}.required must be an array of property names")
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        raise ParamError(f"{where}.enum", f"{where}.enum must be a non-empty array")
    ref = schema.get("$ref")
    if ref is not None and not isinstance(ref, str):
        raise ParamError(f"{where}.$ref", f"{where}.$ref must be a string")
