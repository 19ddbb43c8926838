"""Structured outputs: the one place where a request's constraint on its output is read and checked, for
every API; the engine compiles and enforces it (`SamplingParams.structured`, see common.proto).

`structured_output` reads at most one constraint from a body or WebSocket `params` (`STRUCTURED_KEYS`:
OpenAI's `response_format`; vLLM's `structured_outputs` with `json`, `json_object`, `regex`, `choice` or
`grammar`, Lark or GBNF; its older `guided_*`); two are refused, naming both. The gRPC API's protobuf
goes through `check_structured`. Checks here are of shape (a known kind, well-formed schema keywords, a
non-empty list of strings) and of size (`services.common.constraints`), the same on every API; the
engine's compiler checks the rest (a regex's or grammar's syntax) with INVALID_ARGUMENT. Every JSON
schema is sent closed where it declares `properties` (`constraints.closed_schema`). Everything raises
`ParamError` naming the field. The accepted forms and limits: README ("Structured outputs and tools").
"""

from __future__ import annotations

import json
from typing import Any

from gateway.params import ParamError, parse_json_field
from gateway.tools import check_schema, check_schema_rows, named_schema_fields
from services.common.constraints import MAX_CONSTRAINT_CHARS, MAX_ROW_ITEMS, closed_schema, grammar_row_items
from services.common.pb import common_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
STRUCTURED_KEYS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# structured_outputs key → kind
_VLLM_KINDS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_output(
    body: dict[str, Any], *, where: str = ""
) -> tuple[str, common_pb2.StructuredOutput] | None:
    """The constraint of an OpenAI body or WebSocket `params` (`STRUCTURED_KEYS`; null = absent) as
    (the field that gave it, the protobuf), or None when there is none. `where` prefixes the names in
    errors ("params."). Raises ParamError naming the field, or both fields when two constrain."""
    found: list[tuple[str, common_pb2.StructuredOutput]] = []
    for key in STRUCTURED_KEYS:
        value = body.get(key)
        if value is None:
            continue
        label = where + key
        if key == "response_format":
            spec = _response_format(value, label)
            if spec is not None:
                found.append((label, spec))
        elif key == "structured_outputs":
            found.extend(_structured_outputs(value, label))
        else:
            found.append((label, _vllm_value(_GUIDED[key], value, label)))
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise ParamError(second, f"{first} and {second} both constrain the output: give at most one")
    return found[0] if found else None


def check_structured(spec: common_pb2.StructuredOutput, label: str) -> common_pb2.StructuredOutput:
    """`spec` when it is well formed: kind "" (none) with no text, or one of `KINDS` with the text that
    kind takes (json_schema: a JSON Schema object's text, returned closed; json_object: none; choice: a
    JSON list of strings; regex, grammar: non-empty), within the size limits of
    `services.common.constraints`. Raises ParamError naming `label` or a path under it."""
    if spec.kind not in ("", *KINDS):
        raise ParamError(f"{label}.kind", f"{label}.kind must be one of {', '.join(KINDS)}")
    text_label = f"{label}.text"
    if len(spec.text) > MAX_CONSTRAINT_CHARS:
        raise ParamError(text_label, f"{text_label} may have at most {MAX_CONSTRAINT_CHARS} characters")
    if spec.kind in ("", "json_object"):
        if spec.text:
            raise ParamError(text_label, f"{text_label} must be empty for kind {spec.kind or 'none'!r}")
        return spec
    if spec.kind == "json_schema":
        checked = _schema_spec(parse_json_field(spec.text, text_label), text_label)
        checked.strict = spec.strict
        return checked
    if spec.kind == "choice":
        _choices(parse_json_field(spec.text, text_label), text_label)
    elif not spec.text:
        raise ParamError(text_label, f"{text_label} must not be empty for kind {spec.kind!r}")
    return _checked(spec, text_label)


