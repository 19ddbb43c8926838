"""The routing feed: the engine's load and prefix cache, reported to each consumer (a gateway's stream)
for prefix-aware routing, beside the step loop.

A `ReportFeed` opens with a snapshot of every cached block hash, taken on the loop thread between steps,
and then gets, after each step, the cache changes (`BlockManager.take_events`) and the new load, merged
until the consumer takes them: a consumer that applies the snapshot and then every report in order knows
the cache exactly. `Reports` is the loop thread's side: it opens feeds (`subscribe`), publishes after
each step (`publish`), and after a rebuild of the engine hands every feed an empty snapshot (`restart`:
a consumer mirroring the cache forgets every key). Feeds are used from one event loop; their `_start` and
`_publish` are called on the loop thread only.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.engine.core.engine import LLMEngine


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load after a step (all callers together)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    queued_prompt_tokens: int  # prompt tokens not yet computed, waiting and part-prefilled requests
    block_size: int
    prefix_caching: bool


@dataclass
class Report:
    """What a `ReportFeed` hands out: the load, and the cache changes since the previous report
    (`snapshot`: `stored` is the whole cache). A hash is in at most one of `stored` and `removed`."""

    load: EngineLoad
    snapshot: bool
    stored: list[bytes]
    removed: list[bytes]


def engine_load(engine: LLMEngine) -> EngineLoad:
    """The load of `engine` now (on its loop thread, between steps)."""
    scheduler, bm = engine.scheduler, engine.block_manager
    queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
    queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running)
    return EngineLoad(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
        kv_blocks_total=bm.num_blocks,
        queued_prompt_tokens=queued,
        block_size=bm.block_size,
        prefix_caching=bm.enable_prefix_caching,
    )


class ReportFeed:
    """Load and prefix-cache reports for one consumer (see the module docstring). Use `next()` from one
    event loop; `close()` detaches it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._snapshot: list[bytes] | None = None
        self._changes: dict[bytes, bool] = {}
        self._load: EngineLoad | None = None
        self._sent_load: EngineLoad | None = None
        self._event = asyncio.Event()
        self.closed = False

    async def next(self) -> Report:
        """Waits until the load or the cache changed since the previous report (the first report: the
        snapshot) and returns the change."""
        while True:
            self._event.clear()
            with self._lock:
                report = self._take()
            if report is not None:
                return report
            await self._event.wait()

    def close(self) -> None:
        self.closed = True

    def _take(self) -> Report | None:
        load = self._load
        if load is None:
            return None
        if self._snapshot is not None:
            # Changes published after the snapshot was taken stay queued for the next report.
            stored, self._snapshot = self._snapshot, None
            self._sent_load = load
            return Report(load, True, stored, [])
        if not self._changes and load == self._sent_load:
            return None
        changes, self._changes = self._changes, {}
        self._sent_load = load
        stored = [h for h, kept in changes.items() if kept]
        removed = [h for h, kept in changes.items() if not kept]
        return Report(load, False, stored, removed)

    # ---- called on the loop thread -------------------------------------------------------------

    def _start(self, cached: list[bytes], load: EngineLoad) -> None:
        with self._lock:
            self._snapshot, self._load = cached, load
            self._changes.clear()  # everything before the snapshot is in it
        self._wake()

    def _publish(self, changes: dict[bytes, bool], load: EngineLoad) -> None:
        with self._lock:
            if self._load is None:
                return
            self._changes.update(changes)
            self._load = load
        self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the consumer's event loop is gone
            self.closed = True


class Reports:
    """The open feeds of one engine, driven from its loop thread (see the module docstring)."""

    def __init__(self) -> None:
        self._feeds: list[ReportFeed] = []
        self._last_load: EngineLoad | None = None

    def subscribe(self, feed: ReportFeed, engine: LLMEngine) -> None:
        """Opens `feed` with the cache now (between steps: every change before now was published)."""
        feed._start(list(engine.block_manager.cached), engine_load(engine))
        self._feeds.append(feed)

    def publish(self, engine: LLMEngine) -> None:
        """Hands the step's cache changes and the load to every open feed."""
        changes = engine.block_manager.take_events()
        if not self._feeds:
            return
        load = engine_load(engine)
        if not changes and load == self._last_load:
            return
        self._last_load = load
        self._feeds = [feed for feed in self._feeds if not feed.closed]
        for feed in self._feeds:
            feed._publish(changes, load)

    def restart(self, engine: LLMEngine) -> None:
        """After the engine was rebuilt: every open feed gets an empty snapshot and the load."""
        self._last_load = None
        self._feeds = [feed for feed in self._feeds if not feed.closed]
        load = engine_load(engine)
        for feed in self._feeds:
            feed._start([], load)
