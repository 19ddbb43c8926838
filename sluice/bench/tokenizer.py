"""`sluice bench tokenizer`: the tokenizer service (a child process, C concurrent `Tokenize` clients) against
in-process `tokenizers` on the same texts (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from tokenizers import Tokenizer

from sluice.bench.common import add_flags, int_list
from sluice.bench.report import write_json
from sluice.bench.stack import process_cpu_s

HEADLINE_LENGTH, HEADLINE_CONCURRENCY = 1024, 64


# ---- shared with the detokenizer benchmark -------------------------------------------------------


@contextlib.contextmanager
def model_dir(model: str | None) -> Iterator[Path]:
    """`model`, or the embedded model's tokenizer files in a temporary directory."""
    if model:
        yield Path(model)
        return
    from sluice.model.tokenizer import save_tokenizer, train_tokenizer

    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        out = Path(tmp)
        save_tokenizer(train_tokenizer(), out, model_max_length=1 << 20)
        (out / "config.json").write_text(json.dumps({"max_position_embeddings": 1 << 20}))
        yield out


def corpus_ids(tokenizer: Tokenizer, min_tokens: int) -> list[int]:
    """Ids of real text (the embedded model's corpus), at least `min_tokens` of them."""
    from sluice.model.corpus import build_corpus

    ids: list[int] = []
    for text in build_corpus().all_text():
        ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        if len(ids) >= min_tokens:
            break
    while len(ids) < min_tokens:
        ids = ids + ids
    return ids


@dataclass(frozen=True)
class Service:
    address: str
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds used so far by the service's processes (all workers)."""
        return process_cpu_s(self.pid)


@contextlib.contextmanager
def service(name: str, model: Path, workers: int, extra: Sequence[str] = ()) -> Iterator[Service]:
    """Runs `sluice serve NAME` on a free port; yields it once healthy; stops it after."""
    from services.common.grpc_server import wait_healthy

    serve = ["serve", name, "--model", str(model), "--port", "0", "--workers", str(workers), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "sluice.cli", *serve]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:
            if found := re.search(r"listening on port (\d+)", line):
                port = int(found.group(1))
                break
        if port is None:
            raise RuntimeError(f"sluice serve {name} exited with status {proc.wait()}")
        address = f"127.0.0.1:{port}"
        asyncio.run(wait_healthy(address, timeout_s=60))
        yield Service(address, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def channels(address: str, count: int) -> list[grpc.aio.Channel]:
    """`count` channels with their own connections (so SO_REUSEPORT can spread them)."""
    from services.common.grpc_server import CHANNEL_OPTIONS

    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]


def timed(fn: Callable[[], int], seconds: float) -> tuple[float, float]:
    """(tokens/s, CPU µs per token of this process) of calling `fn` (which returns the tokens it
    handled) for about `seconds`."""
    fn()  # warm up
    tokens, start, cpu = 0, time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - start) < seconds:
        tokens += fn()
    return tokens / elapsed, (time.process_time() - cpu) * 1e6 / max(1, tokens)


def uvloop_run(coro: object) -> object:
    import uvloop

    return uvloop.run(coro)  # type: ignore[arg-type]


Measure = Callable[[Tokenizer, "Service", int, int], tuple[Any, str]]  # → the cell and its printed row


def run_cells(args: argparse.Namespace, name: str, measure: Measure) -> list[Any]:
    """Starts the `name` service on the model's tokenizer and calls `measure(tokenizer, service, length,
    concurrency)` for every cell of `--lengths` × `--concurrency`, printing each cell's row as it ends."""
    cells = []
    with model_dir(args.model) as path:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        with service(name, path, args.workers) as svc:
            for length in args.lengths:
                for concurrency in args.concurrency:
                    cell, row = measure(tokenizer, svc, length, concurrency)
                    cells.append(cell)
                    print(row, flush=True)
    return cells


# ---- the tokenizer benchmark ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    length: int  # tokens per input
    concurrency: int
    service_tokens_per_s: float
    service_requests_per_s: float
    service_cpu_us_per_token: float  # CPU time of the service processes per token (load-independent)
    inprocess_tokens_per_s: float  # encode / encode_batch (with offsets), the target's baseline
    inprocess_cpu_us_per_token: float
    inprocess_fast_tokens_per_s: float  # encode_batch_fast (ids only), what the service calls

    @property
    def cpu_ratio(self) -> float:
        """In-process CPU per token over the service's: the ratio on a machine with cores to spare."""
        return self.inprocess_cpu_us_per_token / self.service_cpu_us_per_token

    @property
    def ratio(self) -> float:
        return self.service_tokens_per_s / self.inprocess_tokens_per_s

    @property
    def ratio_fast(self) -> float:
        return self.service_tokens_per_s / self.inprocess_fast_tokens_per_s


