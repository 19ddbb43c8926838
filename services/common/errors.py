"""Classes of the engine's error finals, and how a request ends in every vocabulary of the pipeline.

A request that ends with finish_reason "error" carries the message `"<class>: <detail>"`, the class
being one of the names below (the gateway's error codes), so that a reader of `RequestFinal.error`
maps the failure without parsing prose:

- `invalid_argument`: the request cannot be served as given (a prompt at or over the context length,
  ids outside the vocabulary, parameters out of range, an id already in flight);
- `deadline_exceeded`: the request's deadline passed inside the engine;
- `unavailable`: the engine's loop stopped after an unrecoverable failure;
- `internal`: a failure of the engine itself (a step that raised).

Also the one table of each vocabulary: `STATUS_CODES` (error code → gRPC status; `resource_exhausted`
is the gateway's admission code, never a class), `FINISH_REASONS` (name → `common_pb2.FinishReason`).

This module imports nothing of the engine, so readers of finals can use it without torch.
"""

from __future__ import annotations

import grpc

from services.common.pb import common_pb2

INVALID_ARGUMENT = "invalid_argument"
DEADLINE_EXCEEDED = "deadline_exceeded"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"
CLASSES = frozenset({INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL})
RESOURCE_EXHAUSTED = "resource_exhausted"

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


STATUS_CODES: dict[str, grpc.StatusCode] = {
    INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    INTERNAL: grpc.StatusCode.INTERNAL,
}
_CODES_OF_STATUS = {status: code for code, status in STATUS_CODES.items()}


def code_of_status(status: grpc.StatusCode) -> str:
    """The error code of a gRPC status (`internal` for any other)."""
    return _CODES_OF_STATUS.get(status, INTERNAL)


FINISH_REASONS: dict[str, int] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_NAMES_OF_FINISH_REASONS = {value: name for name, value in FINISH_REASONS.items()}


def finish_reason_name(value: int) -> str:
    """The name of a `common_pb2.FinishReason` ("" for none)."""
    return _NAMES_OF_FINISH_REASONS.get(value, "")
