"""The public gRPC API `sluice.v1.Gateway.Generate`, health and reflection."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.server import GatewayHandle
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, wait_for
from tests.gateway.fakes import FakeUpstreams, encode, expected_text


@pytest.fixture
async def stub(gateway: GatewayHandle) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


async def read_all(
    call: grpc.aio.UnaryStreamCall,
) -> tuple[str, list[int], list[common_pb2.TokenLogprob], list[gateway_pb2.PublicGenerateResponse]]:
    text, ids, logprobs, finals = "", [], [], []
    async for response in call:
        if response.WhichOneof("kind") == "delta":
            text += response.delta.text
            ids.extend(response.delta.token_ids)
            logprobs.extend(response.delta.logprobs)
        else:
            finals.append(response)
    return text, ids, logprobs, finals


async def test_generate_a_prompt(stub: gateway_pb2_grpc.GatewayStub) -> None:
    request = gateway_pb2.PublicGenerateRequest(
        request_id="mine", prompt="Once", stopping=common_pb2.StoppingParams(max_new_tokens=9)
    )
    text, ids, _, finals = await read_all(stub.Generate(request, timeout=WAIT_S))
    assert text == expected_text(9)
    assert ids == []  # not asked for
    assert len(finals) == 1
    final = finals[0]
    assert final.request_id == "mine"
    assert final.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.final.usage.prompt_tokens == len(encode("Once"))
    assert final.final.usage.completion_tokens == 9


async def test_generate_chat_with_token_ids_and_logprobs(stub: gateway_pb2_grpc.GatewayStub) -> None:
    chat = common_pb2.Conversation(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    request = gateway_pb2.PublicGenerateRequest(
        chat=chat,
        sampling=common_pb2.SamplingParams(logprobs=1),
        stopping=common_pb2.StoppingParams(max_new_tokens=6),
        return_token_ids=True,
    )
    text, ids, logprobs, finals = await read_all(stub.Generate(request, timeout=WAIT_S))
    assert text == expected_text(6)
    assert ids == [ord(c) for c in expected_text(6)]
    assert len(logprobs) == 6
    assert finals[0].request_id  # assigned by the gateway
    assert finals[0].final.usage.prompt_tokens == len(encode("user: hi\nassistant: "))


async def test_stop_string_reports_the_stop(
    stub: gateway_pb2_grpc.GatewayStub, upstreams: FakeUpstreams
) -> None:
    request = gateway_pb2.PublicGenerateRequest(
        prompt="x",
        stopping=common_pb2.StoppingParams(
            max_new_tokens=1000, stop=["wor"], include_stop_str_in_output=True
        ),
        return_token_ids=True,
    )
    text, ids, _, finals = await read_all(stub.Generate(request, timeout=WAIT_S))
    assert text == "hello wor"
    assert finals[0].final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert finals[0].final.stop == "wor"
    assert finals[0].final.usage.completion_tokens == len("hello wor")
    assert len(ids) <= len("hello wor")
    await wait_for(upstreams.engine.aborted)


async def test_cancelling_the_call_aborts_the_engine(
    stub: gateway_pb2_grpc.GatewayStub, upstreams: FakeUpstreams, gateway: GatewayHandle
) -> None:
    request = gateway_pb2.PublicGenerateRequest(
        prompt="x", stopping=common_pb2.StoppingParams(max_new_tokens=10**6)
    )
    call = stub.Generate(request, timeout=WAIT_S)
    first = await call.read()
    assert first.WhichOneof("kind") == "delta"
    call.cancel()
    await wait_for(upstreams.engine.aborted)
    assert upstreams.engine.aborts == [upstreams.engine.submits[0].request_id]


@pytest.mark.parametrize(
    "request_",
    [
        gateway_pb2.PublicGenerateRequest(),
        gateway_pb2.PublicGenerateRequest(chat=common_pb2.Conversation()),
        gateway_pb2.PublicGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(temperature=-1)),
        gateway_pb2.PublicGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(logprobs=50)),
        gateway_pb2.PublicGenerateRequest(prompt="x", stopping=common_pb2.StoppingParams(stop=[""])),
        gateway_pb2.PublicGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(top_p=1.5)),
        gateway_pb2.PublicGenerateRequest(
            chat=common_pb2.Conversation(messages=[common_pb2.ChatMessage(role="wizard", content="x")])
        ),
    ],
)
async def test_invalid_requests(
    stub: gateway_pb2_grpc.GatewayStub, request_: gateway_pb2.PublicGenerateRequest
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read_all(stub.Generate(request_, timeout=WAIT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_upstream_failure_is_unavailable(
    stub: gateway_pb2_grpc.GatewayStub, upstreams: FakeUpstreams
) -> None:
    upstreams.engine.fail_next_submit = True
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read_all(stub.Generate(gateway_pb2.PublicGenerateRequest(prompt="x"), timeout=WAIT_S))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_and_reflection(gateway: GatewayHandle) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="sluice.v1.Gateway"), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo(timeout=WAIT_S)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
        names = {s.name for s in response.list_services_response.service}
        assert "sluice.v1.Gateway" in names


async def test_call_deadline_ends_the_request(
    stub: gateway_pb2_grpc.GatewayStub, upstreams: FakeUpstreams
) -> None:
    request = gateway_pb2.PublicGenerateRequest(
        prompt="x", stopping=common_pb2.StoppingParams(max_new_tokens=10**6)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read_all(stub.Generate(request, timeout=0.3))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(upstreams.engine.aborted)
