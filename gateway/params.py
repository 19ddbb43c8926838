"""Validation of client-supplied values, one set of rules for the WebSocket, OpenAI-compatible and public
gRPC APIs: `generation_params` turns any of their sampling and stopping values into the pipeline's
protobufs. The gateway's defaults and limits (README, "APIs") live here and only here; bounds the engine
checks too come from `services.common.limits`. An unset max tokens is 0 on the wire: the engine, owner
of the context limit, fills it. One request's size is capped by `check_generations` and
`check_request_tokens` (an unset max tokens counts as the whole context). `OPENAI_EXTENSIONS` are the
keys of `GENERATION_KEYS` OpenAI lacks and vLLM accepts (the README lists the same; a test checks).
Imports no other gateway module: settings come in as plain values. Every function raises `ParamError`
naming the offending parameter; callers give it their own shape. A document is decoded by `parse_json`
and checked whole by `check_text` before any value is read, so every string later read, echoed or put
in a protobuf is valid Unicode.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.common.limits import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)
from services.common.pb import common_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**64 - 1
MAX_INT32 = 2**31 - 1
FLOAT32_TINY = 2.0**-126  # the smallest normal float32
MAX_LOGPROBS_COMPLETIONS = 5
MAX_REQUEST_ID_CHARS = 128
MAX_N = 128
REQUEST_CONTEXTS = 16  # the default cap on one request's tokens, in contexts (`check_request_tokens`)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ParamError(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def parse_json(raw: str | bytes | bytearray) -> Any:
    """The JSON document `raw`. Raises ParamError (param None) when it is not JSON or is nested too
    deeply to decode."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ParamError(None, "the JSON is nested too deeply") from None
    except ValueError as exc:
        raise ParamError(None, f"not valid JSON: {exc}") from None


