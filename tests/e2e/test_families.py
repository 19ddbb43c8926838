"""New model families through the whole pipeline (`sluice up`, four processes): a random-weight Gemma 2
(alternating sliding/full layers, attention and final soft-capping) and Qwen3 (QK norms, head_dim
apart from hidden / heads, MQA) stream the same greedy text as transformers' `generate` decoded, with a
pool and a step budget small enough that prompts are chunked, share cached blocks and are preempted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import start_pipeline
from tests.e2e.test_up import generate_all, reference

pytestmark = pytest.mark.e2e

SHARED = "A long shared opening that every second prompt repeats word for word, so that blocks are reused: "
PROMPTS = (
    SHARED + "the river",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door.",
    SHARED + "the mountain",
    "Once upon a time",
)
MAX_TOKENS = 16
# 12 blocks of 8 tokens for four requests of about 40-70 tokens each: preemption; 16 tokens a step:
# chunked prefill.
ENGINE_ENV = {
    "SLUICE_NUM_KV_BLOCKS": "12",
    "SLUICE_BLOCK_SIZE": "8",
    "SLUICE_MAX_NUM_BATCHED_TOKENS": "16",
    "SLUICE_MAX_MODEL_LEN": "96",
}


def stream_prompts(ws_url: str) -> dict[str, dict[str, Any]]:
    """Every one of PROMPTS greedy on one socket (ids r0, r1, ...): generate_all's results."""
    requests = [
        {
            "type": "generate",
            "id": f"r{i}",
            "prompt": p,
            "params": {"max_tokens": MAX_TOKENS, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS)
    ]
    return asyncio.run(generate_all(ws_url, requests))


def assert_equals_generate(model_dir: Path, family: str, got: dict[str, dict[str, Any]]) -> None:
    """Each prompt's streamed text and completion tokens equal transformers' `generate` decoded."""
    for i, prompt in enumerate(PROMPTS):
        text, _, completion_tokens = reference(model_dir, prompt, MAX_TOKENS)
        assert got[f"r{i}"]["text"] == text, (family, prompt)
        assert got[f"r{i}"]["done"]["usage"]["completion_tokens"] == completion_tokens


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_streamed_greedy_text_equals_generate(family: str, family_model_dir: Callable[[str], Path]) -> None:
    model_dir = family_model_dir(family)
    pipeline = start_pipeline(model_dir, "--standby", "0", env=ENGINE_ENV)
    try:
        got = stream_prompts(pipeline.ws_url)
    finally:
        code = pipeline.stop()
    assert code == 0, pipeline.output()
    assert_equals_generate(model_dir, family, got)
