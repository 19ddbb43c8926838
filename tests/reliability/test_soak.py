"""Soak: rounds of 500 concurrent streams through the gateway (half over WebSockets, 10 streams a
socket, half as SSE, a connection each), greedy with `ignore_eos` so every stream has the same length,
for SLUICE_SOAK_S seconds of driving (60 in the suite; `make soak` runs 600).

Every stream's text equals the non-streamed completion of the same request and carries exactly
MAX_TOKENS tokens (nothing lost, duplicated or reordered). After the first round (the warm-up) and after
the last, with nothing in flight (the engine runs and waits for nothing, the gateway counts no request),
each service's resident memory, open descriptors and threads are read: memory stays within RSS_MARGIN of
the warm-up figure, descriptors and threads come back to it (within FD_MARGIN, THREAD_MARGIN), so
nothing grows per request: no request state, task or connection is left behind. Run with -s for the
summary (streams, tokens, memory before and after).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.reliability.conftest import SERVICES, WAIT_S, RealStack, sse_texts

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

SOAK_S = float(os.environ.get("SLUICE_SOAK_S", "60"))  # seconds of driving, the warm-up round included
STREAMS = 500
PER_SOCKET = 10  # WebSocket streams on one socket (under the gateway's per-connection cap)
MAX_TOKENS = 8
PARAMS = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
PHRASES = ("Once upon a time", "the river", "a small red fox", "under the bridge", "in the old house")
PROMPTS = tuple(f"{' '.join(PHRASES[: k % 5 + 1])} {k}" for k in range(32))  # 32 prompts, 1 to 5 phrases
ROUND_S = 600.0  # upper bound on one round; normally seconds
RSS_MARGIN = (1.15, 50 * 1024 * 1024)  # after the last round: at most +15% or +50 MiB, whichever is more
FD_MARGIN = 16
THREAD_MARGIN = 8  # pools may still grow a little after the warm-up; a leak would add one per request
SETTLE_S = 60.0  # descriptors of closed client connections are released within this


@dataclass
class Round:
    """What one round saw: streams that matched their reference, tokens, and any mismatch."""

    streams: int = 0
    tokens: int = 0
    problems: list[str] = field(default_factory=list)

    def check(self, api: str, prompt: str, text: str, tokens: int, references: dict[str, str]) -> None:
        self.streams += 1
        self.tokens += tokens
        if text != references[prompt] or tokens != MAX_TOKENS:
            self.problems.append(f"{api} {prompt!r}: {text!r} ({tokens} tokens) != {references[prompt]!r}")


async def reference(http: httpx.AsyncClient, model: str, prompt: str) -> str:
    reply = await http.post("/v1/completions", json={"model": model, "prompt": prompt, **PARAMS})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return reply.json()["choices"][0]["text"]


async def ws_socket(stack: RealStack, prompts: list[str], result: Round, references: dict[str, str]) -> None:
    """Streams `prompts` at once on one socket."""
    async with connect(stack.ws_url, open_timeout=WAIT_S, max_queue=None) as ws:
        for j, prompt in enumerate(prompts):
            await ws.send(json.dumps({"type": "generate", "id": str(j), "prompt": prompt, "params": PARAMS}))
        texts = [""] * len(prompts)
        pending = set(range(len(prompts)))
        while pending:
            frame = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            j = int(frame["id"])
            if frame["type"] == "delta":
                texts[j] += frame["text"]
                continue
            assert frame["type"] == "done" and frame["finish_reason"] == "length", frame
            pending.discard(j)
            result.check("ws", prompts[j], texts[j], frame["usage"]["completion_tokens"], references)


async def sse_stream(
    http: httpx.AsyncClient, model: str, prompt: str, result: Round, references: dict[str, str]
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
        **PARAMS,
    }
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        text, events = sse_texts([line async for line in reply.aiter_lines()])
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2:]
    result.check("sse", prompt, text, events[-1]["usage"]["completion_tokens"], references)


async def one_round(stack: RealStack, references: dict[str, str], round_no: int) -> Round:
    """STREAMS streams at once, half over WebSockets, half as SSE, prompts in turn."""
    result = Round()
    prompts = [PROMPTS[(round_no + k) % len(PROMPTS)] for k in range(STREAMS)]
    ws_prompts, sse_prompts = prompts[: STREAMS // 2], prompts[STREAMS // 2 :]
    limits = httpx.Limits(max_connections=len(sse_prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=WAIT_S, limits=limits) as http:
        work = [ws_socket(stack, ws_prompts[k : k + PER_SOCKET], result, references)
                for k in range(0, len(ws_prompts), PER_SOCKET)]  # fmt: skip
        work += [sse_stream(http, stack.model, prompt, result, references) for prompt in sse_prompts]
        await asyncio.wait_for(asyncio.gather(*work), ROUND_S)
    assert result.streams == STREAMS
    return result


async def settled(stack: RealStack, baseline: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each service's figures once its descriptors are back within FD_MARGIN of `baseline` (or the
    last figures after SETTLE_S)."""
    await stack.wait_quiet()
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = stack.resources()
        back = all(now[s]["fds"] <= baseline[s]["fds"] + FD_MARGIN for s in SERVICES)
        if back or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@pytest.mark.timeout(SOAK_S + 600)
async def test_soak_streams_are_exact_and_nothing_grows(real_stack: RealStack) -> None:
    await real_stack.wait_quiet()
    async with httpx.AsyncClient(base_url=real_stack.http_url, timeout=WAIT_S) as http:
        references = {prompt: await reference(http, real_stack.model, prompt) for prompt in PROMPTS}
    began = time.monotonic()
    warm_up = await one_round(real_stack, references, 0)
    assert not warm_up.problems, warm_up.problems[:5]
    await real_stack.wait_quiet()
    baseline = real_stack.resources()
    rounds, streams, tokens, problems = 1, warm_up.streams, warm_up.tokens, []
    last_round_s = time.monotonic() - began
    # Another round while it fits in SOAK_S; one after the warm-up at least.
    while rounds < 2 or time.monotonic() - began + last_round_s <= SOAK_S:
        start = time.monotonic()
        result = await one_round(real_stack, references, rounds)
        last_round_s = time.monotonic() - start
        rounds, streams, tokens = rounds + 1, streams + result.streams, tokens + result.tokens
        problems += result.problems
    driven_s = time.monotonic() - began
    after = await settled(real_stack, baseline)
    print(f"\nsoak: {rounds} rounds of {STREAMS} concurrent streams in {driven_s:.1f}s: {streams} streams, "
          f"{tokens} tokens, {len(problems)} mismatches")  # fmt: skip
    for s in SERVICES:
        b, a = baseline[s], after[s]
        print(f"  {s:12} RSS {mib(b['rss'])} -> {mib(a['rss'])}   fds {b['fds']} -> {a['fds']}   "
              f"threads {b['threads']} -> {a['threads']}")  # fmt: skip
    assert not problems, problems[:5]
    for s in SERVICES:
        allowed = max(baseline[s]["rss"] * RSS_MARGIN[0], baseline[s]["rss"] + RSS_MARGIN[1])
        assert after[s]["rss"] <= allowed, (
            f"{s} resident memory grew: {mib(baseline[s]['rss'])} -> {mib(after[s]['rss'])}"
        )
        assert after[s]["fds"] <= baseline[s]["fds"] + FD_MARGIN, (
            f"{s} descriptors: {baseline[s]} -> {after[s]}"
        )
        assert after[s]["threads"] <= baseline[s]["threads"] + THREAD_MARGIN, (
            f"{s} threads: {baseline[s]} -> {after[s]}"
        )
