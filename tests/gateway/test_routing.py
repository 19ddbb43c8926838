"""Engine routing: the three policies, the guard that keeps affinity from overloading one replica, the
engines' reports as the gateway mirrors them, and failover when an engine's stream breaks."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from gateway import routing
from gateway.events import Delta, Done, Event, Failed, GenerateInput, Generation
from gateway.pipeline import Pipeline
from gateway.routing import Picker, prompt_keys
from gateway.server import GatewayHandle, create_server
from gateway.settings import GatewaySettings
from services.common.block_keys import chain_hashes
from services.common.pb import common_pb2, engine_pb2
from tests.gateway.conftest import WAIT_S, gateway_settings, until
from tests.gateway.fakes import FakeUpstreams, encode, expected_text, start_upstreams
from tests.gateway.test_replicas import start_stage

A, B, C = "10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"
BLOCK = 4
SHARED = list(range(100, 164))  # 16 blocks of a shared context


def report(
    keys: list[bytes], *, snapshot: bool = True, removed: list[bytes] | None = None, waiting: int = 0
) -> engine_pb2.EngineReport:
    load = engine_pb2.EngineLoad(waiting=waiting, kv_blocks_total=1000, block_size=BLOCK)
    return engine_pb2.EngineReport(
        load=load, snapshot=snapshot, stored=keys, removed=removed or [], prefix_caching=True
    )


def router(
    policy: str, in_flight: Counter[str] | None = None, margin: int = 4, margin_ratio: float = 0.0
) -> Picker:
    counts = in_flight if in_flight is not None else Counter()
    return Picker(policy, counts.__getitem__, margin, margin_ratio)


# ----- policies


def test_round_robin_goes_in_turn_blind_to_load_and_cache() -> None:
    load: Counter[str] = Counter({A: 50})
    r = router("round_robin", load)
    r.on_report(A, report(prompt_keys(SHARED, BLOCK)))
    assert Counter(r.pick([A, B, C], SHARED) for _ in range(30)) == {A: 10, B: 10, C: 10}


def test_least_load_takes_the_least_loaded_and_spreads_ties() -> None:
    load: Counter[str] = Counter({A: 3})
    r = router("least_load", load)
    r.on_report(B, report([], waiting=2))  # another gateway's requests count too
    picks = [r.pick([A, B, C], SHARED) for _ in range(2)]
    assert picks == [C, C]
    for _ in range(30):
        load[r.pick([A, B, C], SHARED)] += 1
    totals = {a: max(load[a], 2 if a == B else 0) for a in (A, B, C)}
    assert max(totals.values()) - min(totals.values()) <= 1, totals


def test_prefix_affinity_prefers_the_replica_with_the_longest_cached_prefix() -> None:
    r = router("prefix_affinity")
    keys = prompt_keys(SHARED, BLOCK)
    r.on_report(A, report(keys[:4]))
    r.on_report(B, report(keys))
    r.on_report(C, report([]))
    prompt = [*SHARED, 7, 8, 9]
    assert {r.pick([A, B, C], prompt) for _ in range(6)} == {B}
    assert r.pick([A, C], prompt) == A


def test_prompt_keys_are_the_engines_own_lookup_keys() -> None:
    """The gateway hashes as the engine's scheduler looks up: full blocks, leaving one token to compute."""
    assert prompt_keys(SHARED, BLOCK) == chain_hashes(SHARED[:60], BLOCK, 0, None)
    assert len(prompt_keys([*SHARED, 1], BLOCK)) == 16


def test_reports_mirror_the_engine_cache_snapshot_then_changes() -> None:
    r = router("prefix_affinity")
    keys = prompt_keys(SHARED, BLOCK)
    r.on_report(A, report(keys))
    r.on_report(A, report([], snapshot=False, removed=keys[8:]))
    assert r.view(A).keys == set(keys[:8])
    r.on_report(A, report([b"x" * 32], snapshot=True))  # a new call: the snapshot replaces all
    assert r.view(A).keys == {b"x" * 32}
    r.forget(A)  # the call broke: nothing is known to hold
    assert not r.view(A).keys