def is_text(value: str) -> bool:
    """Whether `value` is Unicode text UTF-8 can carry: JSON may hold a lone surrogate such as
    "\\ud83d" (what JavaScript gives when it slices an emoji), which is not."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_text(document: Any) -> None:
    """Raises ParamError unless every string of a decoded JSON document, object keys included, is
    text (`is_text`). The param is the path of the bad string (`messages[0].content`), or of the
    object holding a bad key (None at the top)."""
    pending: list[tuple[str, Any]] = [("", document)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str) and not is_text(value):
            raise _not_text(path, path or "the JSON")
        if isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_text(key):
                    raise _not_text(path, f"a key of {path}" if path else "a key")
                pending.append((f"{path}.{key}" if path else key, item))


def _not_text(path: str, label: str) -> ParamError:
    return ParamError(path or None, f"{label} holds a lone surrogate, which is not Unicode text")


def only_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ParamError(unknown[0], f"unknown field(s) in {where}: {', '.join(unknown)}")


def number(
    obj: dict[str, Any], name: str, lo: float, hi: float, *, where: str = "", above_lo: bool = False
) -> float | None:
    """`obj[name]` as a float in [lo, hi] ((lo, hi] with `above_lo`), or None when absent or null."""
    value = obj.get(name)
    return None if value is None else bounded(value, where + name, lo, hi, above_lo=above_lo)


def bounded(value: Any, label: str, lo: float, hi: float, *, above_lo: bool = False) -> float:
    """`value` (named `label`) as a float in [lo, hi] ((lo, hi] with `above_lo`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParamError(label, f"{label} must be a number")
    if isinstance(value, float) and not math.isfinite(value):  # an int is compared exactly, however long
        raise ParamError(label, f"{label} must be a number")
    if above_lo and not lo < value <= hi:
        raise ParamError(label, f"{label} must be greater than {lo:g} and at most {hi:g}")
    if not lo <= value <= hi:
        raise ParamError(label, f"{label} must be between {lo:g} and {hi:g}")
    return float(value)


def repetition_penalty(obj: dict[str, Any], *, where: str = "") -> float:
    """`obj["repetition_penalty"]` from MIN_ to MAX_REPETITION_PENALTY, or 0 (off) when 0, absent or
    null. A tiny positive one is refused: dividing the logits by it overflows them."""
    value = number(obj, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, where=where) or 0.0
    return _repetition_penalty(value, where + "repetition_penalty")


def _repetition_penalty(value: float, label: str) -> float:
    if 0.0 < value < MIN_REPETITION_PENALTY:
        raise ParamError(
            label,
            f"{label} must be 0 (off) or between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g}",
        )
    return value


def top_p(obj: dict[str, Any], *, where: str = "") -> float:
    """`obj["top_p"]` in (0, 1] as vLLM takes it; 0.0 (off, in the protobuf) when absent or null.
    A 0 is refused, not read as off; a value too small for the protobuf's float32 (which would round
    to 0, off) is raised to the smallest normal float32."""
    value = number(obj, "top_p", 0.0, 1.0, where=where, above_lo=True)
    return 0.0 if value is None else _top_p(value)


def _top_p(value: float) -> float:
    return max(value, FLOAT32_TINY)


def integer(obj: dict[str, Any], name: str, lo: int, hi: int, *, where: str = "") -> int | None:
    """`obj[name]` as an int in [lo, hi], or None when absent or null."""
    value = obj.get(name)
    return None if value is None else bounded_int(value, where + name, lo, hi)


def bounded_int(value: Any, label: str, lo: int, hi: int) -> int:
    """`value` (named `label`) as an int in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(label, f"{label} must be an integer")
    if not lo <= value <= hi:
        raise ParamError(label, f"{label} must be between {lo} and {hi}")
    return value


def boolean(obj: dict[str, Any], name: str, *, where: str = "") -> bool | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ParamError(where + name, f"{where + name} must be true or false")
    return value


def stop_strings(raw: Any, label: str) -> list[str]:
    """A stop string or a list of them (null = none)."""
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ParamError(label, f"{label} must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise ParamError(label, f"{label} takes at most {MAX_STOP_STRINGS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ParamError(label, f"{label}: a stop string may have at most {MAX_STOP_CHARS} characters")
    return stops


def stop_token_ids(raw: Any, label: str) -> list[int]:
    """A list of token ids (null = none), each an int from 0 to `MAX_INT32` (the protobuf's int32)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ParamError(label, f"{label} must be a list of token ids")
    if len(raw) > MAX_STOP_TOKEN_IDS:
        raise ParamError(label, f"{label} takes at most {MAX_STOP_TOKEN_IDS} ids")
    return list(_ids(raw, label))


def prompt_or_messages(obj: dict[str, Any]) -> tuple[str | None, tuple[common_pb2.ChatMessage, ...] | None]:
    """(prompt, messages) of an object that must give exactly one of a string `prompt` and chat
    `messages` (`chat_messages`); the other is None."""
    if ("prompt" in obj) == ("messages" in obj):
        raise ParamError(None, "give exactly one of 'prompt' and 'messages'")
    if "messages" in obj:
        return None, chat_messages(obj["messages"], "messages")
    if not isinstance(obj["prompt"], str):
        raise ParamError("prompt", "'prompt' must be a string")
    return obj["prompt"], None


def chat_role(role: Any, where: str) -> str:
    """`role` when it is one of `CHAT_ROLES`; `where` names the message."""
    if role not in CHAT_ROLES:
        raise ParamError(where, f"{where} needs a 'role' among {', '.join(CHAT_ROLES)}")
    return role


def chat_messages(raw: Any, label: str) -> tuple[common_pb2.ChatMessage, ...]:
    """A non-empty list of OpenAI chat messages as `ChatMessage`s. A message is an object with a
    `role` (one of `CHAT_ROLES`) and a `content`: a string, or (OpenAI style) a list of
    {"type": "text", "text": ...} parts, joined; null only on an assistant turn with `tool_calls`.
    Also read: `name` (any role), `tool_calls` (assistant: see `history_tool_calls`) and
    `tool_call_id` (required on a tool message). Any other key with a value other than null is
    refused, naming it."""
    if not isinstance(raw, list) or not raw:
        raise ParamError(label, f"'{label}' must be a non-empty list")
    return tuple(_chat_message(message, f"{label}[{i}]") for i, message in enumerate(raw))


_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def _chat_message(message: Any, where: str) -> common_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise ParamError(where, f"{where} must be an object")
    for key in sorted(set(message) - _MESSAGE_KEYS):
        if message[key] is not None:
            raise ParamError(f"{where}.{key}", f"{where}.{key} is not supported")
    role = chat_role(message.get("role"), where)
    content = message.get("content")
    if isinstance(content, list):
        content = _text_parts(content, where)
    if content is not None and not isinstance(content, str):
        raise ParamError(where, _NEEDS_CONTENT.format(where=where))
    raw_calls = message.get("tool_calls")
    calls = None if raw_calls is None else history_tool_calls(raw_calls, where)
    proto = common_pb2.ChatMessage(
        role=role,
        content=content,
        name=_optional_string(message, "name", where),
        tool_call_id=_optional_string(message, "tool_call_id", where),
        tool_calls_json=calls or "",
    )
    return check_chat_message(proto, where)


def _optional_string(message: dict[str, Any], key: str, where: str) -> str:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise ParamError(f"{where}.{key}", f"{where}.{key} must be a string")
    return value or ""


_NEEDS_CONTENT = "{where} needs a string 'content' (null only with tool_calls)"


def check_chat_message(message: common_pb2.ChatMessage, where: str) -> common_pb2.ChatMessage:
    """`message` when it is a valid turn: a role among `CHAT_ROLES`; content set unless it is an
    assistant turn with tool calls; tool calls only on an assistant turn (their JSON text checked by
    `history_tool_calls`); a tool turn answers a call (`tool_call_id`). Raises ParamError naming the
    field."""
    chat_role(message.role, where)
    calls = message.tool_calls_json
    if calls and message.role != "assistant":
        raise ParamError(f"{where}.tool_calls", f"{where}: only an assistant message has tool_calls")
    if calls:
        history_tool_calls(parse_json_field(calls, f"{where}.tool_calls"), where)
    if not (message.HasField("content") or calls):
        raise ParamError(where, _NEEDS_CONTENT.format(where=where))
    if message.role == "tool" and not message.tool_call_id:
        raise ParamError(f"{where}.tool_call_id", f"{where}: a tool message needs a 'tool_call_id'")
    return message


def parse_json_field(text: str, label: str) -> Any:
    """The JSON document in the string field `label`. Raises ParamError naming it."""
    try:
        return parse_json(text)
    except ParamError as exc:
        raise ParamError(label, f"{label}: {exc.message}") from None


def history_tool_calls(raw: Any, where: str) -> str:
    """An assistant message's OpenAI `tool_calls` (a non-empty array of `{"id", "type": "function",
    "function": {"name", "arguments"}}`, arguments a string) as the JSON text the tokenizer takes
    (`ChatMessage.tool_calls_json`). `where` names the message. Raises ParamError naming the field.
    Arguments that are not valid JSON are taken as they are, as OpenAI takes them: a call the server
    itself wrote may have been cut by max_tokens, and an agent sends it back in its history (the
    tokenizer renders such a string as it is)."""
    if not isinstance(raw, list) or not raw:
        raise ParamError(f"{where}.tool_calls", f"{where}.tool_calls must be a non-empty array")
    for i, call in enumerate(raw):
        path = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str):
            raise ParamError(path, f"{path} must be an object with an id and a function")
        if not isinstance(function.get("name"), str):
            raise ParamError(f"{path}.function.name", f"{path}.function.name must be a string")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise ParamError(f"{path}.function.arguments", f"{path}.function.arguments must be a string")
    return json.dumps(raw, ensure_ascii=False)


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ParamError(where, f"{where}: only text content parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def length_controls(obj: dict[str, Any], stopping: common_pb2.StoppingParams, *, where: str = "") -> None:
    """The vLLM extensions for fixed output lengths, `ignore_eos` (bool) and `min_tokens` (0 to the
    request's max tokens when it gave one), set on `stopping`, whose `max_new_tokens` must already be
    set (0: the rest of the context, which the engine checks against)."""
    ignore_eos = boolean(obj, "ignore_eos", where=where)
    if ignore_eos is not None:
        stopping.ignore_eos = ignore_eos
    min_tokens = integer(obj, "min_tokens", 0, MAX_INT32, where=where)
    if min_tokens is not None:
        stopping.min_new_tokens = _min_tokens(min_tokens, stopping.max_new_tokens, where + "min_tokens")


def _min_tokens(min_tokens: int, max_tokens: int, label: str) -> int:
    """`min_tokens`, at most `max_tokens` when one is given (not 0)."""
    if max_tokens and min_tokens > max_tokens:
        raise ParamError(label, f"{label} ({min_tokens}) must not exceed max_tokens ({max_tokens})")
    return min_tokens


def logit_bias(raw: Any, label: str) -> dict[int, float]:
    """OpenAI's `logit_bias`, an object of token ids (decimal strings, or ints from the gRPC map) to
    a bias from -100 to 100, as token id → bias; null = none."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ParamError(label, f"{label} must be an object of token ids to biases")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError(label, f"{label} takes at most {MAX_LOGIT_BIAS_ENTRIES} token ids")
    biases: dict[int, float] = {}
    for key, value in raw.items():
        text = str(key)
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_INT32:
            raise ParamError(label, f"{label}: {text!r} is not a token id (0 to {MAX_INT32})")
        bias = number({text: value}, text, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, where=f"{label}.")
        if bias is None:
            raise ParamError(f"{label}.{text}", f"{label}.{text} must be a number")
        biases[int(text)] = bias
    return biases


def token_ids(raw: Any, label: str) -> tuple[int, ...]:
    """A non-empty list of token ids, each an int from 0 to `MAX_INT32` (the engine refuses one
    outside the vocabulary)."""
    if not isinstance(raw, list) or not raw:
        raise ParamError(label, f"{label} must be a non-empty list of token ids")
    return _ids(raw, label)


def _ids(raw: list[Any], label: str) -> tuple[int, ...]:
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_INT32 for i in raw):
        raise ParamError(label, f"{label} must hold integers from 0 to {MAX_INT32}")
    return tuple(raw)


def completion_prompts(raw: Any, label: str = "prompt") -> list[str | tuple[int, ...]]:
    """OpenAI completions' `prompt`: a string, a list of strings, a list of token ids, or a list of
    lists of token ids; one entry per prompt of the batch (a string, or a tuple of ids)."""
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list) or not raw:
        raise ParamError(label, f"'{label}' must be a string, a list of strings, a list of token ids or a "
                         "list of lists of token ids")  # fmt: skip
    if all(isinstance(item, str) for item in raw):
        return list(raw)
    if all(isinstance(item, list) for item in raw):
        return [token_ids(item, f"{label}[{i}]") for i, item in enumerate(raw)]
    return [token_ids(raw, label)]


def choices_per_prompt(body: dict[str, Any]) -> int:
    """OpenAI's `n` (1 to `MAX_N`, default 1), and `best_of`, which may only repeat it (choices are
    not ranked by likelihood)."""
    n = integer(body, "n", 1, MAX_N) or 1
    best_of = integer(body, "best_of", 1, MAX_N)
    if best_of not in (None, n):
        raise ParamError("best_of", f"best_of ({best_of}) must equal n ({n}): choices are not ranked")
    return n


def check_generations(count: int, cap: int, label: str = "n") -> None:
    """Raises ParamError (naming `label`) when a request asks for more than `cap` generations (the
    gateway's `max_generations`)."""
    if count > cap:
        raise ParamError(
            label, f"the request asks for {count} generations (prompts times n); at most {cap} are allowed "
            "(the gateway's --max-generations)"
        )  # fmt: skip


async def check_request_tokens(
    max_tokens: Sequence[int],
    cap: int,
    context_length: Callable[[], Awaitable[int]],
    label: str = "max_tokens",
) -> None:
    """Raises ParamError (naming `label`) when a request's generations, whose `max_tokens` are given
    (0: none, the rest of the context, which the engine fills), ask for more tokens together than
    `cap` (the gateway's `max_request_tokens`; 0: `REQUEST_CONTEXTS` times the context length); each
    counts as its max_tokens, or the whole context when it gives none, and at most the context.
    `context_length` (the model's, from the tokenizer's Info: this cap is the gateway's own, the
    engine owns the limit of one generation) is awaited only when the sum could pass the cap; its
    AioRpcError is raised as it is. A context length of 0 (unknown) counts no more than max_tokens."""
    if not cap and len(max_tokens) <= REQUEST_CONTEXTS:
        return  # each generation asks for at most the context
    if cap and all(max_tokens) and sum(max_tokens) <= cap:
        return
    context = await context_length()
    if not context:
        context = max(max_tokens)  # unknown: unset max_tokens count as nothing
    limit = cap or REQUEST_CONTEXTS * context
    asked = sum(min(m or context, context) for m in max_tokens)
    if asked > limit:
        setting = "--max-request-tokens" if cap else f"--max-request-tokens: {REQUEST_CONTEXTS} contexts"
        raise ParamError(
            label, f"the request asks for up to {asked} tokens over its {len(max_tokens)} generation(s) "
            f"(max_tokens each, the {context}-token context when unset); at most {limit} are allowed "
            f"({setting}): give a smaller max_tokens or fewer generations"
        )  # fmt: skip


def scoring_only(body: dict[str, Any], echo: bool) -> bool:
    """Whether an OpenAI completions body asks to score its prompt only: `max_tokens` 0, which needs
    `echo` (the prompt, and with `logprobs` its logprobs, are then the whole answer)."""
    value = body.get("max_tokens")
    if isinstance(value, bool) or value != 0:
        return False
    if not echo:
        raise ParamError("max_tokens", "max_tokens 0 needs 'echo': true (the prompt is all it returns)")
    return True


def client_request_id(raw: Any) -> str | None:
    """A client's own id for its request when it is printable ASCII (space to ~) of 1 to
    `MAX_REQUEST_ID_CHARS` characters; None otherwise (the gateway then makes one)."""
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_REQUEST_ID_CHARS:
        return None
    return raw if all(" " <= c <= "~" for c in raw) else None


def logprobs(raw: int, label: str) -> int:
    """A protobuf's count of top alternatives per token (0 = no logprobs), at most `MAX_LOGPROBS`."""
    if raw > MAX_LOGPROBS:
        raise ParamError(label, f"{label} must be at most {MAX_LOGPROBS}")
    return raw


# What the OpenAI bodies accept beyond OpenAI's own sampling fields, as vLLM does.
OPENAI_EXTENSIONS = ("ignore_eos", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "top_k")
GENERATION_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "logit_bias", *OPENAI_EXTENSIONS,
})  # fmt: skip