def _response_format(value: Any, label: str) -> common_pb2.StructuredOutput | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ParamError(label, f'{label} must be an object with "type" text, json_object or json_schema')
    _only(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, label)
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(kind="json_object")
    return _json_schema(value.get("json_schema"), f"{label}.json_schema")


def _json_schema(value: Any, label: str) -> common_pb2.StructuredOutput:
    if not isinstance(value, dict):
        raise ParamError(label, f"{label} must be an object with a name and a schema")
    _only(value, {"name", "schema", "strict", "description"}, label)
    _, _, strict = named_schema_fields(value, label)
    schema = value.get("schema")
    if schema is None:
        return common_pb2.StructuredOutput(kind="json_object")
    spec = _schema_spec(schema, f"{label}.schema")
    spec.strict = strict
    return spec


def _structured_outputs(value: Any, label: str) -> list[tuple[str, common_pb2.StructuredOutput]]:
    if not isinstance(value, dict):
        raise ParamError(label, f"{label} must be an object")
    _only(value, set(_VLLM_KINDS), label)
    found = []
    for key in _VLLM_KINDS:
        given = value.get(key)
        if given is None or (key == "json_object" and given is False):
            continue
        found.append((f"{label}.{key}", _vllm_value(key, given, f"{label}.{key}")))
    return found


def _vllm_value(key: str, value: Any, label: str) -> common_pb2.StructuredOutput:
    """A vLLM constraint value (`structured_outputs.KEY` or `guided_KEY`) as the protobuf."""
    if key == "json":
        schema = parse_json_field(value, label) if isinstance(value, str) else value
        return _schema_spec(schema, label)
    if key == "json_object":
        if value is not True:
            raise ParamError(label, f"{label} must be true")
        return common_pb2.StructuredOutput(kind="json_object")
    if key == "choice":
        text = json.dumps(_choices(value, label), ensure_ascii=False)
        return _checked(common_pb2.StructuredOutput(kind="choice", text=text), label)
    if not isinstance(value, str) or not value:
        raise ParamError(label, f"{label} must be a non-empty string")
    return _checked(common_pb2.StructuredOutput(kind=_VLLM_KINDS[key], text=value), label)


def _schema_spec(schema: Any, label: str) -> common_pb2.StructuredOutput:
    """A JSON schema, checked and closed (`closed_schema`), as the protobuf."""
    if not isinstance(schema, dict):
        raise ParamError(label, f"{label} must be a JSON Schema object")
    check_schema(schema, label)
    check_schema_rows(schema, label)
    text = json.dumps(closed_schema(schema, every_object=False), ensure_ascii=False, separators=(",", ":"))
    return _checked(common_pb2.StructuredOutput(kind="json_schema", text=text), label)


def _checked(spec: common_pb2.StructuredOutput, label: str) -> common_pb2.StructuredOutput:
    """`spec` when its text is within `MAX_CONSTRAINT_CHARS` and a grammar's alternatives within
    `MAX_ROW_ITEMS` (a schema's are counted by `check_schema`, a choice's by `_choices`)."""
    if len(spec.text) > MAX_CONSTRAINT_CHARS:
        raise ParamError(label, f"{label} may have at most {MAX_CONSTRAINT_CHARS} characters")
    if spec.kind == "grammar":
        items = grammar_row_items(spec.text)
        if items > MAX_ROW_ITEMS:
            raise ParamError(label, f"{label} has {items} alternatives ('|'), more than the {MAX_ROW_ITEMS} "
                             "allowed")  # fmt: skip
    return spec


def _choices(value: Any, label: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ParamError(label, f"{label} must be a non-empty list of non-empty strings")
    if len(value) > MAX_ROW_ITEMS:
        raise ParamError(label, f"{label} has {len(value)} strings, more than the {MAX_ROW_ITEMS} allowed")
    return value


def _only(obj: dict[str, Any], allowed: set[str], label: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ParamError(f"{label}.{unknown[0]}", f"{label}: unknown field(s) {', '.join(unknown)}")
