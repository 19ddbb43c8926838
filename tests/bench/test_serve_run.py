"""The run loop and command line of `sluice bench serve` with a fake client: arrivals, the concurrency
limit, warm-up, every way a request can fail, and the exit statuses."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.bench import serve
from sluice.bench.serve import ChunkClock, Reply, RequestFailed, ServeConfig, Usage, arrival_times, run_serve
from sluice.bench.serve_data import BenchRequest


class FakeClient:
    """Answers by prompt: "fail" → RequestFailed, "crash" → a transport error, "hang" → never,
    "nousage" → chunks without usage; anything else → one chunk per output token and usage."""

    def __init__(self, *, reachable: bool = True) -> None:
        self.reachable = reachable
        self.sent: list[str] = []
        self.in_flight = 0
        self.peak = 0
        self.closed = False

    async def open(self) -> None:
        if not self.reachable:
            raise RequestFailed("cannot reach fake: refused")

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Reply:
        self.sent.append(request.prompt)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if request.prompt == "fail":
                raise RequestFailed("invalid_argument: refused")
            if request.prompt == "crash":
                raise ConnectionResetError("reset by peer")
            if request.prompt == "hang":
                await asyncio.Event().wait()
            for _ in range(request.output_len):
                await asyncio.sleep(0.001)
                clock.chunk()
            usage = None if request.prompt == "nousage" else Usage(7, request.output_len)
            return Reply(usage, "x" * request.output_len)
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    client = FakeClient()
    monkeypatch.setattr(serve, "OpenAIClient", lambda *args, **kwargs: client)
    return client


def _config(**overrides: Any) -> ServeConfig:
    return ServeConfig("openai", "http://unused/v1", progress=False, **overrides)


def test_arrival_gaps_have_mean_one_over_rate() -> None:
    for burstiness in (0.5, 1.0, 4.0):
        times = arrival_times(20_000, 10.0, burstiness, seed=3)
        assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
        assert np.diff(times).mean() == pytest.approx(0.1, rel=0.05)
    # Burstier arrivals (smaller shape) spread their gaps more: the coefficient of variation is 1/√shape.
    gaps = np.diff(arrival_times(20_000, 10.0, 0.25, seed=3))
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)
    assert np.array_equal(arrival_times(50, 4.0, 1.0, 9), arrival_times(50, 4.0, 1.0, 9))
    assert np.array_equal(arrival_times(5, float("inf"), 1.0, 0), np.zeros(5))


async def test_every_outcome_is_recorded_and_nothing_raises(fake: FakeClient) -> None:
    requests = [
        BenchRequest("ok", 4, 3),
        BenchRequest("nousage", 5, 11),
        BenchRequest("fail", 4),
        BenchRequest("crash", 4),
        BenchRequest("hang", 4),
    ]
    result = await run_serve(_config(request_timeout_s=0.5), requests)
    ok, nousage, fail, crash, hang = result.records
    assert ok.ok and (ok.prompt_tokens, ok.output_tokens) == (7, 4)  # the server's usage
    assert nousage.ok and (nousage.prompt_tokens, nousage.output_tokens) == (11, 5)  # estimate, chunk count
    assert len(ok.itl_s) == 3 and 0 < ok.ttft_s <= ok.e2e_s
    assert not fail.ok and fail.error == "invalid_argument: refused"
    assert not crash.ok and crash.error == "ConnectionResetError: reset by peer"
    assert not hang.ok and "no complete answer within 0.5 s" in hang.error
    assert result.summary()["completed"] == 2
    assert result.duration_s > 0 and result.client_cpu_s >= 0
    assert fake.closed


async def test_max_concurrency_holds_requests_back(fake: FakeClient) -> None:
    requests = [BenchRequest(f"r{i}", 3) for i in range(12)]
    result = await run_serve(_config(max_concurrency=3), requests)
    assert fake.peak == 3
    assert result.summary()["completed"] == 12
    # A held-back request's latencies count from when it was sent, not from the start.
    assert max(r.start for r in result.records) > 0


async def test_warmup_requests_are_sent_but_not_counted(fake: FakeClient) -> None:
    requests = [BenchRequest("a", 2), BenchRequest("b", 2)]
    result = await run_serve(_config(num_warmup=3), requests)
    assert fake.sent[:3] == ["a", "b", "a"]
    assert sorted(fake.sent[3:]) == ["a", "b"]
    assert len(result.records) == 2 and result.summary()["completed"] == 2


async def test_unreachable_server_fails_every_request_with_the_reason(fake: FakeClient) -> None:
    fake.reachable = False
    result = await run_serve(_config(num_warmup=2), [BenchRequest("a", 2)] * 3)
    assert [r.error for r in result.records] == ["cannot reach fake: refused"] * 3
    assert fake.sent == [] and fake.closed


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def test_dead_port_exits_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = serve.main(["--url", _dead_url(), "--num-requests", "2", "--no-progress", "--json", str(out)])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "every request failed: cannot reach" in err
    assert "Traceback" not in err
    assert json.loads(out.read_text())["summary"]["failed"] == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--request-rate", "0"],
        ["--api", "carrier-pigeon"],
        ["--api", "grpc"],
        ["--api", "ws"],
        ["--slo", "ttft=fast"],
        ["--slo", "e2e=10"],
        ["--num-requests", "0"],
        ["--max-concurrency", "0"],
        ["--dataset", "/nonexistent/file.jsonl"],
        ["--structured", "regex"],
        ["--tools"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serve.main(argv)
    assert exited.value.code == 2


def test_bad_jsonl_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "x", "output_len": 2}\n{"prompt": "y"}\n')
    with pytest.raises(SystemExit):
        serve.main(["--dataset", str(path)])
    assert "line 2" in capsys.readouterr().err
