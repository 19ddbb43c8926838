"""Classes of the engine's error finals, finish reasons and status codes."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import (
    CLASSES,
    FINISH_REASONS,
    INTERNAL,
    STATUS_CODES,
    code_name,
    code_of_status,
    code_value,
    finish_reason_name,
)
from services.common.pb import common_pb2


@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_a_class_crosses_the_wire_as_its_enum_and_reads_back(cls: str) -> None:
    assert code_value(cls) != common_pb2.ERROR_CODE_UNSPECIFIED
    assert code_name(code_value(cls)) == cls


def test_no_error_is_unspecified_and_an_unspecified_or_unknown_code_reads_as_internal() -> None:
    assert code_value(None) == common_pb2.ERROR_CODE_UNSPECIFIED
    assert code_name(common_pb2.ERROR_CODE_UNSPECIFIED) == INTERNAL
    assert code_name(99) == INTERNAL


def test_finish_reasons_and_status_codes_read_back() -> None:
    for name, value in FINISH_REASONS.items():
        assert finish_reason_name(value) == name
    assert finish_reason_name(common_pb2.FINISH_REASON_UNSPECIFIED) == ""
    for code, status in STATUS_CODES.items():
        assert code_of_status(status) == code
    assert code_of_status(grpc.StatusCode.UNKNOWN) == INTERNAL
