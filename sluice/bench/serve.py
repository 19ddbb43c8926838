"""`sluice bench serve`: an open-loop serving load generator against a running gateway (docs/benchmarks.md),
its OpenAI client (streaming completions or chat completions: it marks each chunk that carried text on the
request's `ChunkClock` and returns the answer's text and the server's usage; the run loop times, counts
and handles errors), and the figures of a run: records, summary, table, JSON. Latencies are over the
requests that succeeded; TPOT = (e2e - ttft) / (output tokens - 1) for requests of more than one token;
ITL pools every gap between chunks that carried text. Exit status 0 when some request completed, 1 when
every one failed or the server could not be reached, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from sluice.bench.common import add_flags, positive_float, positive_int, progress_bar, run_meta
from sluice.bench.report import PERCENTILES, format_summary, latency_series, write_result
from sluice.bench.serve_data import BenchRequest, jsonl_requests, shared_prefix_requests, synthetic_requests

CONNECT_TIMEOUT_S = 10.0
APIS = ("openai", "openai-chat")


class RequestFailed(Exception):
    """The server answered with an error, or the exchange broke off; the message says which."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Reply:
    """A completed answer: the server's usage (None when it sent none) and the generated text (chat: the
    message's content)."""

    usage: Usage | None
    text: str = ""


class ChunkClock:
    """Times the text-carrying chunks of one request from its send (`t0`, perf_counter seconds)."""

    __slots__ = ("chunks", "itl_s", "last", "t0", "ttft_s")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.ttft_s = 0.0
        self.itl_s: list[float] = []
        self.chunks = 0

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.chunks:
            self.itl_s.append(now - self.last)
        else:
            self.ttft_s = now - self.t0
        self.last = now
        self.chunks += 1


def _chunk_text(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """One chunk's (first) choice: its text (completions: `text`; chat: `delta.content`) and whether it
    carried any (chat: reasoning too)."""
    if not chat:
        return choice.get("text") or "", bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return delta.get("content") or "", bool(delta.get("content") or delta.get("reasoning_content"))


class OpenAIClient:
    """`POST {url}/completions` (or, with `chat`, `{url}/chat/completions` with the prompt as one user
    message) with `stream: true` and usage in the last chunk, over one aiohttp session whose connector
    never throttles (no connection limit), opened once per run and closed by the caller even when `open`
    failed. `model` None: the first of `GET {url}/models`. It samples at `temperature` and, with
    `ignore_eos`, asks for exactly each request's output length."""

    def __init__(
        self, url: str, model: str | None, ignore_eos: bool, temperature: float, *, chat: bool = False
    ) -> None:
        self._url, self._ignore_eos, self._temperature = url.rstrip("/"), ignore_eos, temperature
        self._model = model
        self._chat = chat
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Checks that the server answers and resolves the model; raises RequestFailed."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        if self._model is None:
            self._model = await self._first_model()

    async def _first_model(self) -> str:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
        try:
            async with self._session.get(f"{self._url}/models", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RequestFailed(f"GET {self._url}/models: HTTP {resp.status}: {await resp.text()}")
                models = (await resp.json())["data"]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"cannot reach {self._url}: {exc or type(exc).__name__}") from None
        if not models:
            raise RequestFailed(f"GET {self._url}/models: the server lists no model")
        return str(models[0]["id"])

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        body = {
            "model": self._model,
            "temperature": self._temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": request.output_len,
        }
        if self._ignore_eos:  # vLLM's extensions that make max_tokens the exact output length
            body.update(ignore_eos=True, min_tokens=request.output_len)
        if self._chat:
            return {**body, "messages": [{"role": "user", "content": request.prompt}]}
        return {**body, "prompt": request.prompt}

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Reply:
        """Streams one request to its end and returns its answer. Raises RequestFailed (or aiohttp's own
        exception) when the request did not complete."""
        assert self._session is not None
        endpoint = "chat/completions" if self._chat else "completions"
        async with self._session.post(f"{self._url}/{endpoint}", json=self._body(request)) as resp:
            if resp.status != 200:
                raise RequestFailed(f"HTTP {resp.status}: {_error_message(await resp.text())}")
            usage, finished, text = None, False, []
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue  # blank separators and keep-alive comments
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    finished = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RequestFailed(_error_message(payload))
                choices = chunk.get("choices")
                if choices:
                    piece, carried = _chunk_text(choices[0], self._chat)
                    text.append(piece)
                    if carried:
                        clock.chunk()
                    finished = finished or bool(choices[0].get("finish_reason"))
                if chunk.get("usage"):  # its own chunk (OpenAI, sluice) or the last choice's (some servers)
                    raw = chunk["usage"]
                    usage = Usage(int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0)))
        # Servers that close the stream after the finish reason, without [DONE], are served too.
        if not finished:
            raise RequestFailed("the stream ended before a finish reason or [DONE]")
        return Reply(usage, "".join(text))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(body: str | bytes) -> str:
    """The message of an OpenAI-style error body, or the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace") if isinstance(body, bytes) else body


DEFAULT_URL = "http://127.0.0.1:8000/v1"  # sluice up's
DEFAULT_NUM_REQUESTS = 64


@dataclass(frozen=True)
class ServeConfig:
    """How one run drives the server at `url` ("http://host:port/v1")."""

    api: str  # "openai" | "openai-chat"
    url: str
    model: str | None = None  # openai "model" field; None = first of GET /v1/models
    request_rate: float = math.inf  # requests/s, Poisson arrivals (inf = all at t=0)
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None
    num_warmup: int = 0  # requests sent (and awaited) before the measured run, not counted
    ignore_eos: bool = True  # fixed output lengths (ignore_eos + min_tokens = max_tokens)
    temperature: float = 0.0
    seed: int = 0  # arrival times
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 600.0
    progress: bool = True  # tqdm bar on stderr (requests done)


MAX_ERRORS = 5  # distinct error messages kept in the summary


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; `start` counts from the run's start (when the
    request was sent, after any concurrency limit let it go); `ttft_s` and `e2e_s` from `start`;
    `itl_s` are the gaps between consecutive chunks that carried text or tokens; `text` is the answer."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        return None if self.output_tokens < 2 else (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None for each when there are no values)."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    values = [float(ms.mean()), *(float(v) for v in np.percentile(ms, PERCENTILES))]
    return dict(zip(keys, values, strict=True))


def meets_slos(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a successful request stayed within every SLO given (a request of one token has no TPOT
    and meets any TPOT SLO)."""
    if not record.ok:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    tpot = record.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


