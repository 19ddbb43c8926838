"""Classes of the engine's error finals, and how a request ends in every vocabulary of the pipeline.

A request that ends with finish_reason "error" carries its class as `RequestFinal.error_code` (the
`common_pb2.ErrorCode` enum) and plain words as `RequestFinal.error`: readers map the failure from the
enum, never from the words. The classes (the gateway's error codes): `invalid_argument` (cannot be served
as given: over the context length, ids outside the vocabulary, values out of range, an id in flight),
`deadline_exceeded` (its deadline passed inside the engine), `unavailable` (the engine's loop stopped or
its step is broken), `internal` (a failure of the engine itself). The one table of each vocabulary:
`ERROR_CODES` (name ↔ `ErrorCode`), `STATUS_CODES` (name → gRPC status; `resource_exhausted` is the
gateway's admission code, never a class), `FINISH_REASONS` (name → `FinishReason`). Imports nothing of the
engine (no torch for readers).
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

ERROR_CODES: dict[str, int] = {
    INVALID_ARGUMENT: common_pb2.ERROR_CODE_INVALID_ARGUMENT,
    DEADLINE_EXCEEDED: common_pb2.ERROR_CODE_DEADLINE_EXCEEDED,
    UNAVAILABLE: common_pb2.ERROR_CODE_UNAVAILABLE,
    INTERNAL: common_pb2.ERROR_CODE_INTERNAL,
}
_NAMES_OF_ERROR_CODES = {value: name for name, value in ERROR_CODES.items()}


def code_value(name: str | None) -> int:
    """The `common_pb2.ErrorCode` of a class name (UNSPECIFIED for None: no error)."""
    if name is None:
        return common_pb2.ERROR_CODE_UNSPECIFIED
    assert name in CLASSES, name
    return ERROR_CODES[name]


def code_name(value: int) -> str:
    """The class name of a final's `error_code`; `internal` for UNSPECIFIED or an unknown value."""
    return _NAMES_OF_ERROR_CODES.get(value, INTERNAL)


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
