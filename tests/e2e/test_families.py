"""Every dense model family of sluice/model/families.py (the MoE ones are in test_moe.py) through the
whole pipeline: each streams the same greedy text as transformers' `generate` decoded, with a pool and
a step budget small enough that prompts are chunked, share cached blocks and are preempted. One
`sluice up` serves the first family; its tokenizer and detokenizer serve every other one too (they share
the project's tokenizer), each other family adding only an engine (on one torch thread) and a gateway,
all started at once, so that the cost is about an engine start per family."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice.model.families import FAMILIES
from tests.e2e.conftest import (
    STARTUP_DEADLINE_S,
    Pipeline,
    free_ports,
    launch_pipeline,
    launch_service,
)
from tests.e2e.test_up import generate_all, greedy_requests, references

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


DENSE = tuple(FAMILIES)


def stream_prompts(ws_url: str) -> dict[str, dict[str, Any]]:
    """Every one of PROMPTS greedy on one socket (ids r0, r1, ...): generate_all's results."""
    return asyncio.run(generate_all(ws_url, greedy_requests(PROMPTS, MAX_TOKENS)))


def stream_prompts_to_all(ws_urls: Sequence[str]) -> list[dict[str, dict[str, Any]] | BaseException]:
    """`stream_prompts` to every pipeline at once: per URL in order, its results or what it raised."""

    async def run() -> list[dict[str, dict[str, Any]] | BaseException]:
        requests = greedy_requests(PROMPTS, MAX_TOKENS)
        return list(
            await asyncio.gather(*(generate_all(url, requests) for url in ws_urls), return_exceptions=True)
        )

    return asyncio.run(run())


NOTABLE = ("WARNING", "ERROR", "Traceback", "Error:")


def notable_output(name: str, service: Pipeline) -> str:
    """`service`'s warnings, errors and tracebacks (their lines and the 12 after each), then its last 20
    lines: what says why one of its requests failed, short enough to survive a truncated CI log."""
    lines = service.output().splitlines()
    starts = [i for i, line in enumerate(lines) if any(word in line for word in NOTABLE)]
    keep = sorted({j for i in starts for j in range(i, i + 13)})
    picked = [lines[j] for j in keep if j < len(lines)]
    return "\n".join([f"--- {name}: notable lines", *picked[-150:], f"--- {name}: last lines", *lines[-20:]])


def assert_equals_generate(model_dir: Path, family: str, got: dict[str, dict[str, Any]]) -> None:
    """Each prompt's streamed text and completion tokens equal transformers' `generate` decoded."""
    for i, (prompt, (text, _, completion_tokens)) in enumerate(
        zip(PROMPTS, references(model_dir, PROMPTS, MAX_TOKENS), strict=True)
    ):
        assert got[f"r{i}"]["text"] == text, (family, prompt)
        assert got[f"r{i}"]["done"]["usage"]["completion_tokens"] == completion_tokens


def wait_ready(url: str, service: Pipeline, deadline: float) -> None:
    """Polls the gateway's /readyz at `url` until 200 (every stage serving); fails the test with the
    output of `service` when it exits or `deadline` (time.monotonic()) passes first."""
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
            if response.status == 200:  # 503 (not ready) raises HTTPError, an OSError
                return
        if service.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the gateway at {url} did not become ready:\n{service.output()}")
        time.sleep(0.2)


def test_every_family_streams_greedy_text_equal_to_generate(
    family_model_dir: Callable[[str], Path],
) -> None:
    """Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite, SmolLM3, Cohere 2 and
    StarCoder2 (windows on every layer or alternating with full layers in a KV group of their own,
    soft-capping, QK norms, head_dim apart from hidden / heads, partial rotary, multipliers, biases).
    Llama runs in a whole `sluice up`; each other family gets an engine and a gateway of its own
    (`sluice serve`) in front of that pipeline's tokenizer and detokenizer, all started at once."""
    model_dirs = {family: family_model_dir(family) for family in DENSE}
    first, *others = DENSE
    front = launch_pipeline(model_dirs[first], "--engine-threads", "1", env=ENGINE_ENV)
    tokenizer, detokenizer = (f"127.0.0.1:{front.grpc_base_port + i}" for i in (1, 3))
    gateways: dict[str, tuple[str, Pipeline]] = {}
    engines: dict[str, Pipeline] = {}
    for family in others:
        http, base = free_ports(2)
        engine = f"127.0.0.1:{base + 1}"
        engines[family] = launch_service(
            "engine", "--model", str(model_dirs[family]), "--port", str(base + 1), "--threads", "1",
            env=ENGINE_ENV,
        )  # fmt: skip
        gateway = launch_service(
            "gateway", "--port", str(http), "--grpc-port", str(base), "--tokenizer", tokenizer,
            "--engine", engine, "--detokenizer", detokenizer,
        )  # fmt: skip
        gateways[family] = (f"http://127.0.0.1:{http}", gateway)
    services = [*engines.values(), *(gateway for _, gateway in gateways.values())]
    try:
        if not front.ready.wait(STARTUP_DEADLINE_S) or front.proc.poll() is not None:
            pytest.fail(f"sluice up did not become ready:\n{front.output()}")
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        for url, gateway in gateways.values():
            wait_ready(url, gateway, deadline)
        urls = [front.ws_url] + [url.replace("http://", "ws://") + "/v1/ws" for url, _ in gateways.values()]
        results = stream_prompts_to_all(urls)
        failed = {f: r for f, r in zip(DENSE, results, strict=True) if isinstance(r, BaseException)}
        if failed:  # which family failed how, and what its engine and gateway said
            logs = [notable_output("sluice up", front)] if first in failed else []
            for family in failed.keys() - {first}:
                logs += [notable_output(f"{family} engine", engines[family])]
                logs += [notable_output(f"{family} gateway", gateways[family][1])]
            pytest.fail("\n".join([*(f"{f}: {r!r}" for f, r in failed.items()), *logs]))
    finally:
        codes = [service.stop() for service in [*services, front]]
    assert codes == [0] * len(codes), "\n".join(s.output() for s in [*services, front])
    for (family, model_dir), got in zip(model_dirs.items(), results, strict=True):
        assert_equals_generate(model_dir, family, got)