@dataclass
class ServeResult:
    """One measured run: its settings, one record per request (in the workload's order), the time from
    the first send to the last answer, when it started (Unix time), and the load generator's own CPU
    seconds over the run (user + system, this process)."""

    config: ServeConfig
    records: list[RequestRecord]
    duration_s: float
    started_at: float
    client_cpu_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The run's figures as a JSON-ready dict (see the module docstring for the latencies)."""
        ok = [r for r in self.records if r.ok]
        duration = self.duration_s if self.duration_s > 0 else math.nan
        prompt_tokens = sum(r.prompt_tokens for r in ok)
        output_tokens = sum(r.output_tokens for r in ok)
        slo_ttft, slo_tpot = self.config.slo_ttft_ms, self.config.slo_tpot_ms
        goodput = None
        if slo_ttft is not None or slo_tpot is not None:
            goodput = sum(meets_slos(r, slo_ttft, slo_tpot) for r in ok) / duration
        errors = Counter(r.error for r in self.records if not r.ok)
        return {
            "completed": len(ok),
            "failed": len(self.records) - len(ok),
            "duration_s": self.duration_s,
            "total_input_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
            "request_throughput": len(ok) / duration,
            "output_throughput": output_tokens / duration,
            "total_token_throughput": (prompt_tokens + output_tokens) / duration,
            "mean_concurrency": sum(r.e2e_s for r in ok) / duration,
            **{key: latency_stats(values) for key, values in latency_series(self.records).items()},
            "goodput": goodput,
            "slo": {"ttft_ms": slo_ttft, "tpot_ms": slo_tpot},
            "client_cpu_s": self.client_cpu_s,
            "errors": [{"message": m, "count": n} for m, n in errors.most_common(MAX_ERRORS)],
        }


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """When each of `num` requests is sent, in seconds from the start: the first at 0, then gaps drawn
    from gamma(shape=burstiness, scale=1/(rate·burstiness)) (mean 1/rate). Shape (num,); all zeros when
    `rate` is inf."""
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1])))


