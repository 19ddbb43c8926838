"""A traced gRPC client process for the tracing tests, standing in for the gateway:

    python -m tests.observability.probe TOKENIZER_ADDR DETOKENIZER_ADDR TRACEPARENT

Under one span `probe` (child of TRACEPARENT) it calls Tokenize (unary, through the client
interceptors: a CLIENT span, context in metadata), Tokenize with empty input (INVALID_ARGUMENT),
TokenizeStream with the context in the request, and one detokenize Stream request (Start with the
context, a chunk, a close); then flushes its spans (OTLP endpoint from the environment) and prints
`ids=N` (ids of the first Tokenize).
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from services.common import telemetry
from services.common.pb import detokenizer_pb2, detokenizer_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc


async def probe(tokenizer: str, detokenizer: str, traceparent: str) -> int:
    tracer = telemetry.get_tracer("probe")
    interceptors = telemetry.client_interceptors()
    with tracer.start_as_current_span("probe", context=telemetry.extract({"traceparent": traceparent})):
        async with grpc.aio.insecure_channel(tokenizer, interceptors=interceptors) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            reply = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(request_id="unary", text="hello world"))
            try:
                await stub.Tokenize(tokenizer_pb2.TokenizeRequest(request_id="bad"))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            request = tokenizer_pb2.TokenizeRequest(request_id="streamed", text="hello again")
            request.trace_context.update(telemetry.inject())
            async for _ in stub.TokenizeStream(iter([request])):
                pass
        async with grpc.aio.insecure_channel(detokenizer, interceptors=interceptors) as channel:
            stub_d = detokenizer_pb2_grpc.DetokenizerStub(channel)
            start = detokenizer_pb2.DetokenizeStart(request_id="d1", skip_special_tokens=True)
            start.trace_context.update(telemetry.inject())
            messages = [
                detokenizer_pb2.DetokenizeIn(entries=[detokenizer_pb2.DetokenizeInEntry(start=start)]),
                detokenizer_pb2.DetokenizeIn(
                    entries=[
                        detokenizer_pb2.DetokenizeInEntry(
                            chunk=detokenizer_pb2.DetokenizeChunk(request_id="d1", token_ids=list(reply.ids))
                        )
                    ]
                ),
                detokenizer_pb2.DetokenizeIn(
                    entries=[
                        detokenizer_pb2.DetokenizeInEntry(
                            close=detokenizer_pb2.DetokenizeClose(request_id="d1")
                        )
                    ]
                ),
            ]
            async for _ in stub_d.Stream(iter(messages)):
                pass
    return len(reply.ids)


def main(argv: list[str]) -> int:
    if not telemetry.init_tracing("gateway"):
        raise SystemExit("probe: set OTEL_EXPORTER_OTLP_ENDPOINT")
    count = asyncio.run(probe(*argv))
    telemetry.shutdown_tracing()
    print(f"ids={count}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
