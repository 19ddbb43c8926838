"""`sluice bench detokenizer`: the detokenizer service (a child process; one multiplexed `Stream`, or
per-request `DetokenizeStream` calls) against in-process `tokenizers.decoders.DecodeStream`, every text
checked against the full decode (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from sluice.bench.report import write_json
from sluice.bench.tokenizer import Service, channels, corpus_ids, parser, run_cells, uvloop_run

HEADLINE_CONCURRENCY = 256
CONTEXT_IDS = 4
IN_FLIGHT = 4  # messages written ahead of the answers on the multiplexed stream


@dataclass(frozen=True)
class Cell:
    length: int  # generated ids per request
    concurrency: int
    mux_tokens_per_s: float
    per_request_tokens_per_s: float
    inprocess_tokens_per_s: float
    inprocess_cpu_us_per_token: float
    mux_cpu_us_per_token: float  # CPU time of the service processes per token (load-independent)
    per_request_cpu_us_per_token: float


def workload(tokenizer: Tokenizer, length: int, concurrency: int) -> list[list[int]]:
    """`concurrency` id sequences of `length + CONTEXT_IDS` ids each (context first), cut from text."""
    span = length + CONTEXT_IDS
    ids = corpus_ids(tokenizer, span * 2 + concurrency * 7)
    step = max(1, (len(ids) - span) // max(1, concurrency))
    return [ids[i * step : i * step + span] for i in range(concurrency)]


def check(tokenizer: Tokenizer, seqs: list[list[int]], texts: list[str], mode: str) -> None:
    for seq, text in zip(seqs, texts, strict=True):
        context = tokenizer.decode(seq[:CONTEXT_IDS], skip_special_tokens=False)
        want = tokenizer.decode(seq, skip_special_tokens=False)[len(context) :]
        if text != want:
            raise AssertionError(f"{mode}: streamed text differs from the full decode: {text!r} != {want!r}")


async def mux(address: str, seqs: list[list[int]]) -> tuple[float, list[str]]:
    """Tokens/s and texts through one multiplexed Stream call."""
    from services.common.pb import detokenizer_pb2 as pb
    from services.common.pb import detokenizer_pb2_grpc

    length = len(seqs[0]) - CONTEXT_IDS
    rids = [f"r{i}" for i in range(len(seqs))]
    starts = [
        pb.DetokenizeStart(request_id=f"r{i}", prompt_ids=seq[:CONTEXT_IDS]) for i, seq in enumerate(seqs)
    ]
    messages = [pb.DetokenizeIn(entries=[pb.DetokenizeInEntry(start=start) for start in starts])]
    for step in range(length):
        chunks = [
            pb.DetokenizeChunk(request_id=rid, token_ids=[seq[CONTEXT_IDS + step]])
            for rid, seq in zip(rids, seqs, strict=True)
        ]
        messages.append(pb.DetokenizeIn(entries=[pb.DetokenizeInEntry(chunk=c) for c in chunks]))
    closes = [pb.DetokenizeInEntry(close=pb.DetokenizeClose(request_id=rid)) for rid in rids]
    messages.append(pb.DetokenizeIn(entries=closes))
    texts = dict.fromkeys(rids, "")
    (chan,) = channels(address, 1)
    try:
        call = detokenizer_pb2_grpc.DetokenizerStub(chan).Stream()
        window = asyncio.Semaphore(IN_FLIGHT)

        async def write() -> None:
            for message in messages:
                await window.acquire()
                await call.write(message)
            await call.done_writing()

        start = time.perf_counter()
        writer = asyncio.create_task(write())
        outs = []
        for _ in messages:
            outs.append(await call.read())
            window.release()
        elapsed = time.perf_counter() - start
        await writer
    finally:
        await chan.close()
    for out in outs:  # read after the clock stops: the client's parsing is not the service's cost
        for entry in out.entries:
            if entry.WhichOneof("kind") == "delta":
                texts[entry.delta.request_id] += entry.delta.text
    return len(seqs) * length / elapsed, list(texts.values())


async def per_request(address: str, seqs: list[list[int]]) -> tuple[float, list[str]]:
    """Tokens/s and texts through one DetokenizeStream call per request, all concurrent."""
    from services.common.pb import detokenizer_pb2 as pb
    from services.common.pb import detokenizer_pb2_grpc

    chans = channels(address, 1)
    stub = detokenizer_pb2_grpc.DetokenizerStub(chans[0])

    async def one(rid: str, seq: list[int]) -> str:
        async def entries() -> AsyncIterator[pb.DetokenizeInEntry]:
            yield pb.DetokenizeInEntry(start=pb.DetokenizeStart(request_id=rid, prompt_ids=seq[:CONTEXT_IDS]))
            for token in seq[CONTEXT_IDS:]:
                yield pb.DetokenizeInEntry(chunk=pb.DetokenizeChunk(request_id=rid, token_ids=[token]))
            yield pb.DetokenizeInEntry(close=pb.DetokenizeClose(request_id=rid))

        call = stub.DetokenizeStream(entries())
        return "".join([e.delta.text async for e in call if e.WhichOneof("kind") == "delta"])

    try:
        start = time.perf_counter()
        texts = await asyncio.gather(*(one(f"r{i}", seq) for i, seq in enumerate(seqs)))
        elapsed = time.perf_counter() - start
    finally:
        await chans[0].close()
    return len(seqs) * (len(seqs[0]) - CONTEXT_IDS) / elapsed, list(texts)


def inprocess(tokenizer: Tokenizer, seqs: list[list[int]]) -> tuple[float, float]:
    """(tokens/s, CPU µs per token) of `DecodeStream.step` per id, round-robin over the requests like
    engine steps."""
    streams = [DecodeStream(skip_special_tokens=False) for _ in seqs]
    for stream, seq in zip(streams, seqs, strict=True):
        for token in seq[:CONTEXT_IDS]:
            stream.step(tokenizer, token)
    length = len(seqs[0]) - CONTEXT_IDS
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(CONTEXT_IDS, CONTEXT_IDS + length):
        for stream, seq in zip(streams, seqs, strict=True):
            stream.step(tokenizer, seq[step])
    tokens = len(seqs) * length
    return tokens / (time.perf_counter() - start), (time.process_time() - cpu) * 1e6 / tokens


def measure_cell(tokenizer: Tokenizer, svc: Service, length: int, concurrency: int) -> tuple[Cell, str]:
    """The cell's figures through the multiplexed stream, per-request streams and in-process, every text
    checked; the service's CPU per token over each of its two runs."""
    seqs = workload(tokenizer, length, concurrency)
    figures = []
    for mode, through in (("mux", mux), ("per-request", per_request)):
        cpu = svc.cpu_s()
        tps, texts = uvloop_run(through(svc.address, seqs))  # type: ignore[misc]
        figures.append((tps, (svc.cpu_s() - cpu) * 1e6 / (length * concurrency)))
        check(tokenizer, seqs, texts, mode)
    (mux_tps, mux_cpu), (req_tps, req_cpu) = figures
    base, base_cpu = inprocess(tokenizer, seqs)
    cell = Cell(length, concurrency, mux_tps, req_tps, base, base_cpu, mux_cpu, req_cpu)
    row = (
        f"{length:>7} {concurrency:>5} {mux_tps:>12,.0f} {mux_cpu:>8.2f} {req_tps:>16,.0f} {req_cpu:>8.2f} "
        f"{base:>16,.0f} {base_cpu:>8.2f} {mux_tps / base:>7.2f} {req_tps / base:>7.2f}"
    )
    return cell, row