async def _send_one(
    client: OpenAIClient,
    request: BenchRequest,
    record: RequestRecord,
    t0: float,
    limit: asyncio.Semaphore | None,
    timeout_s: float,
) -> None:
    """Sends one request once `limit` lets it go and fills `record`; never raises for a failed request."""
    async with limit if limit is not None else contextlib.nullcontext():
        clock = ChunkClock()
        record.start = clock.t0 - t0
        try:
            async with asyncio.timeout(timeout_s):
                reply = await client.send(request, clock)
        except TimeoutError:
            record.error = f"no complete answer within {timeout_s:g} s"
        except RequestFailed as exc:
            record.error = str(exc)
        except Exception as exc:  # the transport's own failures (connection reset, bad frame, ...)
            record.error = f"{type(exc).__name__}: {exc}"
        else:
            record.ok = True
            record.text, usage = reply.text, reply.usage
            record.output_tokens = usage.completion_tokens if usage is not None else clock.chunks
            record.prompt_tokens = usage.prompt_tokens if usage is not None else request.prompt_len
        record.e2e_s = time.perf_counter() - clock.t0
        record.ttft_s, record.itl_s = clock.ttft_s, clock.itl_s


async def _launch(
    client: OpenAIClient,
    config: ServeConfig,
    requests: Sequence[BenchRequest],
    records: list[RequestRecord],
    on_done: Callable[[], object],
) -> None:
    """Sends every request at its arrival time as its own task and waits for them all."""
    times = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    loop = asyncio.get_running_loop()
    tasks = []
    t0 = time.perf_counter()
    for request, record, at in zip(requests, records, times, strict=True):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(_send_one(client, request, record, t0, limit, config.request_timeout_s))
        task.add_done_callback(lambda _: on_done())
        tasks.append(task)
    await asyncio.gather(*tasks)


async def _warm_up(client: OpenAIClient, config: ServeConfig, requests: Sequence[BenchRequest]) -> None:
    """Sends the first `num_warmup` requests (cycling through the workload) at once and awaits them."""
    picked = [requests[i % len(requests)] for i in range(config.num_warmup)]
    at_once = dataclasses.replace(config, request_rate=math.inf)
    await _launch(client, at_once, picked, [RequestRecord() for _ in picked], lambda: None)


async def run_serve(config: ServeConfig, requests: Sequence[BenchRequest]) -> ServeResult:
    """Runs the workload against the server and returns one record per request, in order. Never
    raises for a failed request: it is counted as failed with its error text; when the server cannot
    be reached at all, every request fails with that reason."""
    if not requests:
        raise ValueError("the workload has no requests")
    chat = config.api == "openai-chat"
    client = OpenAIClient(config.url, config.model, config.ignore_eos, config.temperature, chat=chat)
    records = [RequestRecord() for _ in requests]
    try:
        await client.open()
    except RequestFailed as exc:
        await client.close()
        for record in records:
            record.error = str(exc)
        return ServeResult(config, records, 0.0, time.time())
    try:
        if config.num_warmup:
            await _warm_up(client, config, requests)
        bar = progress_bar(config.progress, len(requests), "requests", unit="req")
        started_at, cpu, start = time.time(), time.process_time(), time.perf_counter()
        with bar:
            await _launch(client, config, requests, records, bar.update)
        duration = time.perf_counter() - start
        client_cpu_s = time.process_time() - cpu
        return ServeResult(config, records, duration, started_at, client_cpu_s)
    finally:
        await client.close()


def _slo(text: str) -> dict[str, float]:
    """`ttft=500,tpot=50` (milliseconds) as {"ttft": 500.0, "tpot": 50.0}."""
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if name not in ("ttft", "tpot") or not number > 0:
            raise argparse.ArgumentTypeError(f"expected ttft=MS,tpot=MS with positive numbers, got {text!r}")
        slos[name] = number
    if not slos:
        raise argparse.ArgumentTypeError("expected at least one of ttft=MS, tpot=MS")
    return slos


