"""The engine gRPC service against a tiny model: Generate, the multiplexed Stream, Stats, bad input."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.block_keys import chain_hashes
from services.common.errors import DEADLINE_EXCEEDED, INVALID_ARGUMENT, UNAVAILABLE, code_name
from services.common.grpc_server import CHANNEL_OPTIONS, wait_healthy
from services.common.pb import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.server import create_server
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_async_engine import fail_after_next_token
from tests.engine.test_model import reference

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
async def channel(llama_dir: Path) -> AsyncIterator[grpc.aio.Channel]:
    settings = EngineSettings(
        model=str(llama_dir),
        port=0,
        device=TEST_DEVICE,
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=64,
    )
    handle = await create_server(settings)
    await handle.start()
    address = f"127.0.0.1:{handle.port}"
    await wait_healthy(address, timeout_s=10)
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        yield channel
    await handle.stop(None)


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(channel)


def expected(llama_dir: Path, prompt: list[int], n: int) -> list[int]:
    engine = LLMEngine(
        EngineSettings(
            model=str(llama_dir), device=TEST_DEVICE, dtype="float32", num_kv_blocks=16, max_model_len=256
        )
    )
    engine.add_request("x", prompt, SamplingParams(), StoppingParams(max_new_tokens=n))
    out: list[int] = []
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def gen_request(
    rid: str, prompt: list[int] = PROMPT, n: int = 6, **sampling: object
) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid,
        prompt_ids=prompt,
        sampling=common_pb2.SamplingParams(**sampling),
        stopping=common_pb2.StoppingParams(max_new_tokens=n),
    )


async def wait_idle(stub: engine_pb2_grpc.EngineStub) -> engine_pb2.StatsResponse:
    """Polls Stats until nothing runs or waits (aborts are applied by the engine loop)."""
    for _ in range(500):
        st = await stub.Stats(engine_pb2.StatsRequest())
        if st.running == 0 and st.waiting == 0 and st.free_blocks == st.num_blocks:
            return st
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {st}")


async def test_generate_streams_greedy_tokens(stub: engine_pb2_grpc.EngineStub, llama_dir: Path) -> None:
    tokens: list[int] = []
    finals = []
    async for msg in stub.Generate(gen_request("g1", n=6, logprobs=2)):
        if msg.HasField("chunk"):
            assert msg.chunk.request_id == "g1"
            assert len(msg.chunk.logprobs) == len(msg.chunk.token_ids)
            tokens += msg.chunk.token_ids
        else:
            finals.append(msg.final)
    assert tokens == expected(llama_dir, PROMPT, 6)
    assert len(finals) == 1
    assert finals[0].usage.prompt_tokens == len(PROMPT) and finals[0].usage.completion_tokens == len(tokens)
    assert finals[0].finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)


@pytest.mark.parametrize(
    "request_",
    [
        gen_request("e1", prompt=[]),
        gen_request("e2", prompt=[5, 10_000]),
        gen_request("e3", prompt=[5] * 512),
        gen_request("e4", logprobs=21),
        gen_request("e5", temperature=-1.0),
        gen_request("e6", top_k=-3),
        gen_request("", prompt=[5]),
    ],
)
async def test_generate_bad_input_is_invalid_argument(
    stub: engine_pb2_grpc.EngineStub, request_: engine_pb2.GenerateRequest
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(request_):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details()
    await wait_idle(stub)


CORRUPT = b"\xff\xff\xff\xff"  # not a protobuf of any type


async def test_a_corrupt_request_is_an_invalid_argument(
    channel: grpc.aio.Channel, stub: engine_pb2_grpc.EngineStub
) -> None:
    """Not UNKNOWN naming the parser's exception, as gRPC's own decoding answers."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in channel.unary_stream("/sluice.v1.Engine/Generate")(CORRUPT):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("malformed request: ")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary("/sluice.v1.Engine/Stats")(CORRUPT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await wait_idle(stub)


