"""Replicas: the port plan of `sluice up --tokenizers/--engines/--detokenizers N`, two real engines
sharing the generated tokens of a burst of concurrent requests, and a tokenizer's `--workers` each
getting work through the gateway's several connections."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import create_server
from gateway.settings import GatewaySettings
from services.common.settings import load_settings
from sluice.launcher import parse_args
from sluice.plan import busy_port, plan_children
from sluice.ports import free_port_run
from tests.e2e.conftest import start_pipeline
from tests.e2e.test_up import generate_all
from tests.gateway.conftest import gateway_settings, until
from tests.gateway.fakes import MODEL, start_upstreams
from tests.observability.processes import Service, scrape, start_service

REQUESTS = 48
PER_SOCKET = 12
GENERATED = "sluice_generation_tokens_total"
PROMPT_TOKENS = "sluice_prompt_tokens_total"
SHARED_CONTEXT = " ".join(["the old lighthouse keeper wrote every night about the sea and the ships"] * 6)
TOKENIZED = "sluice_tokenize_duration_seconds_count"
STARTUP_S = 120.0
RESTART_S = 60.0


def test_up_plans_every_replica_on_consecutive_ports_and_gives_the_gateway_each() -> None:
    args = parse_args(
        ["--grpc-base-port", "51000", "--metrics-base-port", "9300", "--engines", "2", "--detokenizers", "3"]
    )
    children = plan_children(args, "/m")
    ports = {c.name: c.grpc_port for c in children}
    assert ports == {
        "tokenizer": 51001,
        "engine-1": 51002,
        "engine-2": 51003,
        "detokenizer-1": 51004,
        "detokenizer-2": 51005,
        "detokenizer-3": 51006,
        "gateway": 51000,
    }
    flags = {c.name: c.flags for c in children}
    assert {c.name: c.kind for c in children}["engine-2"] == "engine"
    gateway = flags["gateway"]
    assert gateway[gateway.index("--engine") + 1] == "127.0.0.1:51002,127.0.0.1:51003"
    detokenizers = ",".join(f"127.0.0.1:{p}" for p in (51004, 51005, 51006))
    assert gateway[gateway.index("--detokenizer") + 1] == detokenizers
    metrics = [c.flags[c.flags.index("--metrics-port") + 1] for c in children if c.kind != "gateway"]
    assert metrics == [str(9300 + i) for i in range(6)]
    assert "--threads" in flags["engine-1"] and "--threads" in flags["engine-2"]
    parsed = load_settings(GatewaySettings, list(gateway), environ={})
    assert parsed.engine == ("127.0.0.1:51002", "127.0.0.1:51003")
    assert len(parsed.detokenizer) == 3 and parsed.tokenizer == ("127.0.0.1:51001",)
    with pytest.raises(SystemExit):
        parse_args(["--engines", "0"])


def _requests() -> list[dict[str, Any]]:
    """Mixed prompt and output lengths (4 to 40 tokens, EOS ignored so every length is exact)."""
    prompts = ("Hi", "Once upon a time", "The quick brown fox jumps over the lazy dog and then")
    return [
        {
            "type": "generate",
            "id": f"m{i}",
            "prompt": prompts[i % 3],
            "params": {"max_tokens": 4 + 12 * (i % 4), "temperature": 0, "ignore_eos": True},
        }
        for i in range(REQUESTS)
    ]


def _prompt_tokens(metrics_base: int) -> list[float]:
    return [scrape(f"http://127.0.0.1:{metrics_base + i}/metrics").get(PROMPT_TOKENS, 0.0) for i in (1, 2)]


def _sharing_a_context_one_at_a_time(url: str, count: int) -> None:
    """Requests whose prompts share a long context, each sent once the one before has ended (so the
    replicas' loads stay level and only the cached prefix decides)."""
    for i in range(count):
        request = {"type": "generate", "id": f"s{i}", "prompt": f"{SHARED_CONTEXT} question {i}",
                   "params": {"max_tokens": 2, "temperature": 0}}  # fmt: skip
        result = asyncio.run(generate_all(url, [request]))[f"s{i}"]
        assert result["done"] is not None, result


async def _generate_concurrently(url: str, requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """All at once, over sockets of PER_SOCKET requests (the gateway's per-socket cap is 16)."""
    chunks = [requests[i : i + PER_SOCKET] for i in range(0, len(requests), PER_SOCKET)]
    results: dict[str, dict[str, Any]] = {}
    for part in await asyncio.gather(*(generate_all(url, chunk) for chunk in chunks)):
        results.update(part)
    return results


@pytest.mark.e2e
def test_two_engines_each_serve_a_fair_share_of_the_tokens(tiny_model_dir: Path) -> None:
    """`sluice up --engines 2`, 48 concurrent requests of mixed lengths: each engine's own metrics
    count 35-65% of the generated tokens. Then requests sharing a long context all go to one engine
    (prefix_affinity, the default, with the load level). Then engine-2 is killed: the launcher
    restarts it alone."""
    metrics_base = free_port_run(4)  # tokenizer, engine-1, engine-2, detokenizer
    running = start_pipeline(tiny_model_dir, "--engines", "2", "--metrics-base-port", str(metrics_base))
    try:
        assert {"engine-1", "engine-2"} <= running.pids().keys()
        results = asyncio.run(_generate_concurrently(running.ws_url, _requests()))
        served = [scrape(f"http://127.0.0.1:{metrics_base + i}/metrics").get(GENERATED, 0.0) for i in (1, 2)]
        before_shared = _prompt_tokens(metrics_base)
        _sharing_a_context_one_at_a_time(running.ws_url, 6)
        shared = [after - was for after, was in zip(_prompt_tokens(metrics_base), before_shared, strict=True)]
        before = running.pids()
        os.kill(before["engine-2"], signal.SIGKILL)  # a replica is restarted on its own
        running.wait_for_start("engine-2", before["engine-2"], RESTART_S)
        assert "engine-2 exited with code -9 (SIGKILL); restarting it" in running.output()
        assert {k: v for k, v in running.pids().items() if k != "engine-2"} == {
            k: v for k, v in before.items() if k != "engine-2"
        }
    finally:
        code = running.stop()
    assert code == 0, running.output()
    completion = sum(r["done"]["usage"]["completion_tokens"] for r in results.values())
    assert completion == sum(r["params"]["max_tokens"] for r in _requests())
    assert sum(served) == completion, served
    for tokens in served:
        assert 0.35 <= tokens / completion <= 0.65, served
    assert sorted(shared)[0] == 0 and sorted(shared)[1] > 0, shared  # every shared-context prompt on one


def _listening(service: Service, count: int) -> bool:
    return sum("listening on port" in line for line in service.lines) >= count


@pytest.mark.e2e
async def test_a_tokenizer_with_two_workers_gets_work_on_both_through_the_gateway(
    tiny_model_dir: Path,
) -> None:
    """A real tokenizer process with `--workers 2` (SO_REUSEPORT) behind a gateway that opens 16
    connections to it: once all 16 are up, a batch of requests; each worker's own /metrics counts
    Tokenize calls. (All 16 connections landing on one worker: odds 2 in 65,536. Sent before they
    are all up, the requests share the first few, which may well be on one worker.)"""
    metrics = free_port_run(2)  # worker i serves /metrics on metrics + i
    tokenizer = start_service(
        "tokenizer", tiny_model_dir, os.environ, "--workers", "2", "--metrics-port", str(metrics)
    )
    fakes = await start_upstreams()
    server = None
    try:
        await until(lambda: _listening(tokenizer, 2), STARTUP_S, 0.05)  # both workers accept first
        address = f"127.0.0.1:{tokenizer.port}"
        settings = gateway_settings(
            fakes, tokenizer=(address,), channels_per_replica=16, served_model_name=MODEL
        )
        server = await create_server(settings)
        await server.start()
        tokenizers = server.core._stages.tokenizers  # type: ignore[attr-defined]
        # every connection open, not only the first few up
        await until(lambda: len(tokenizers.connected()) >= 16, STARTUP_S, 0.05)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as http:
            replies = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(32)))
        served = [scrape(f"http://127.0.0.1:{metrics + i}/metrics").get(TOKENIZED, 0.0) for i in range(2)]
    finally:
        if server is not None:
            await server.stop(0.5)
        await fakes.stop()
        assert tokenizer.stop() == 0, tokenizer.output()
    assert [r.status_code for r in replies] == [200] * 32
    assert sum(served) >= 32 and min(served) > 0, served


def test_a_busy_planned_port_is_named_before_anything_starts() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        free = free_port_run(1)
        assert busy_port("127.0.0.1", [free, taken]) == taken
    assert busy_port("127.0.0.1", [free]) is None
