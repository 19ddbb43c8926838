"""The tool-call formats, one class each, by name (`--tool-call-parser`). Each class (a
`base.ToolCallStream`) owns both sides of its format: the parser that reads calls out of generated
text, and the grammar that makes the engine write calls in that format when a request requires one
(`tool_choice` "required" or a named function), so that what a required call writes is what the same
format reads back: `hermes` (`<tool_call>` blocks), `llama3_json` (JSON calls, optionally after
`<|python_tag|>`) and `mistral` (calls after `[TOOL_CALLS]`). `infer_parser` gives the format a chat
template writes (each class `recognises` its own; hermes when none or several do), for
`--tool-call-parser auto`, chosen in `gateway.chat_output.chosen`. The names are
`gateway.choices.TOOL_CALL_PARSERS` (a test checks); the models of each: README, docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_parsers.base import ToolCallStream, new_call_id
from gateway.tool_parsers.hermes import HermesToolCalls
from gateway.tool_parsers.llama3_json import Llama3JsonToolCalls
from gateway.tool_parsers.mistral import MistralToolCalls

PARSERS: dict[str, type[ToolCallStream]] = {
    cls.NAME: cls for cls in (HermesToolCalls, Llama3JsonToolCalls, MistralToolCalls)
}
DEFAULT_PARSER = HermesToolCalls.NAME


def infer_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format implies, when exactly one parser recognises it;
    None when none or several do."""
    if not chat_template:
        return None
    found = [name for name, parser in PARSERS.items() if parser.recognises(chat_template)]
    return found[0] if len(found) == 1 else None


def tool_call_stream(parser: str, new_id: Callable[[], str] = new_call_id) -> ToolCallStream:
    """A fresh parser by name (one of `PARSERS`); raises ValueError for another name."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool call parser {parser!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[parser](new_id)
