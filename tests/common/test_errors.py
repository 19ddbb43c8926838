"""Classes of the engine's error finals, finish reasons and status codes."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import (
    DEADLINE_EXCEEDED,
    FINISH_REASONS,
    INTERNAL,
    INVALID_ARGUMENT,
    STATUS_CODES,
    UNAVAILABLE,
    code_of_status,
    error_class,
    error_detail,
    error_message,
    finish_reason_name,
)
from services.common.pb import common_pb2


@pytest.mark.parametrize("cls", [INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL])
def test_a_message_carries_its_class(cls: str) -> None:
    message = error_message(cls, "prompt has 9: tokens")
    assert message.startswith(f"{cls}: ")
    assert error_class(message) == cls


@pytest.mark.parametrize("message", ["", "deadline exceeded", "engine: broken", "unknown_class: detail"])
def test_a_message_without_a_known_class_is_internal(message: str) -> None:
    assert error_class(message) == INTERNAL


def test_the_detail_is_the_message_without_its_class() -> None:
    assert error_detail(error_message(INVALID_ARGUMENT, "prompt has 9: tokens")) == "prompt has 9: tokens"
    assert error_detail("engine: broken") == "engine: broken"


def test_finish_reasons_and_status_codes_read_back() -> None:
    for name, value in FINISH_REASONS.items():
        assert finish_reason_name(value) == name
    assert finish_reason_name(common_pb2.FINISH_REASON_UNSPECIFIED) == ""
    for code, status in STATUS_CODES.items():
        assert code_of_status(status) == code
    assert code_of_status(grpc.StatusCode.UNKNOWN) == INTERNAL