def main(argv: list[str]) -> int:
    args = parser("detokenizer", "generated ids per request, comma list").parse_args(argv)
    print(f"detokenizer service ({args.workers} worker(s)) vs in-process DecodeStream, {os.cpu_count()} CPUs")
    print(
        f"{'tokens':>7} {'conc':>5} {'mux tok/s':>12} {'us/tok':>8} {'per-request tok/s':>16} "
        f"{'us/tok':>8} {'in-process tok/s':>16} {'us/tok':>8} {'mux/in':>7} {'req/in':>7}"
    )
    print("(us/tok: CPU microseconds per token, of the service processes or of this process)")
    cells = run_cells(args, "detokenizer", measure_cell)
    at_headline = [c for c in cells if c.concurrency == HEADLINE_CONCURRENCY]
    best = max(at_headline, key=lambda c: c.length, default=None)
    if best is not None:
        print(
            f"{HEADLINE_CONCURRENCY} requests x {best.length} ids on the multiplexed stream: "
            f"{best.mux_tokens_per_s:,.0f} tokens/s; "
            f"per-request streams: {best.per_request_tokens_per_s:,.0f} tokens/s; service CPU per token "
            f"{best.mux_cpu_us_per_token:.2f} us (= {1e6 / best.mux_cpu_us_per_token:,.0f} tokens per "
            f"CPU-second)"
        )
    target = {"concurrency": HEADLINE_CONCURRENCY, "length": best and best.length}
    target["mux_tokens_per_s"] = best and best.mux_tokens_per_s
    doc = {"benchmark": "detokenizer", "workers": args.workers, "cpus": os.cpu_count()}
    write_json(args.json, {**doc, "cells": [asdict(c) for c in cells], "target": target}, announce=True)
    return 0
