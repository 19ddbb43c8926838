"""The compute rule both the engine's scheduler and the gateway's router apply to prefix-cache hits."""

from __future__ import annotations

import pytest

from services.common.block_keys import max_hit_blocks


@pytest.mark.parametrize(("num_tokens", "hit"), [(1, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_the_last_token_is_always_computed(num_tokens: int, hit: int) -> None:
    assert max_hit_blocks(num_tokens, 16) == hit
