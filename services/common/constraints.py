"""Output constraints (structured outputs, the tool-call grammar): their limits, and the rule that closes
object schemas. One owner for the gateway, which refuses a constraint past a limit with 400 before it
reaches an engine, and for the engine, which reads the same numbers.

`MAX_CONSTRAINT_CHARS` bounds a constraint's text, `MAX_SCHEMA_DEPTH` how deeply schemas nest, and
`MAX_ROW_ITEMS` the alternatives live at one point of the output as `schema_row_items` and
`grammar_row_items` estimate them (half the grammar library's row limit). `JSON_WHITESPACE` is the
whitespace a constrained JSON output may hold between tokens. `closed_schema` gives an object schema
that says nothing of `additionalProperties` `additionalProperties: false` (every object schema with
`every_object`, else only one that declares `properties`). The measurements behind the estimates:
docs/architecture.md ("Limits of a constraint").
"""

from __future__ import annotations

from typing import Any

MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_ROW_ITEMS = 1000
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
_OPTIONAL_PROPERTY_ITEMS = 4  # row items an object's optional property takes (measured: 4 N + 7)
_ARRAY_ITEMS = 3  # row items an array schema takes where it may start

# Keywords whose value is one subschema, a map of name → subschema, or a list of subschemas.
SUBSCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
)
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_ALTERNATIVES = ("anyOf", "oneOf")


def subschemas(schema: dict[str, Any], *, alternatives: bool = True) -> list[Any]:
    """The subschemas `schema` holds directly (those of anyOf and oneOf only with `alternatives`)."""
    found: list[Any] = []
    for key in SUBSCHEMA:
        if isinstance(schema.get(key), dict | bool):
            found.append(schema[key])
    for key in SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            found.extend(schema[key].values())
    for key in SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list) and (alternatives or key not in _ALTERNATIVES):
            found.extend(schema[key])
    return found


def schema_row_items(schema: Any) -> int:
    """An estimate of the most parser row items a JSON schema takes at one point (docs/architecture.md,
    "Limits of a constraint"): at its start, its alternatives (anyOf, oneOf: each its own estimate), its
    enum's object and array values, its optional properties; deeper, the largest estimate of one of its
    subschemas. Recursion is bounded by the schema's depth (checked first, `MAX_SCHEMA_DEPTH`); `$ref` is not
    followed (each `$defs` entry counts where it is)."""
    if not isinstance(schema, dict):
        return 1
    start = 0
    for key in _ALTERNATIVES:
        if isinstance(schema.get(key), list):
            start += sum(schema_row_items(branch) for branch in schema[key])
    enum = schema.get("enum")
    if isinstance(enum, list):
        start += sum(isinstance(value, dict | list) for value in enum)
    if _may_be_array(schema):
        start += _ARRAY_ITEMS
    properties = schema.get("properties")
    if isinstance(properties, dict):
        required = schema.get("required")
        given = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        start += _OPTIONAL_PROPERTY_ITEMS * sum(name not in given for name in properties)
    deeper = (schema_row_items(sub) for sub in subschemas(schema, alternatives=False))
    return max(start, 1, *deeper)


def _may_be_array(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "array" or (isinstance(kind, list) and "array" in kind) or "prefixItems" in schema


def grammar_row_items(text: str) -> int:
    """An upper bound of the alternatives of a Lark or GBNF grammar: one, and one more for each `|`
    outside its string literals, regular expressions (`/.../`) and comments (`//`, `#`), over all of
    its rules."""
    count, i, n = 1, 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'" or (c == "/" and text[i + 1 : i + 2] != "/"):
            i = _literal_end(text, i)
        elif c == "#" or (c == "/" and text[i + 1 : i + 2] == "/"):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c == "|":
            count += 1
        i += 1
    return count


def _literal_end(text: str, start: int) -> int:
    """The index of the character that closes the literal opened at `start` (the end of the text if
    none does); a backslash escapes the next character."""
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i
        i += 1
    return len(text)


def closed_schema(schema: Any, *, every_object: bool) -> Any:
    """A copy of `schema` in which every object schema that declares `properties` (with
    `every_object`: every object schema, `type` "object" alone included) and says nothing of
    `additionalProperties` or `unevaluatedProperties` gets `additionalProperties: false`; data
    keywords (enum, const, default, examples) untouched."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key], every_object=every_object)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub, every_object=every_object) for name, sub in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub, every_object=every_object) for sub in out[key]]
    types = out.get("type")
    is_object = "properties" in out or (
        every_object and (types == "object" or (isinstance(types, list) and "object" in types))
    )
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