def make_texts(tokenizer: Tokenizer, length: int, count: int) -> list[str]:
    """`count` different texts of about `length` tokens each, cut from the corpus."""
    ids = corpus_ids(tokenizer, length * 4 + count)
    step = max(1, (len(ids) - length) // count)
    return [tokenizer.decode(ids[i * step : i * step + length]) for i in range(count)]


def inprocess(
    tokenizer: Tokenizer, texts: list[str], concurrency: int, seconds: float, *, fast: bool
) -> tuple[float, float]:
    """Tokens/s of the same work in this process: `encode` per text at concurrency 1, else
    `encode_batch` (or `encode_batch_fast`, without offsets) of `concurrency` texts."""
    cursor = 0
    encode_batch = tokenizer.encode_batch_fast if fast else tokenizer.encode_batch

    def one() -> int:
        nonlocal cursor
        cursor = (cursor + 1) % len(texts)
        return len(tokenizer.encode(texts[cursor]).ids)

    def batch() -> int:
        nonlocal cursor
        chosen = [texts[(cursor + i) % len(texts)] for i in range(concurrency)]
        cursor = (cursor + concurrency) % len(texts)
        return sum(len(e.ids) for e in encode_batch(chosen))

    return timed(one if concurrency == 1 else batch, seconds)


async def through_service(
    svc: Service, texts: list[str], concurrency: int, seconds: float, connections: int
) -> tuple[float, float, float]:
    """(tokens/s, requests/s, service CPU µs per token) of `concurrency` clients calling Tokenize in
    a loop for `seconds`."""
    from services.common.pb import tokenizer_pb2, tokenizer_pb2_grpc

    chans = channels(svc.address, connections)
    stubs = [tokenizer_pb2_grpc.TokenizerStub(c) for c in chans]
    requests = [tokenizer_pb2.TokenizeRequest(text=t) for t in texts]
    tokens = calls = 0
    stop_at = 0.0

    async def client(k: int) -> None:
        nonlocal tokens, calls
        stub = stubs[k % len(stubs)]
        i = k
        while time.perf_counter() < stop_at:
            reply = await stub.Tokenize(requests[i % len(requests)])
            tokens += len(reply.ids)
            calls += 1
            i += concurrency

    try:
        stop_at = time.perf_counter() + min(0.5, seconds)  # warm up
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        tokens = calls = 0
        cpu = svc.cpu_s()
        start = time.perf_counter()
        stop_at = start + seconds
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
        cpu = svc.cpu_s() - cpu
    finally:
        for c in chans:
            await c.close()
    return tokens / elapsed, calls / elapsed, cpu * 1e6 / max(1, tokens)


def measure_cell(
    args: argparse.Namespace, tokenizer: Tokenizer, svc: Service, length: int, concurrency: int
) -> tuple[Cell, str]:
    texts = make_texts(tokenizer, length, max(args.concurrency) * 2)
    measured = through_service(svc, texts, concurrency, args.seconds, max(1, args.workers))
    tps, rps, cpu_us = uvloop_run(measured)  # type: ignore[misc]
    base, base_cpu = inprocess(tokenizer, texts, concurrency, args.seconds, fast=False)
    fast, _ = inprocess(tokenizer, texts, concurrency, args.seconds, fast=True)
    cell = Cell(length, concurrency, tps, rps, cpu_us, base, base_cpu, fast)
    row = (
        f"{length:>7} {concurrency:>5} {tps:>14,.0f} {rps:>8,.0f} {cpu_us:>9.2f} {base:>12,.0f} "
        f"{base_cpu:>9.2f} {fast:>12,.0f} {cell.ratio:>7.2f} {cell.ratio_fast:>7.2f} {cell.cpu_ratio:>7.2f}"
    )
    return cell, row


def parser(
    name: str = "tokenizer", lengths_help: str = "tokens per input, comma list"
) -> argparse.ArgumentParser:
    """The flags of `sluice bench tokenizer` (and, with its name, of `sluice bench detokenizer`)."""
    p = argparse.ArgumentParser(
        prog=f"sluice bench {name}", description=f"the {name} service against in-process tokenizers"
    )
    add_flags(p, "model", "json", model="model directory (default: the embedded tokenizer)")
    p.add_argument("--workers", type=int, default=1, help="service processes (SO_REUSEPORT)")
    p.add_argument("--concurrency", type=int_list, default=(1, 64, 256), help="comma list")
    p.add_argument("--lengths", type=int_list, default=(32, 1024), help=lengths_help)
    return p


def main(argv: list[str]) -> int:
    p = parser()
    p.add_argument("--seconds", type=float, default=2.0, help="measuring time per cell and side")
    args = p.parse_args(argv)
    print(f"tokenizer service ({args.workers} worker(s)) vs in-process tokenizers, {os.cpu_count()} CPUs")
    print(
        f"{'tokens':>7} {'conc':>5} {'service tok/s':>14} {'req/s':>8} {'cpu us/tok':>9} "
        f"{'batch tok/s':>12} {'cpu us/tok':>9} {'fast tok/s':>12} {'ratio':>7} {'r.fast':>7} {'r.cpu':>7}"
    )
    print(
        "(batch: in-process encode/encode_batch; fast: encode_batch_fast; cpu us/tok: CPU per token;\n"
        " ratio: service / batch tok/s; r.fast: service / fast; r.cpu: batch CPU / service CPU per token)"
    )
    cells = run_cells(args, "tokenizer", functools.partial(measure_cell, args))
    wanted = (HEADLINE_LENGTH, HEADLINE_CONCURRENCY)
    head = next((c for c in cells if (c.length, c.concurrency) == wanted), None)
    if head is not None:
        print(f"{HEADLINE_LENGTH} tokens x {HEADLINE_CONCURRENCY}: service / in-process encode_batch = "
              f"{head.ratio:.2f}; by CPU per token: {head.cpu_ratio:.2f}")  # fmt: skip
    rows = [
        {**asdict(c), "ratio": c.ratio, "ratio_fast": c.ratio_fast, "cpu_ratio": c.cpu_ratio} for c in cells
    ]
    target = {"length": HEADLINE_LENGTH, "concurrency": HEADLINE_CONCURRENCY, "ratio": head and head.ratio}
    doc = {"benchmark": "tokenizer", "workers": args.workers, "cpus": os.cpu_count(), "cells": rows}
    write_json(args.json, {**doc, "target": target}, announce=True)
    return 0