def test_the_guard_spreads_a_shared_prefix_once_its_replica_is_loaded() -> None:
    """Every request shares one prefix that only A holds: A takes them while its load is within the
    margin of B's, then B gets its share; affinity never piles everything on A."""
    load: Counter[str] = Counter()
    r = router("prefix_affinity", load, margin=4)
    r.on_report(A, report(prompt_keys(SHARED, BLOCK)))
    r.on_report(B, report([]))
    picks = []
    for i in range(40):
        address = r.pick([A, B], [*SHARED, i])
        picks.append(address)
        load[address] += 1
    assert picks[:5] == [A] * 5
    assert load[B] >= 15 and load[A] - load[B] <= 5, load


def test_at_high_load_the_guard_allows_a_fraction_more_and_no_further() -> None:
    """With 100 requests on B, A holding the prefix may carry up to 125 (a quarter more) and win on it;
    past that B gets the request although it holds nothing."""
    load: Counter[str] = Counter({A: 125, B: 100})
    r = router("prefix_affinity", load, margin=4, margin_ratio=0.25)
    r.on_report(A, report(prompt_keys(SHARED, BLOCK)))
    r.on_report(B, report([]))
    assert r.pick([A, B], [*SHARED, 1]) == A
    load[A] = 126
    assert r.pick([A, B], [*SHARED, 2]) == B


@pytest.mark.parametrize(("load_a", "chosen"), [(4, A), (5, B)])
def test_at_low_load_the_absolute_margin_applies(load_a: int, chosen: str) -> None:
    r = router("prefix_affinity", Counter({A: load_a, B: 0}), margin=4, margin_ratio=0.25)
    r.on_report(A, report(prompt_keys(SHARED, BLOCK)))
    r.on_report(B, report([]))
    assert r.pick([A, B], [*SHARED, 1]) == chosen


def test_a_burst_sharing_a_new_prefix_goes_to_one_replica() -> None:
    """Before any engine reported the prefix, the gateway counts it as held where it sent it."""
    load: Counter[str] = Counter()
    r = router("prefix_affinity", load, margin=4)
    r.on_report(A, report([]))
    r.on_report(B, report([]))
    picks = Counter()
    for i in range(4):
        address = r.pick([A, B], [*SHARED, i])
        picks[address] += 1
        load[address] += 1
    assert len(picks) == 1


def test_routed_keys_count_as_held_only_until_they_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: now[0])
    r = router("prefix_affinity")
    r.on_report(A, report([]))
    r.on_report(B, report([]))
    keys = prompt_keys(SHARED, BLOCK)
    chosen = r.pick([A, B], SHARED)
    assert r.view(chosen).cached_blocks(keys, now[0]) == len(keys)
    assert r.pick([A, B], SHARED) == chosen
    now[0] += routing.PENDING_S + 1
    assert r.view(chosen).cached_blocks(keys, now[0]) == 0
    r.on_report(chosen, report(keys[:3], snapshot=False))  # reported: held for as long as reported
    assert r.view(chosen).cached_blocks(keys, now[0]) == 3


def test_settings_check_the_routing_policy() -> None:
    GatewaySettings(routing="least_load").validate()
    with pytest.raises(ValueError, match="routing must be one of"):
        GatewaySettings(routing="random").validate()
    with pytest.raises(ValueError, match="routing_margin"):
        GatewaySettings(routing_margin=-1).validate()
    with pytest.raises(ValueError, match="routing_margin_ratio"):
        GatewaySettings(routing_margin_ratio=float("nan")).validate()


# ----- through the gateway, with fake engines


@pytest.fixture
async def two() -> AsyncIterator[tuple[FakeUpstreams, FakeUpstreams]]:
    first, second = await start_upstreams(), await start_upstreams()
    yield first, second
    await first.stop()
    await second.stop()


