"""A chat request's tools, validated: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (one set
of rules for every API that takes tools), the JSON Schema shape checks that `gateway.structured` shares,
and the grammar that makes the engine write a call when one is required, in the format of the tool-call
parser in use (`ToolRequest.grammar`; each format's class writes its own, `gateway.tool_parsers`).

Limits: at most `MAX_TOOLS` tools, names of 1 to 64 letters, digits, `_` or `-`, distinct; parameters
an object schema nested at most `MAX_SCHEMA_DEPTH` deep; a required call's grammar at most
`MAX_CONSTRAINT_CHARS` characters, its schemas at most `MAX_ROW_ITEMS` alternatives at one point
(`services.common.constraints`). Every function raises `ParamError` naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.params import ParamError
from gateway.tool_parsers.base import ToolCallStream
from services.common.constraints import (
    JSON_WHITESPACE,
    MAX_CONSTRAINT_CHARS,
    MAX_ROW_ITEMS,
    MAX_SCHEMA_DEPTH,
    SUBSCHEMA,
    SUBSCHEMA_LISTS,
    SUBSCHEMA_MAPS,
    closed_schema,
    schema_row_items,
)

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
TOOL_CHOICES = ("none", "auto", "required")


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

    def grammar(self, fmt: type[ToolCallStream]) -> tuple[str, str] | None:
        """The constraint for the engine as (kind, text), or None for `auto` and `none`: for
        `required` (any of the tools) or a named function (that one), ("grammar", a Lark grammar in
        llguidance's dialect) accepting one or more calls (exactly one when `parallel` is false) in the
        format of `fmt`, the tool-call format in use (`ToolCallStream.grammar`), so that its parser reads
        the calls back. Raises ParamError when a tool's schema has too many alternatives at one point or
        the grammar would be too long."""
        if self.choice not in ("required", "function"):
            return None
        tools = [t for t in self.tools if self.choice == "required" or t.name == self.function]
        for i, tool in enumerate(self.tools):
            if tool in tools:
                check_schema_rows(tool.parameters or {}, f"tools[{i}].function.parameters")
        text = fmt.grammar([(tool.name, _arguments_schema(tool)) for tool in tools], parallel=self.parallel)
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
