"""Model families through the whole pipeline (`sluice up`, four processes): a random-weight Gemma 2
(alternating sliding/full layers, attention and final soft-capping) and Qwen3 (QK norms, head_dim
apart from hidden / heads, MQA) stream the same greedy text as transformers' `generate` decoded, with a
pool and a step budget small enough that prompts are chunked, share cached blocks and are preempted.
Every other dense family of sluice/model/families.py (the MoE ones are in test_moe.py) does the same in
one test that starts all their pipelines at once, each engine on one torch thread, so that their
start-ups overlap instead of adding up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice.model.families import FAMILIES
from tests.e2e.conftest import STARTUP_DEADLINE_S, Pipeline, launch_pipeline, start_pipeline
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


# The families of the first test and of test_moe.py; every other one runs in the shared test.
OWN_TESTS = ("gemma2", "qwen3")
SHARED_RUN = tuple(f for f in FAMILIES if f not in OWN_TESTS)


def _requests() -> list[dict[str, Any]]:
    return [
        {
            "type": "generate",
            "id": f"r{i}",
            "prompt": p,
            "params": {"max_tokens": MAX_TOKENS, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS)
    ]


def stream_prompts(ws_url: str) -> dict[str, dict[str, Any]]:
    """Every one of PROMPTS greedy on one socket (ids r0, r1, ...): generate_all's results."""
    return asyncio.run(generate_all(ws_url, _requests()))


def stream_prompts_to_all(ws_urls: Sequence[str]) -> list[dict[str, dict[str, Any]]]:
    """`stream_prompts` to every pipeline at once, their results in order."""

    async def run() -> list[dict[str, dict[str, Any]]]:
        return list(await asyncio.gather(*(generate_all(url, _requests()) for url in ws_urls)))

    return asyncio.run(run())


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


def test_every_other_family_streams_greedy_text_equal_to_generate(
    family_model_dir: Callable[[str], Path],
) -> None:
    """Llama, Qwen2, Mistral, Gemma 3, Phi-3, OLMo 2, Granite, SmolLM3, Cohere 2 and StarCoder2 (windows
    on every layer or alternating with full layers in a KV group of their own, partial rotary,
    multipliers, QK norms, biases: sluice/model/families.py), each in a pipeline of its own, all started
    at once."""
    model_dirs = {family: family_model_dir(family) for family in SHARED_RUN}
    pipelines: dict[str, Pipeline] = {}
    try:
        for family, model_dir in model_dirs.items():
            extra = ("--standby", "0", "--engine-threads", "1")
            pipelines[family] = launch_pipeline(model_dir, *extra, env=ENGINE_ENV)
        for family, pipeline in pipelines.items():
            ready = pipeline.ready.wait(STARTUP_DEADLINE_S) and pipeline.proc.poll() is None
            assert ready, f"{family}: sluice up did not become ready:\n{pipeline.output()}"
        results = stream_prompts_to_all([p.ws_url for p in pipelines.values()])
    finally:
        codes = {family: pipeline.stop() for family, pipeline in pipelines.items()}
    for family, pipeline in pipelines.items():
        assert codes[family] == 0, pipeline.output()
    for (family, model_dir), got in zip(model_dirs.items(), results, strict=True):
        assert_equals_generate(model_dir, family, got)
