"""Classes of the engine's error finals."""

from __future__ import annotations

import pytest

from services.engine.errors import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    error_class,
    error_detail,
    error_message,
)


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
