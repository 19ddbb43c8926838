"""Micro-batching of CPU work across concurrent asyncio calls.

Calls `submit` jobs from the event loop; a worker hands every job queued meanwhile (at most
`max_batch`) to one call of `fn(jobs) -> results` on a worker thread, so the event loop never runs the
CPU work and concurrent calls share one batched call (e.g. one `encode_batch`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")


class MicroBatcher(Generic[J, R]):
    """Batches jobs for `fn`, which must return one result per job, in order.

    Jobs queued while a batch runs form the next batch; no timer adds latency. A drain task exists
    only while jobs are queued or running. An exception from `fn` fails every job of its batch.
    """

    def __init__(self, fn: Callable[[list[J]], list[R]], *, max_batch: int, name: str) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._fn = fn
        self._max_batch = max_batch
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: list[tuple[J, asyncio.Future[R]]] = []
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self.batches = 0  # batches run so far (for tests and benchmarks)

    def submit(self, job: J) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((job, future))
        if not self._draining:
            self._draining = True
            self._drain_task = loop.create_task(self._drain())
        return future

    async def run(self, job: J) -> R:
        return await self.submit(job)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                jobs = [job for job, _ in batch]
                try:
                    results = await loop.run_in_executor(self._executor, self._fn, jobs)
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                self.batches += 1
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._draining = False

    def close(self) -> None:
        """Stops the worker thread once the batch in flight (if any) is done."""
        self._executor.shutdown(wait=False, cancel_futures=True)
