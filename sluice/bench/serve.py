"""`sluice bench serve`: an open-loop serving load generator against a running gateway (docs/benchmarks.md).
Exit status 0 when some request completed, 1 when every one failed or the server could not be reached, 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sluice.bench.common import add_count, add_flags, positive_float, progress_bar, run_meta
from sluice.bench.serve_clients import APIS, ChunkClock, Client, RequestFailed, make_client
from sluice.bench.serve_data import BenchRequest, jsonl_requests, shared_prefix_requests, synthetic_requests
from sluice.bench.serve_report import RequestRecord, ServeResult, format_summary, write_plots, write_result

DEFAULT_URLS = {
    "openai": "http://127.0.0.1:8000/v1",
    "ws": "ws://127.0.0.1:8000/v1/ws",
    "grpc": "127.0.0.1:50050",
}
DEFAULT_NUM_REQUESTS = 64


@dataclass(frozen=True)
class ServeConfig:
    """How one run drives the server. `url`: grpc "host:port"; ws "ws://host:port/v1/ws"; openai
    "http://host:port/v1"."""

    api: str  # "grpc" | "ws" | "openai"
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


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """When each of `num` requests is sent, in seconds from the start: the first at 0, then gaps drawn
    from gamma(shape=burstiness, scale=1/(rate·burstiness)) (mean 1/rate). Shape (num,); all zeros when
    `rate` is inf."""
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1])))


async def _send_one(
    client: Client,
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
                usage = await client.send(request, clock)
        except TimeoutError:
            record.error = f"no complete answer within {timeout_s:g} s"
        except RequestFailed as exc:
            record.error = str(exc)
        except Exception as exc:  # the transport's own failures (connection reset, bad frame, ...)
            record.error = f"{type(exc).__name__}: {exc}"
        else:
            record.ok = True
            record.output_tokens = usage.completion_tokens if usage is not None else clock.chunks
            record.prompt_tokens = usage.prompt_tokens if usage is not None else request.prompt_len
        record.e2e_s = time.perf_counter() - clock.t0
        record.ttft_s, record.itl_s = clock.ttft_s, clock.itl_s


async def _launch(
    client: Client,
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


async def _warm_up(client: Client, config: ServeConfig, requests: Sequence[BenchRequest]) -> None:
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
    options = {"model": config.model, "ignore_eos": config.ignore_eos, "temperature": config.temperature}
    client = make_client(config.api, config.url, **options)
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
        return ServeResult(config, records, duration, started_at, time.process_time() - cpu)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench serve",
        description="Drive a running sluice gateway (or any OpenAI-compatible server) with a workload and "
        "report throughput and latency percentiles.",
    )
    add = parser.add_argument
    add("--api", choices=APIS, default="openai", help="which API to drive (default openai)")
    about = "openai http://HOST:PORT/v1 | ws ws://HOST:PORT/v1/ws | grpc HOST:PORT"
    add("--url", default=None, help=f"{about} (default: `sluice up`'s ports on 127.0.0.1)")
    add("--model", default=None, help="openai model name (default: the first of GET /v1/models)")
    about = f"requests measured (default {DEFAULT_NUM_REQUESTS}; with a .jsonl dataset, its lines)"
    add_count(parser, "--num-requests", None, about)
    about = "requests/s (default inf: all at once)"
    add("--request-rate", type=positive_float, default=math.inf, metavar="R", help=about)
    about = "gamma shape of the arrival gaps (1 = Poisson)"
    add("--burstiness", type=positive_float, default=1.0, help=about)
    add_count(parser, "--max-concurrency", None, "at most N requests in flight")
    add_count(parser, "--num-warmup", 0, "requests sent and awaited before measuring", type=int)
    add("--dataset", default="synthetic", help="synthetic | shared-prefix | FILE.jsonl (default synthetic)")
    add_count(parser, "--input-len", 128, "synthetic: mean prompt words (~tokens)")
    about = "synthetic: mean output tokens (default 128); shared-prefix: output tokens (default 64)"
    add_count(parser, "--output-len", None, about)
    add("--sigma", type=float, default=0.5, help="synthetic: sigma of the log-normal lengths (0 = fixed)")
    add_count(parser, "--prefix-len", 512, "shared-prefix: words of each shared context")
    add_count(parser, "--num-prefixes", 4, "shared-prefix: tenants (shared contexts)")
    add_count(parser, "--suffix-len", 32, "shared-prefix: words of each request's own part")
    add("--no-ignore-eos", action="store_true", help="let requests stop at EOS (output lengths vary)")
    add("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    add("--slo", type=_slo, default=None, metavar="ttft=MS,tpot=MS", help="SLOs for the goodput figure")
    add("--timeout", type=positive_float, default=600.0, metavar="S", help="per-request timeout in seconds")
    helps = {
        "json": "write the summary and every request here",
        "plot": "write latency CDF and throughput PNGs into this folder",
        "seed": "seed of the workload and the arrival times",
    }
    add_flags(parser, "json", "plot", "seed", "no-progress", **helps)
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
    same = (
        "api",
        "model",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "num_warmup",
        "temperature",
        "seed",
    )
    slo = args.slo or {}
    return ServeConfig(
        **{name: getattr(args, name) for name in same},
        url=args.url or DEFAULT_URLS[args.api],
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
    """Prints the table, writes the JSON and the plots; returns the exit status."""
    summary = result.summary()
    if args.json is not None:
        write_result(args.json, result, run_meta(["serve", *argv]))
        print(f"wrote {args.json}")
    if summary["completed"] == 0:
        first = summary["errors"][0]["message"] if summary["errors"] else "no request completed"
        print(f"sluice bench serve: every request failed: {first}", file=sys.stderr)
        return 1
    print(format_summary(result))
    if args.plot is not None:
        write_plots(args.plot, result)
    return 0
