"""MicroBatcher: jobs queued while a batch runs on the worker thread form the next batch."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common.batching import MicroBatcher


async def test_jobs_queued_during_a_batch_run_together() -> None:
    started, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def square_all(jobs: list[int]) -> list[int]:
        if not batches:
            started.set()
            release.wait(timeout=10)  # hold the first batch until the others are queued
        batches.append(list(jobs))
        return [j * j for j in jobs]

    batcher: MicroBatcher[int, int] = MicroBatcher(square_all, max_batch=4, name="test")
    try:
        first = batcher.submit(1)
        assert await asyncio.to_thread(started.wait, 10)
        rest = [batcher.submit(j) for j in range(2, 8)]
        release.set()
        assert await asyncio.gather(first, *rest) == [j * j for j in range(1, 8)]
        assert batches == [[1], [2, 3, 4, 5], [6, 7]]
        assert batcher.batches == 3
    finally:
        batcher.close()


async def test_an_exception_fails_its_batch_only() -> None:
    def fail_on_zero(jobs: list[int]) -> list[int]:
        if 0 in jobs:
            raise ValueError("zero")
        return jobs

    batcher: MicroBatcher[int, int] = MicroBatcher(fail_on_zero, max_batch=8, name="test")
    try:
        with pytest.raises(ValueError, match="zero"):
            await batcher.run(0)
        assert await batcher.run(5) == 5
    finally:
        batcher.close()
