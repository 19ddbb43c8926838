"""Tool-call parsers by name (`--tool-call-parser`), and the parsers of a chat reply chosen for the
served model from its chat template (`chosen`).

- `hermes` (`gateway.tool_calls.HermesToolCalls`): `<tool_call>` blocks (Qwen 2.5 and 3, Hermes, the
  tiny model).
- `llama3_json` (`gateway.tool_calls.Llama3JsonToolCalls`): JSON calls, optionally after
  `<|python_tag|>` (Llama 3.1 to 3.3).
- `mistral` (`gateway.tool_parsers.mistral.MistralToolCalls`): calls after `[TOOL_CALLS]`.

`--tool-call-parser auto` (the default) takes the parser whose format the template writes (each
parser class `recognises` its own), hermes when none or several do; `--reasoning-parser auto` splits
`<think>` blocks out when the template writes `<think>`, and starts a reply inside one when the
template's generation prompt opens it (`reasoning.opens_reasoning`). The template and its generation
prompt come from the tokenizer's `Info`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.reasoning import THINK_CLOSE, THINK_OPEN, opens_reasoning
from gateway.tool_calls import HermesToolCalls, Llama3JsonToolCalls, ToolCallStream, new_call_id
from gateway.tool_parsers.mistral import MistralToolCalls

PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesToolCalls,
    "llama3_json": Llama3JsonToolCalls,
    "mistral": MistralToolCalls,
}
DEFAULT_PARSER = "hermes"
TOOL_CALL_PARSERS = ("auto", *PARSERS)
REASONING_PARSERS = ("auto", "think", "none")


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


@dataclass(frozen=True)
class ChatParsers:
    """How the served model's chat replies are read: `tool_parser` (a name of PARSERS), `reasoning`
    (split `<think>` text out) and `in_reasoning` (a reply starts inside a think block: the
    generation prompt opened it). `special_ids` maps the text of the tokenizer's special tokens to
    their ids, to keep the parsers' marks in the text (`keep_special_ids`)."""

    tool_parser: str = DEFAULT_PARSER
    reasoning: bool = False
    in_reasoning: bool = False
    special_ids: Mapping[str, int] = field(default_factory=dict, compare=False)

    @property
    def tool_format(self) -> type[ToolCallStream]:
        """The parser class, whose format the grammar of a required call follows."""
        return PARSERS[self.tool_parser]

    def keep_special_ids(self, *, reads_calls: bool) -> tuple[int, ...]:
        """The special tokens a reply's text must keep for its parsers (the detokenizer skips the
        others): the tool-call parser's marks when the request reads calls, the think tags when
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