async def test_a_corrupt_message_on_the_stream_ends_it_with_an_invalid_argument(
    channel: grpc.aio.Channel, stub: engine_pb2_grpc.EngineStub
) -> None:
    """As after a half-close there, the requests submitted before it run to their end."""
    good = engine_pb2.EngineIn(submit=gen_request("g", n=4)).SerializeToString()
    finals: list[engine_pb2.RequestFinal] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for raw in channel.stream_stream("/sluice.v1.Engine/Stream")(iter([good, CORRUPT])):
            finals += [e.final for e in engine_pb2.EngineOut.FromString(raw).entries if e.HasField("final")]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in (err.value.details() or "")
    assert [(f.request_id, f.usage.completion_tokens) for f in finals] == [("g", 4)]
    await wait_idle(stub)


async def test_generate_cancel_aborts(stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate(gen_request("long", n=400))
    async for msg in call:
        assert msg.HasField("chunk")
        break
    call.cancel()
    await wait_idle(stub)


async def test_stream_multiplexes_requests(stub: engine_pb2_grpc.EngineStub, llama_dir: Path) -> None:
    prompts = {f"s{i}": [5 + i, 6, 7 + i, 8] for i in range(6)}
    queue: asyncio.Queue[engine_pb2.EngineIn | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[engine_pb2.EngineIn]:
        while (msg := await queue.get()) is not None:
            yield msg

    steps_before = (await stub.Stats(engine_pb2.StatsRequest())).steps
    call = stub.Stream(requests())
    # "long" stays in flight until aborted, so the duplicate below always meets it in flight.
    await queue.put(engine_pb2.EngineIn(submit=gen_request("long", n=0)))
    for rid, prompt in prompts.items():
        await queue.put(engine_pb2.EngineIn(submit=gen_request(rid, prompt=prompt, n=5)))
    await queue.put(engine_pb2.EngineIn(submit=gen_request("long", prompt=[5], n=3)))  # duplicate in flight
    await queue.put(engine_pb2.EngineIn(submit=gen_request("bad", prompt=[])))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finals: dict[str, list[engine_pb2.RequestFinal]] = {}
    messages = 0
    async for out in call:
        messages += bool(out.entries)  # load and cache reports come besides, at most every 50 ms
        for entry in out.entries:
            if entry.HasField("chunk"):
                tokens.setdefault(entry.chunk.request_id, []).extend(entry.chunk.token_ids)
            else:
                finals.setdefault(entry.final.request_id, []).append(entry.final)
        done = all(rid in finals for rid in (*prompts, "bad")) and "long" in finals
        if done and "aborted" not in finals:
            finals["aborted"] = []
            await queue.put(engine_pb2.EngineIn(abort=engine_pb2.Abort(request_id="long")))
        if len(finals.get("long", [])) == 2:
            break
    await queue.put(None)
    steps = (await stub.Stats(engine_pb2.StatsRequest())).steps - steps_before
    for rid, prompt in prompts.items():
        assert tokens[rid] == expected(llama_dir, prompt, 5)
        assert [f.finish_reason for f in finals[rid]] == [common_pb2.FINISH_REASON_LENGTH]
    duplicate, aborted = finals["long"]
    assert duplicate.finish_reason == common_pb2.FINISH_REASON_ERROR and "in flight" in duplicate.error
    assert aborted.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert finals["bad"][0].finish_reason == common_pb2.FINISH_REASON_ERROR and finals["bad"][0].error
    # One message per engine step for all of this caller's requests, not per token; besides the steps
    # that ran the model: the two refusals and the abort's final.
    assert messages <= steps + 3
    assert messages < sum(len(t) for t in tokens.values())


async def test_stream_abort_and_stream_end_abort(stub: engine_pb2_grpc.EngineStub) -> None:
    queue: asyncio.Queue[engine_pb2.EngineIn | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[engine_pb2.EngineIn]:
        while (msg := await queue.get()) is not None:
            yield msg

    call = stub.Stream(requests())
    await queue.put(engine_pb2.EngineIn(submit=gen_request("a", n=400)))
    await queue.put(engine_pb2.EngineIn(submit=gen_request("b", n=400)))
    got_final = None
    async for out in call:
        for entry in out.entries:
            if entry.HasField("chunk") and entry.chunk.request_id == "a":
                await queue.put(engine_pb2.EngineIn(abort=engine_pb2.Abort(request_id="a")))
                await queue.put(engine_pb2.EngineIn(abort=engine_pb2.Abort(request_id="a")))  # idempotent
            if entry.HasField("final"):
                got_final = entry.final
        if got_final is not None:
            break
    assert got_final.request_id == "a" and got_final.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    st = await stub.Stats(engine_pb2.StatsRequest())
    assert st.running + st.waiting == 1  # b goes on
    call.cancel()  # the caller goes away: b is aborted
    st = await wait_idle(stub)
    assert st.steps > 0 and st.block_size == 16 and st.max_model_len > 0 and st.model


async def test_stream_half_close_finishes_requests(stub: engine_pb2_grpc.EngineStub) -> None:
    async def requests() -> AsyncIterator[engine_pb2.EngineIn]:
        yield engine_pb2.EngineIn(submit=gen_request("h", n=4))

    finals = [e.final async for out in stub.Stream(requests()) for e in out.entries if e.HasField("final")]
    assert [f.request_id for f in finals] == ["h"]
    assert finals[0].usage.completion_tokens >= 1


async def test_concurrent_generate_calls(stub: engine_pb2_grpc.EngineStub, llama_dir: Path) -> None:
    prompts = [[5 + i, 9, 11 + 2 * i] for i in range(12)]

    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        async for msg in stub.Generate(gen_request(f"c{i}", prompt=prompts[i], n=5)):
            if msg.HasField("chunk"):
                tokens += msg.chunk.token_ids
        return tokens

    got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == expected(llama_dir, prompt, 5)
    await wait_idle(stub)


async def test_stream_request_past_its_timeout_ends_with_an_error(stub: engine_pb2_grpc.EngineStub) -> None:
    request = gen_request("slow", n=0)
    request.timeout_ms = 200
    replies = stub.Stream(iter([engine_pb2.EngineIn(submit=request)]))
    final = None
    async for out in replies:
        finals = [e.final for e in out.entries if e.HasField("final")]
        if finals:
            final = finals[0]
            break
    replies.cancel()
    assert final is not None and final.request_id == "slow"
    assert final.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert final.error == "deadline exceeded" and final.error_code == common_pb2.ERROR_CODE_DEADLINE_EXCEEDED
    assert code_name(final.error_code) == DEADLINE_EXCEEDED
    assert 0 < final.usage.completion_tokens < 100_000
    stats = await wait_idle(stub)
    assert stats.free_blocks == stats.num_blocks


async def test_stream_prompt_at_the_context_length_is_an_invalid_argument(
    stub: engine_pb2_grpc.EngineStub,
) -> None:
    max_model_len = (await stub.Stats(engine_pb2.StatsRequest())).max_model_len
    request = gen_request("long", prompt=[5] * max_model_len)
    replies = stub.Stream(iter([engine_pb2.EngineIn(submit=request)]))
    finals = [e.final async for out in replies for e in out.entries if e.HasField("final")]
    assert [f.request_id for f in finals] == ["long"]
    assert finals[0].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert code_name(finals[0].error_code) == INVALID_ARGUMENT
    assert "context length" in finals[0].error


async def test_the_engine_owns_the_context_limit(stub: engine_pb2_grpc.EngineStub) -> None:
    """Wire max_new_tokens 0 is the rest of the context; a max_new_tokens past the context ends at the
    context, finish reason length."""
    max_model_len = (await stub.Stats(engine_pb2.StatsRequest())).max_model_len
    prompt = [5] * (max_model_len - 3)
    rest = gen_request("rest", prompt=prompt, n=0)
    over = gen_request("over", prompt=prompt, n=4)
    replies = stub.Stream(iter([engine_pb2.EngineIn(submit=rest), engine_pb2.EngineIn(submit=over)]))
    finals = {
        e.final.request_id: e.final async for out in replies for e in out.entries if e.HasField("final")
    }
    assert finals["rest"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert finals["rest"].usage.completion_tokens == 3
    assert finals["over"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert finals["over"].usage.completion_tokens == 3


async def test_a_dead_engine_loop_fails_callers_and_health(llama_dir: Path) -> None:
    """A step that raises, then failing its requests that raises too, with no recovery allowed
    (loop_recoveries 0): the loop cannot go on. Callers get `unavailable` finals at once (no hang) and
    the service reports NOT_SERVING for good."""
    settings = EngineSettings(
        model=str(llama_dir), port=0, device=TEST_DEVICE, dtype="float32", loop_recoveries=0
    )
    handle = await create_server(settings)
    await handle.start()
    engine, address = handle.core, f"127.0.0.1:{handle.port}"
    await wait_healthy(address, timeout_s=10)

    def broken(*args: object) -> None:
        raise RuntimeError("broken engine")

    engine.engine.step = broken  # type: ignore[method-assign]
    engine.engine.fail_all = broken  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            replies = stub.Stream(iter([engine_pb2.EngineIn(submit=gen_request("a"))]))
            finals = await asyncio.wait_for(_finals(replies), 30)
            assert [f.request_id for f in finals] == ["a"]
            assert code_name(finals[0].error_code) == UNAVAILABLE and "broken engine" in finals[0].error
            health_stub = health_pb2_grpc.HealthStub(channel)
            status = health_pb2.HealthCheckResponse.SERVING
            for _ in range(500):
                status = (await health_stub.Check(health_pb2.HealthCheckRequest())).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.01)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            await handle.health.set_serving(True)  # a failed service stays NOT_SERVING
            status = (await health_stub.Check(health_pb2.HealthCheckRequest())).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await handle.stop(None)


async def _finals(replies: AsyncIterator[engine_pb2.EngineOut]) -> list[engine_pb2.RequestFinal]:
    return [e.final async for out in replies for e in out.entries if e.HasField("final")]


async def _health(channel: grpc.aio.Channel) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status


async def _until_health(channel: grpc.aio.Channel, status: int) -> int:
    """Polls the service's health until it says `status`; returns the last answer."""
    for _ in range(1000):
        if (now := await _health(channel)) == status:
            break
        await asyncio.sleep(0.01)
    return now


class StreamCall:
    """One Stream call fed from a queue: `send` a submit, `until_final` reads to a request's final
    (keeping the tokens and reports it saw)."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self.queue: asyncio.Queue[engine_pb2.EngineIn | None] = asyncio.Queue()
        self.call = stub.Stream(self._requests())
        self.tokens: dict[str, list[int]] = {}
        self.reports: list[engine_pb2.EngineReport] = []

    async def _requests(self) -> AsyncIterator[engine_pb2.EngineIn]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def send(self, request: engine_pb2.GenerateRequest) -> None:
        await self.queue.put(engine_pb2.EngineIn(submit=request))

    async def until_final(self, request_id: str) -> engine_pb2.RequestFinal:
        async with asyncio.timeout(60):
            while True:
                for entry in (await self._read()).entries:
                    if entry.HasField("final") and entry.final.request_id == request_id:
                        return entry.final

    async def until(self, condition: Callable[[], bool]) -> None:
        """Reads until `condition()` holds."""
        async with asyncio.timeout(60):
            while not condition():
                await self._read()

    def cached(self) -> set[bytes]:
        """The keys the reports so far say the engine holds, as the gateway mirrors them."""
        keys: set[bytes] = set()
        for report in self.reports:
            if report.snapshot:
                keys.clear()
            keys.difference_update(report.removed)
            keys.update(report.stored)
        return keys

    def snapshots(self) -> int:
        return sum(report.snapshot for report in self.reports)

    async def _read(self) -> engine_pb2.EngineOut:
        out = await self.call.read()
        if out.HasField("report"):
            self.reports.append(out.report)
        for entry in out.entries:
            if entry.HasField("chunk"):
                self.tokens.setdefault(entry.chunk.request_id, []).extend(entry.chunk.token_ids)
        return out

    async def close(self) -> None:
        await self.queue.put(None)
        self.call.cancel()


def fail_once_released(engine: AsyncEngine) -> threading.Event:
    """Holds the loop before its first step after a request's first token until the returned event is
    set, then fails the loop (the fault hook) after that step: the request is still in flight, and the
    test has read the reports of its prefill meanwhile."""
    core, release = engine.engine, threading.Event()
    real_step = core.step
    state = {"prefilled": False, "failed": False}

    def step() -> list[RequestOutput]:
        if state["prefilled"]:
            release.wait(60)
        outputs = real_step()
        if state["prefilled"] and not state["failed"]:
            state["failed"] = True
            engine.inject_fault()
        state["prefilled"] |= any(o.new_token_ids for o in outputs)
        return outputs

    core.step = step  # type: ignore[method-assign]
    return release


async def test_a_failed_loop_recovers_in_process(llama_dir: Path) -> None:
    """The fault hook's loop failure within the budget: the request in flight ends `unavailable`, the
    service says NOT_SERVING while the engine is rebuilt and SERVING after, the call's reports then say
    the cache is empty (a new snapshot: the gateway's mirror forgets the prompt's blocks), the free list
    is full again, the recovery is counted, and a new request on the same call completes with exactly
    greedy `generate`'s tokens."""
    settings = EngineSettings(
        model=str(llama_dir), port=0, device=TEST_DEVICE, dtype="float32", num_kv_blocks=64
    )
    handle = await create_server(settings)
    await handle.start()
    engine, address = handle.core, f"127.0.0.1:{handle.port}"
    rebuild = threading.Event()
    real_reset = engine.engine.reset

    def held_reset() -> None:  # the rebuild waits until the test has seen NOT_SERVING
        rebuild.wait(60)
        real_reset()

    engine.engine.reset = held_reset  # type: ignore[method-assign]
    release = fail_once_released(engine)
    prompt = list(range(5, 45))
    prompt_keys = set(chain_hashes(prompt[:32], 16, 0, None))  # its two full blocks
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stream = StreamCall(engine_pb2_grpc.EngineStub(channel))
            await stream.send(gen_request("long", prompt=prompt, n=200))
            await stream.until(lambda: prompt_keys <= stream.cached())
            release.set()
            final = await stream.until_final("long")
            assert code_name(final.error_code) == UNAVAILABLE and "injected fault" in final.error
            assert await _until_health(channel, not_serving) == not_serving
            rebuild.set()
            assert await _until_health(channel, serving) == serving
            stats = await engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest())
            assert stats.free_blocks == stats.num_blocks and stats.running == stats.waiting == 0
            await stream.send(gen_request("after", prompt=PROMPT, n=12))
            final = await stream.until_final("after")
            assert final.finish_reason != common_pb2.FINISH_REASON_ERROR, final.error
            await stream.until(lambda: stream.snapshots() == 2)  # the call's, then the rebuild's
            assert not prompt_keys & stream.cached()
            await stream.close()
    finally:
        await handle.stop(None)
    assert stream.tokens["after"] == reference(llama_dir, [(0, PROMPT, 12)])["0"]
    assert handle.metrics.registry.get_sample_value("sluice_engine_loop_recoveries_total") == 1.0


async def test_a_loop_failing_past_its_budget_stays_not_serving(llama_dir: Path) -> None:
    """loop_recoveries 1: the first failure recovers (SERVING again), the second leaves the service
    NOT_SERVING for good and later requests end `unavailable`."""
    settings = EngineSettings(
        model=str(llama_dir), port=0, device=TEST_DEVICE, dtype="float32", loop_recoveries=1
    )
    handle = await create_server(settings)
    await handle.start()
    engine, address = handle.core, f"127.0.0.1:{handle.port}"
    arm = fail_after_next_token(engine)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stream = StreamCall(engine_pb2_grpc.EngineStub(channel))
            arm()
            await stream.send(gen_request("first", n=200))
            assert code_name((await stream.until_final("first")).error_code) == UNAVAILABLE
            for _ in range(1000):  # recovered: counted, and SERVING
                if handle.metrics.registry.get_sample_value("sluice_engine_loop_recoveries_total"):
                    break
                await asyncio.sleep(0.01)
            assert await _until_health(channel, serving) == serving
            arm()
            await stream.send(gen_request("second", n=200))
            assert code_name((await stream.until_final("second")).error_code) == UNAVAILABLE
            assert await _until_health(channel, not_serving) == not_serving
            assert engine.failure() is not None and "1 recoveries within 60s already" in engine.failure()
            await handle.health.set_serving(True)  # a failed service stays NOT_SERVING
            assert await _health(channel) == not_serving
            await stream.send(gen_request("late"))
            assert code_name((await stream.until_final("late")).error_code) == UNAVAILABLE
            await stream.close()
    finally:
        await handle.stop(None)
    assert handle.metrics.registry.get_sample_value("sluice_engine_loop_recoveries_total") == 1.0


async def test_a_step_that_always_fails_turns_the_service_not_serving(llama_dir: Path) -> None:
    """A runner that raises on every step (a sticky device error): the service leaves SERVING (the loop
    is rebuilt after max_step_failures failed steps in a row, then, past loop_recoveries, for good), and
    the requests end `unavailable` once the step is known to be broken, so that a gateway fails over."""
    settings = EngineSettings(
        model=str(llama_dir),
        port=0,
        device=TEST_DEVICE,
        dtype="float32",
        max_step_failures=2,
        loop_recoveries=1,
    )
    handle = await create_server(settings)
    await handle.start()
    engine, address = handle.core, f"127.0.0.1:{handle.port}"

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("CUDA error: out of memory")

    engine.engine.runner.execute = broken  # type: ignore[method-assign]
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    classes: list[str] = []
    try:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            stream = StreamCall(engine_pb2_grpc.EngineStub(channel))
            for n in range(1000):  # one request at a time until the engine is unavailable for good
                if engine.failure() is not None:
                    break
                await stream.send(gen_request(f"r{n}"))
                final = await stream.until_final(f"r{n}")
                classes.append(code_name(final.error_code))
            assert await _until_health(channel, not_serving) == not_serving
            await stream.close()
    finally:
        await handle.stop(None)
    assert classes[0] == "internal" and set(classes[1:]) == {UNAVAILABLE}, classes
    assert "engine steps failed in a row: CUDA error: out of memory" in (engine.failure() or "")
    assert handle.metrics.registry.get_sample_value("sluice_engine_loop_recoveries_total") == 1.0


async def test_stream_opens_with_a_cache_snapshot_then_reports_the_blocks_it_stores(
    stub: engine_pb2_grpc.EngineStub,
) -> None:
    queue: asyncio.Queue[engine_pb2.EngineIn | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[engine_pb2.EngineIn]:
        while (msg := await queue.get()) is not None:
            yield msg

    call = stub.Stream(requests())
    first = await asyncio.wait_for(call.read(), 10)
    assert first.report.snapshot and not first.entries
    assert (first.report.load.block_size, first.report.load.kv_blocks_total) == (16, 64)
    prompt = list(range(5, 45))  # 2 full blocks looked up
    await queue.put(engine_pb2.EngineIn(submit=gen_request("a", prompt=prompt, n=3)))
    keys = set(first.report.stored)
    wanted = set(chain_hashes(prompt[:32], 16, 0, None))
    async with asyncio.timeout(10):
        while not wanted <= keys:
            out = await call.read()
            keys = (keys - set(out.report.removed)) | set(out.report.stored)
    await queue.put(None)
    call.cancel()