def generation_params(
    values: dict[str, Any], default_temperature: float, *, where: str = ""
) -> tuple[common_pb2.SamplingParams, common_pb2.StoppingParams]:
    """The sampling and stopping protobufs for the values of `GENERATION_KEYS` in `values` (other
    keys are not read; absent or null = the default: `default_temperature` (the gateway's setting),
    max tokens 0 (the rest of the context: the engine, which owns the context limit, fills it), off
    for the rest). `where` prefixes the names in errors
    ("params."). Raises ParamError on the first value outside the limits (README, "APIs")."""
    sampling = common_pb2.SamplingParams()
    temperature = number(values, "temperature", 0.0, MAX_TEMPERATURE, where=where)
    sampling.temperature = default_temperature if temperature is None else temperature
    sampling.top_p = top_p(values, where=where)
    sampling.top_k = max(0, integer(values, "top_k", -1, MAX_INT32, where=where) or 0)  # -1, 0: off
    sampling.min_p = number(values, "min_p", 0.0, 1.0, where=where) or 0.0
    sampling.presence_penalty = (
        number(values, "presence_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY, where=where) or 0.0
    )
    sampling.frequency_penalty = (
        number(values, "frequency_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY, where=where) or 0.0
    )
    sampling.repetition_penalty = repetition_penalty(values, where=where)
    seed = integer(values, "seed", 0, MAX_SEED, where=where)
    if seed is not None:
        sampling.seed = seed
    sampling.logit_bias.update(logit_bias(values.get("logit_bias"), where + "logit_bias"))
    stopping = common_pb2.StoppingParams()
    stopping.max_new_tokens = integer(values, "max_tokens", 1, MAX_INT32, where=where) or 0
    stopping.stop.extend(stop_strings(values.get("stop"), where + "stop"))
    stopping.stop_token_ids.extend(stop_token_ids(values.get("stop_token_ids"), where + "stop_token_ids"))
    length_controls(values, stopping, where=where)
    return sampling, stopping


def proto_generation_params(
    sampling_in: common_pb2.SamplingParams, stopping_in: common_pb2.StoppingParams
) -> tuple[common_pb2.SamplingParams, common_pb2.StoppingParams]:
    """A copy of the gRPC API's own sampling and stopping protobufs, each field checked where it is
    (no dict in between) by the rules and in the order of `generation_params`, the names in errors
    those of `GENERATION_KEYS`. A protobuf 0 is the field's off or default, not a value (temperature
    0 is greedy; max tokens 0 is the rest of the context, which the engine fills); NaN is not 0, so it
    is refused. Fields other than these (logprobs, the output constraint) are the caller's to check.
    Raises ParamError on the first value outside the limits (README, "APIs")."""
    sampling, stopping = common_pb2.SamplingParams(), common_pb2.StoppingParams()
    sampling.CopyFrom(sampling_in)
    stopping.CopyFrom(stopping_in)
    s = sampling
    s.temperature = bounded(s.temperature, "temperature", 0.0, MAX_TEMPERATURE)
    if s.top_p:
        s.top_p = _top_p(bounded(s.top_p, "top_p", 0.0, 1.0, above_lo=True))
    if s.top_k:
        s.top_k = max(0, bounded_int(s.top_k, "top_k", -1, MAX_INT32))  # -1: off
    if s.min_p:
        bounded(s.min_p, "min_p", 0.0, 1.0)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            bounded(getattr(s, name), name, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    if s.repetition_penalty:
        value = bounded(s.repetition_penalty, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY)
        _repetition_penalty(value, "repetition_penalty")
    if s.logit_bias:
        logit_bias(dict(s.logit_bias), "logit_bias")
    t = stopping
    if t.max_new_tokens:
        bounded_int(t.max_new_tokens, "max_tokens", 1, MAX_INT32)
    stop_strings(list(t.stop) or None, "stop")
    stop_token_ids(list(t.stop_token_ids) or None, "stop_token_ids")
    if t.min_new_tokens:
        bounded_int(t.min_new_tokens, "min_tokens", 0, MAX_INT32)
        _min_tokens(t.min_new_tokens, t.max_new_tokens, "min_tokens")
    return sampling, stopping