async def start_gateway(first: FakeUpstreams, second: FakeUpstreams, **overrides: object) -> GatewayHandle:
    engines = (first.addresses["engine"], second.addresses["engine"])
    settings = replace(gateway_settings(first, engine=engines), **overrides)
    server = await create_server(settings)
    await server.start()
    await until(lambda: len(server.core._stages.engines.connected()) == 2)  # else all go to the first up
    return server


async def events(generation: Generation) -> list[Event]:
    async with asyncio.timeout(WAIT_S):
        return [event async for event in generation]


def generate(pipeline: Pipeline, prompt: str, max_tokens: int) -> Generation:
    stopping = common_pb2.StoppingParams(max_new_tokens=max_tokens)
    return pipeline.generate(GenerateInput(prompt=prompt, stopping=stopping))


async def test_a_prompt_sharing_a_long_prefix_goes_to_the_replica_that_reported_it(
    two: tuple[FakeUpstreams, FakeUpstreams],
) -> None:
    first, second = two
    for upstreams in two:  # a context that holds the prompts
        upstreams.tokenizer.context_length = upstreams.engine.max_model_len = 4096
    context = "You are a helpful assistant for the tenant acme. " * 4
    second.engine.report = report(prompt_keys(encode(context), BLOCK))
    first.engine.report = report([])
    server = await start_gateway(first, second)
    try:
        pipeline = server.core
        views = [pipeline._stages.engines.picker.view(u.addresses["engine"]) for u in two]
        async with asyncio.timeout(WAIT_S):
            while not all(v.reported for v in views):  # a request opens a report stream to each engine
                warm = await events(generate(pipeline, "x", 1))  # connected then
                assert isinstance(warm[-1], Done)
        before = len(second.engine.submits)
        results = [await events(generate(pipeline, context + f"question {i}?", 3)) for i in range(4)]
    finally:
        await server.stop(0.5)
    assert all(isinstance(r[-1], Done) for r in results)
    assert len(second.engine.submits) - before == 4


async def test_an_engine_that_breaks_before_the_first_token_has_its_requests_retried_elsewhere(
    two: tuple[FakeUpstreams, FakeUpstreams],
) -> None:
    """Requests queued on an engine whose stream breaks complete on the other replica, once each."""
    first, second = two
    for fakes in two:
        fakes.engine.paused = True
        fakes.engine.step_s = 0.02
    server = await start_gateway(first, second, routing="least_load")
    try:
        generations = [generate(server.core, f"prompt {i}", 3) for i in range(4)]
        await until(lambda: len(first.engine.submits) == 2 and len(second.engine.submits) == 2)
        second.engine.paused = False
        first.engine.kill_streams()
        results = [await events(g) for g in generations]
    finally:
        await server.stop(0.5)
    for result in results:
        assert result[-1] == Done("length", len(encode("prompt 0")), 3), result
        assert "".join(e.text for e in result if isinstance(e, Delta)) == expected_text(3)
    assert len(first.engine.submits) == 2 and len(second.engine.submits) == 4
    assert {s.request_id for s in first.engine.submits} < {s.request_id for s in second.engine.submits}


async def test_an_engine_that_breaks_after_the_first_token_fails_its_requests_unavailable(
    two: tuple[FakeUpstreams, FakeUpstreams],
) -> None:
    first, second = two
    for fakes in two:
        fakes.engine.step_s = 0.02
    server = await start_gateway(first, second, routing="round_robin")
    try:
        generations = [generate(server.core, "hi", 10_000) for _ in range(2)]
        firsts = [await asyncio.wait_for(g.next(), WAIT_S) for g in generations]
        assert all(isinstance(e, Delta) for e in firsts)
        assert len(first.engine.submits) == 1 and len(second.engine.submits) == 1
        broken = next(g for g in generations if g.id == first.engine.submits[0].request_id)
        other = next(g for g in generations if g is not broken)
        first.engine.kill_streams()
        broken_end = (await events(broken))[-1]
        other.cancel()
        other_end = (await events(other))[-1]
    finally:
        await server.stop(0.5)
    assert broken_end == Failed("unavailable", "engine unavailable")
    assert isinstance(other_end, Done) and other_end.finish_reason == "cancelled"
    assert len(first.engine.submits) == 1 and len(second.engine.submits) == 1  # no retry after a token


