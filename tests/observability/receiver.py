"""An OTLP/gRPC trace receiver for tests: a `TraceService` server (from `opentelemetry-proto`) that
keeps every span it receives in memory, flattened to `ReceivedSpan`s.

    with TraceReceiver() as receiver:          # binds 127.0.0.1, a free port
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        ...
        spans = receiver.wait_for(lambda spans: ..., timeout_s=30)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KIND_NAMES = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
    trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "UNSPECIFIED",
}


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind is None:
        return None
    return getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received; ids are lower-case hex ("" for no parent)."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace_id, span_id)
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=service,
                        name=span.name,
                        kind=KIND_NAMES.get(span.kind, str(span.kind)),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=[(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        status_code=span.status.code,
                        status_message=span.status.message,
                    )
                )
    return spans


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: TraceReceiver) -> None:
        self.receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.receiver._add(flatten(request))
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class TraceReceiver:
    """A running OTLP/gRPC receiver on 127.0.0.1 (port 0 = a free one). Thread-safe."""

    port: int = 0
    spans: list[ReceivedSpan] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Collector(self), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.spans.extend(spans)
            self._changed.notify_all()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], *, timeout_s: float) -> list[ReceivedSpan]:
        """The spans received so far, once `done(spans)` holds; raises TimeoutError (with what arrived)
        after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise TimeoutError(f"spans not complete after {timeout_s:.0f}s; received {names}")
                self._changed.wait(left)
            return list(self.spans)

    def close(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> TraceReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
