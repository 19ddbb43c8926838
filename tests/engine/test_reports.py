"""Load and prefix-cache reports: the block manager's cache events, and report feeds that let a router
mirror an engine's cache exactly (a snapshot, then changes), on the fake model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from services.common.block_keys import chain_hashes
from services.common.metrics import EngineMetrics
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.block_manager import BlockManager
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.reports import EngineLoad, Report, ReportFeed, engine_load
from services.engine.observability import EngineObserver
from tests.engine.fakes import fake_engine

WAIT_S = 10.0


def test_block_manager_records_stores_and_evictions() -> None:
    bm = BlockManager(2, 4)
    bm.track_events = True
    hashes = chain_hashes(list(range(8)), 4, 0, None)
    blocks = bm.allocate(2)
    for block, key in zip(blocks, hashes, strict=True):
        bm.register(block, key)
    assert bm.take_events() == dict.fromkeys(hashes, True)
    assert bm.take_events() == {}
    bm.free_blocks(blocks)
    again = bm.allocate(1)  # reuses the least recently freed block: the tail, hashes[1]
    assert bm.take_events() == {hashes[1]: False}
    bm.register(again[0], hashes[1])  # the same content again: the key's latest change wins
    bm.free_blocks(again)
    bm.free_blocks(bm.allocate(2))
    assert bm.take_events() == dict.fromkeys(hashes, False)


def test_without_tracking_nothing_is_recorded() -> None:
    bm = BlockManager(2, 4)
    bm.register(bm.allocate(1)[0], chain_hashes([1, 2, 3, 4], 4, 0, None)[0])
    assert bm.take_events() == {}


@pytest.fixture
def small() -> Iterator[AsyncEngine]:
    core, _ = fake_engine(12, block_size=4, max_num_seqs=4)
    engine = AsyncEngine(core)
    engine.start()
    yield engine
    engine.stop()


class Mirror:
    """A router's copy of one engine's cache, from one feed."""

    def __init__(self, feed: ReportFeed) -> None:
        self.feed = feed
        self.keys: set[bytes] = set()
        self.reports: list[Report] = []

    async def take(self) -> Report:
        report = await asyncio.wait_for(self.feed.next(), WAIT_S)
        self.reports.append(report)
        if report.snapshot:
            self.keys = set(report.stored)
        assert not set(report.stored) & set(report.removed)
        self.keys -= set(report.removed)
        self.keys |= set(report.stored)
        return report

    async def until(self, wanted: set[bytes]) -> None:
        async with asyncio.timeout(WAIT_S):
            while self.keys != wanted:
                await self.take()


async def run(engine: AsyncEngine, prompts: list[list[int]]) -> None:
    caller = engine.open_caller()
    for i, prompt in enumerate(prompts):
        caller.submit(f"r{i}", prompt, SamplingParams(), StoppingParams(max_new_tokens=2))
    caller.close_input()
    async with asyncio.timeout(WAIT_S):
        while await caller.get():
            pass


async def test_a_feed_opens_with_a_snapshot_and_its_load(small: AsyncEngine) -> None:
    mirror = Mirror(small.open_feed())
    first = await mirror.take()
    assert first.snapshot and first.stored == []
    load = first.load
    assert (load.block_size, load.kv_blocks_total, load.kv_blocks_used, load.running) == (4, 12, 0, 0)
    prompt = list(range(20, 33))  # 13 tokens: 3 full blocks, all looked up (one token left to compute)
    await run(small, [prompt])
    await mirror.until(set(chain_hashes(prompt[:12], 4, 0, None)))
    # A feed opened later starts from a snapshot of what the first learned from changes.
    late = Mirror(small.open_feed())
    assert (await late.take()).snapshot
    assert late.keys == mirror.keys
    mirror.feed.close()
    late.feed.close()


async def test_snapshot_and_changes_mirror_the_cache_through_evictions(small: AsyncEngine) -> None:
    """Prompts that overflow the 12-block pool evict each other's blocks: the mirror follows exactly."""
    mirror = Mirror(small.open_feed())
    await mirror.take()
    prompts = [[t, *((t * i) % 64 for i in range(1, 17))] for t in range(1, 7)]  # 4 full blocks each
    for batch in (prompts[:3], prompts[3:], prompts[:2]):
        await run(small, batch)
        await mirror.until(set(small.engine.block_manager.cached))  # idle: safe to read here
    assert any(r.removed for r in mirror.reports), "no eviction happened"
    mirror.feed.close()


def test_the_load_counts_queued_prompt_tokens_until_computed() -> None:
    core, _ = fake_engine(12, block_size=4, max_num_batched_tokens=16)
    core.add_request("a", list(range(1, 40)), SamplingParams(), StoppingParams(max_new_tokens=2))
    load = engine_load(core)
    assert (load.waiting, load.running, load.queued_prompt_tokens) == (1, 0, 39)
    core.step()  # a chunk of 16 prompt tokens
    load = engine_load(core)
    assert (load.waiting, load.running, load.queued_prompt_tokens) == (0, 1, 23)
    assert load.kv_blocks_used == 4 and load.prefix_caching


def test_engines_export_the_gauges_inference_routers_read() -> None:
    """vLLM's names, as the Gateway API Inference Extension's endpoint picker scrapes them."""
    core, _ = fake_engine(12, block_size=4, max_num_seqs=1)
    metrics = EngineMetrics()
    core.observer = EngineObserver(metrics, stats=core.recorder, model_name="m")
    for rid in ("a", "b"):
        core.add_request(rid, [1, 2, 3, 4, 5], SamplingParams(), StoppingParams(max_new_tokens=3))
    core.step()

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("vllm:num_requests_running", model_name="m") == 1 == value("sluice_requests_running")
    assert value("vllm:num_requests_waiting", model_name="m") == 1 == value("sluice_requests_waiting")
    usage = value("sluice_kv_cache_usage_ratio")
    assert usage == pytest.approx(2 / 12)
    assert value("vllm:kv_cache_usage_perc", model_name="m") == usage
    assert value("vllm:gpu_cache_usage_perc", model_name="m") == usage
    info = value("vllm:cache_config_info", model_name="m", block_size="4", num_gpu_blocks="12")
    assert info == 1
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:num_requests_waiting{model_name="m"} 1.0' in text


async def test_changes_made_between_the_snapshot_and_its_hand_out_are_not_lost() -> None:
    """A store and an eviction published after the snapshot was taken, before the consumer read it,
    come in the next report: the mirror ends up exactly like the cache."""
    feed = ReportFeed(asyncio.get_running_loop())
    load = EngineLoad(0, 0, 1, 12, 0, 4, True)
    feed._start([b"a", b"b"], load)  # the loop thread's pass: the snapshot
    feed._publish({b"c": True, b"a": False}, load)  # the loop thread's next step, before the read
    mirror = Mirror(feed)
    assert (await mirror.take()).snapshot
    second = await mirror.take()
    assert (second.snapshot, second.stored, second.removed) == (False, [b"c"], [b"a"])
    assert mirror.keys == {b"b", b"c"}
