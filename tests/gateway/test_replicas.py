"""Replica choice: new work goes round the replicas in turn, or to the least loaded by a given measure."""

from __future__ import annotations

from collections import Counter

from gateway.upstream import Replicas

ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


async def test_pick_goes_round_every_replica() -> None:
    replicas = Replicas("tokenizer", ADDRESSES)
    try:
        picks = Counter(replicas.pick() for _ in range(30))
    finally:
        await replicas.close()
    assert picks == dict.fromkeys(ADDRESSES, 10)


async def test_pick_takes_the_least_loaded_and_spreads_ties() -> None:
    replicas = Replicas("engine", ADDRESSES)
    load = {"127.0.0.1:1": 5, "127.0.0.1:2": 0, "127.0.0.1:3": 0}
    try:
        first = [replicas.pick(load.__getitem__) for _ in range(4)]
        for _ in range(20):  # each pick adds one request where it went: the loads even out
            load[replicas.pick(load.__getitem__)] += 1
    finally:
        await replicas.close()
    assert "127.0.0.1:1" not in first and set(first) == {"127.0.0.1:2", "127.0.0.1:3"}
    assert max(load.values()) - min(load.values()) <= 1


async def test_one_replica_always_gets_the_work() -> None:
    replicas = Replicas("detokenizer", ADDRESSES[:1])
    try:
        assert {replicas.pick() for _ in range(5)} == {ADDRESSES[0]}
        assert replicas.pick(lambda address: 7) == ADDRESSES[0]
    finally:
        await replicas.close()


async def test_the_gateway_spreads_requests_over_engine_replicas() -> None:
    """With two engines, concurrent generations go to both (each to the one with fewer in flight)."""
    from websockets.asyncio.client import connect

    from gateway.server import create_server
    from tests.gateway.conftest import collect, gateway_settings, send
    from tests.gateway.fakes import start_upstreams

    first, second = await start_upstreams(), await start_upstreams()
    for fakes in (first, second):
        fakes.engine.step_s = 0.02  # requests stay in flight while the others arrive
    engines = (first.addresses["engine"], second.addresses["engine"])
    server = await create_server(gateway_settings(first, engine=engines))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.http_port}/v1/ws") as client:
            ids = {f"g{i}" for i in range(8)}
            for frame_id in sorted(ids):
                await send(client, {"type": "generate", "id": frame_id, "prompt": "hello",
                                    "params": {"max_tokens": 12}})
            results = await collect(client, ids)
    finally:
        await server.shutdown(0.5)
        await first.stop()
        await second.stop()
    assert all(r["end"]["type"] == "done" for r in results.values())
    counts = [len(first.engine.submits), len(second.engine.submits)]
    assert sum(counts) == 8 and min(counts) >= 3, counts