async def test_a_retry_that_breaks_too_ends_unavailable(two: tuple[FakeUpstreams, FakeUpstreams]) -> None:
    """One retry only: both replicas break before the first token, the request fails, nothing hangs."""
    first, second = two
    for fakes in two:
        fakes.engine.paused = True
        fakes.engine.step_s = 0.02
    server = await start_gateway(first, second, routing="round_robin")
    try:
        generation = generate(server.core, "hi", 3)
        await until(lambda: len(first.engine.submits) + len(second.engine.submits) == 1)
        (first if first.engine.submits else second).engine.kill_streams()
        await until(lambda: len(first.engine.submits) + len(second.engine.submits) == 2)
        first.engine.kill_streams()
        second.engine.kill_streams()
        result = await events(generation)
    finally:
        await server.stop(0.5)
    assert result == [Failed("unavailable", "engine unavailable")]


async def test_an_engine_that_stops_serving_before_the_first_token_has_the_request_retried(
    two: tuple[FakeUpstreams, FakeUpstreams],
) -> None:
    """An `unavailable` error final (the engine's loop failed) before any token: retried elsewhere."""
    first, second = two
    first.engine.error_next_submit = "unavailable: engine loop stopped: boom"
    server = await start_gateway(first, second, routing="round_robin")
    try:
        results = [await events(generate(server.core, "hi", 3)) for _ in range(2)]
    finally:
        await server.stop(0.5)
    assert [r[-1] for r in results] == [Done("length", len(encode("hi")), 3)] * 2
    on_first = {s.request_id for s in first.engine.submits}
    on_second = {s.request_id for s in second.engine.submits}
    assert len(first.engine.submits) + len(second.engine.submits) == 3
    assert len(on_first & on_second) == 1  # the refused one, once more on the other replica


async def test_a_killed_engine_leaves_the_rotation_and_gets_traffic_again_once_restarted(
    two: tuple[FakeUpstreams, FakeUpstreams],
) -> None:
    """Requests queued on an engine whose process dies complete on the other; while it is down no
    request goes to it; started again on its address, it gets requests again."""
    first, second = two
    for fakes in two:
        fakes.engine.paused = True
        fakes.engine.step_s = 0.02
    address = first.addresses["engine"]
    server = await start_gateway(first, second, routing="least_load")
    restarted = None
    try:
        queued = [generate(server.core, f"queued {i}", 3) for i in range(4)]
        await until(lambda: len(first.engine.submits) == 2 and len(second.engine.submits) == 2)
        second.engine.paused = False
        await first.stop("engine")
        ends = [(await events(g))[-1] for g in queued]
        assert all(isinstance(end, Done) for end in ends), ends
        await until(lambda: address not in server.core._stages.engines.connected())
        while_down = [await events(generate(server.core, "down", 2)) for _ in range(3)]
        assert all(isinstance(r[-1], Done) for r in while_down)
        assert len(first.engine.submits) == 2
        restarted = await start_stage("engine", address)
        await until(lambda: address in server.core._stages.engines.connected())
        after = [generate(server.core, f"after {i}", 2) for i in range(4)]
        results = await asyncio.gather(*(events(g) for g in after))
        assert all(isinstance(r[-1], Done) for r in results)
        served_after = len(second.engine.submits) - 2 - 2 - 3
    finally:
        await server.stop(0.5)
        if restarted is not None:
            await restarted.stop(0)
    assert served_after < 4  # the restarted replica took some of them