N: dict[str, Any] = dict(type=positive_int, metavar="N")
FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (  # flag, its argparse keywords
    ("--api", dict(choices=APIS, default="openai", help="openai (completions) | openai-chat")),
    ("--url", dict(help="http://HOST:PORT/v1 (default: sluice up's)")),
    ("--model", dict(help="openai model name (default: the first of GET /v1/models)")),
    ("--num-requests", dict(**N, help=f"requests (default {DEFAULT_NUM_REQUESTS}; a .jsonl: its lines)")),
    ("--request-rate", dict(type=positive_float, default=math.inf, metavar="R", help="req/s (default inf)")),
    ("--burstiness", dict(type=positive_float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")),
    ("--max-concurrency", dict(**N, help="at most N requests in flight")),
    ("--num-warmup", dict(type=int, default=0, metavar="N", help="requests awaited before measuring")),
    ("--dataset", dict(default="synthetic", help="synthetic (default) | shared-prefix | FILE.jsonl")),
    ("--input-len", dict(**N, default=128, help="synthetic: mean prompt words (~tokens)")),
    ("--output-len", dict(**N, help="output tokens: synthetic mean (128), shared-prefix (64)")),
    ("--sigma", dict(type=float, default=0.5, help="synthetic: sigma of the log-normal lengths (0 = fixed)")),
    ("--prefix-len", dict(**N, default=512, help="shared-prefix: words of each context")),
    ("--num-prefixes", dict(**N, default=4, help="shared-prefix: tenants (contexts)")),
    ("--suffix-len", dict(**N, default=32, help="shared-prefix: words of a request's own")),
    ("--no-ignore-eos", dict(action="store_true", help="let requests stop at EOS (output lengths vary)")),
    ("--temperature", dict(type=float, default=0.0, help="sampling temperature (default 0: greedy)")),
    ("--slo", dict(type=_slo, metavar="ttft=MS,tpot=MS", help="SLOs for the goodput figure")),
    ("--timeout", dict(type=positive_float, default=600.0, metavar="S", help="per-request timeout (s)")),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    about = "Drive a running server (sluice's gateway or any OpenAI-compatible one) with a workload; report "
    parser = argparse.ArgumentParser(prog="sluice bench serve", description=about + "throughput and latency.")
    for flag, keywords in FLAGS:
        parser.add_argument(flag, **keywords)
    helps = {
        "json": "write the summary and every request here",
        "seed": "seed of the workload and the arrivals",
    }
    add_flags(parser, "json", "seed", "no-progress", **helps)
    return parser


def _check(args: argparse.Namespace) -> None:
    """Raises ValueError on option values the parser's types let through."""
    if args.num_warmup < 0 or args.sigma < 0 or args.temperature < 0:
        raise ValueError("--num-warmup, --sigma and --temperature must not be negative")


def load_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests the options describe. Raises ValueError (and OSError for an unreadable file)."""
    num = args.num_requests
    if args.dataset == "synthetic":
        lengths = {"input_len": args.input_len, "output_len": args.output_len or 128, "sigma": args.sigma}
        return synthetic_requests(num or DEFAULT_NUM_REQUESTS, args.seed, **lengths)
    if args.dataset == "shared-prefix":
        shape = {name: getattr(args, name) for name in ("num_prefixes", "prefix_len", "suffix_len")}
        return shared_prefix_requests(
            num or DEFAULT_NUM_REQUESTS, args.seed, output_len=args.output_len or 64, **shape
        )
    lines = jsonl_requests(Path(args.dataset))
    return [lines[i % len(lines)] for i in range(num or len(lines))]


def _config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the options: the fields of the same name as they are, the others derived."""
    same = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig) if f.name in vars(args)}
    slo = args.slo or {}
    return ServeConfig(
        **{**same, "url": args.url or DEFAULT_URL},
        ignore_eos=not args.no_ignore_eos,
        slo_ttft_ms=slo.get("ttft"),
        slo_tpot_ms=slo.get("tpot"),
        request_timeout_s=args.timeout,
        progress=not args.no_progress,
    )


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check(args)
        requests = load_workload(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    config = _config(args)
    import uvloop

    result = uvloop.run(run_serve(config, requests))
    return _report(args, argv, result)


def _report(args: argparse.Namespace, argv: list[str], result: ServeResult) -> int:
    """Prints the table, writes the JSON; returns the exit status."""
    summary = result.summary()
    if args.json is not None:
        write_result(args.json, result, run_meta(["serve", *argv]))
        print(f"wrote {args.json}")
    if summary["completed"] == 0:
        first = summary["errors"][0]["message"] if summary["errors"] else "no request completed"
        print(f"sluice bench serve: every request failed: {first}", file=sys.stderr)
        return 1
    print(format_summary(result))
    return 0
