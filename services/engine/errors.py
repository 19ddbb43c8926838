"""Classes of the engine's error finals.

A request that ends with finish_reason "error" carries the message `"<class>: <detail>"`, the class
being one of the names below (the gateway's error codes), so that a reader of `RequestFinal.error`
maps the failure without parsing prose:

- `invalid_argument`: the request cannot be served as given (a prompt at or over the context length,
  ids outside the vocabulary, parameters out of range, an id already in flight);
- `deadline_exceeded`: the request's deadline passed inside the engine;
- `unavailable`: the engine's loop stopped after an unrecoverable failure;
- `internal`: a failure of the engine itself (a step that raised).

This module imports nothing of the engine, so readers of finals can use it without torch.
"""

from __future__ import annotations

INVALID_ARGUMENT = "invalid_argument"
DEADLINE_EXCEEDED = "deadline_exceeded"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"
CLASSES = frozenset({INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL})

_SEPARATOR = ": "


def error_message(error_class: str, detail: str) -> str:
    """The message of an error final of `error_class` (one of CLASSES)."""
    assert error_class in CLASSES, error_class
    return f"{error_class}{_SEPARATOR}{detail}"


def error_detail(message: str) -> str:
    """An error final's words without its class prefix (the whole message when it has none)."""
    prefix, separator, detail = message.partition(_SEPARATOR)
    return detail if separator and prefix in CLASSES else message


def error_class(message: str) -> str:
    """The class of an error final's message; `internal` for a message without a known class."""
    prefix, separator, _ = message.partition(_SEPARATOR)
    return prefix if separator and prefix in CLASSES else INTERNAL
