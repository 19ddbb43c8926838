"""Validation of client-supplied JSON values shared by the WebSocket and OpenAI-compatible APIs.

Every function raises `ParamError` naming the offending parameter; callers turn it into their own
error shape (a WebSocket `error` frame, an OpenAI error body).
"""

from __future__ import annotations

import math
from typing import Any

from services.common.pb import common_pb2

MAX_STOP_STRINGS = 16
MAX_SEED = 2**64 - 1
MAX_INT32 = 2**31 - 1


class ParamError(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def only_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ParamError(unknown[0], f"unknown field(s) in {where}: {', '.join(unknown)}")


def number(obj: dict[str, Any], name: str, lo: float, hi: float, *, where: str = "") -> float | None:
    """`obj[name]` as a float in [lo, hi], or None when absent or null."""
    value = obj.get(name)
    if value is None:
        return None
    label = where + name
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ParamError(label, f"{label} must be a number")
    if not lo <= value <= hi:
        raise ParamError(label, f"{label} must be between {lo:g} and {hi:g}")
    return float(value)


def integer(obj: dict[str, Any], name: str, lo: int, hi: int, *, where: str = "") -> int | None:
    """`obj[name]` as an int in [lo, hi], or None when absent or null."""
    value = obj.get(name)
    if value is None:
        return None
    label = where + name
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
    return stops


def chat_messages(raw: Any, label: str) -> tuple[tuple[str, str], ...]:
    """A non-empty list of {"role", "content"} objects as (role, content) pairs. Content is a string,
    or (OpenAI style) a list of {"type": "text", "text": ...} parts, joined. Other keys of a message
    (such as "name") are ignored."""
    if not isinstance(raw, list) or not raw:
        raise ParamError(label, f"'{label}' must be a non-empty list")
    messages = []
    for i, message in enumerate(raw):
        where = f"{label}[{i}]"
        if not isinstance(message, dict):
            raise ParamError(where, f"{where} must be an object")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):
            content = _text_parts(content, where)
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ParamError(where, f"{where} needs a string 'role' and a string 'content'")
        messages.append((role, content))
    return tuple(messages)


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ParamError(where, f"{where}: only text content parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def length_controls(obj: dict[str, Any], stopping: common_pb2.StoppingParams, *, where: str = "") -> None:
    """The vLLM extensions for fixed output lengths, `ignore_eos` (bool) and `min_tokens` (0 to the
    request's max tokens), set on `stopping`, whose `max_new_tokens` must already be final."""
    ignore_eos = boolean(obj, "ignore_eos", where=where)
    if ignore_eos is not None:
        stopping.ignore_eos = ignore_eos
    min_tokens = integer(obj, "min_tokens", 0, MAX_INT32, where=where)
    if min_tokens is None:
        return
    if min_tokens > stopping.max_new_tokens:
        label, most = where + "min_tokens", stopping.max_new_tokens
        raise ParamError(label, f"{label} ({min_tokens}) must not exceed max_tokens ({most})")
    stopping.min_new_tokens = min_tokens
