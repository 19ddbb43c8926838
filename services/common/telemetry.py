"""Tracing for every service: OpenTelemetry SDK set-up from the standard `OTEL_*` variables, and W3C
trace-context propagation over gRPC metadata and inside multiplexed-stream messages.

`init_tracing` reads the environment once; with no exporter configured nothing is installed (the no-op
tracer stays, no interceptor is added, `inject` returns at once), so tracing off costs nothing. Unary and
server-streaming calls carry the context in gRPC metadata (this module's interceptors; health and
reflection never traced); a multiplexed stream has no span of its own, and each request message carries
its context in its `trace_context` map (`inject` / `extract`). The variables read, and why the
interceptors are not opentelemetry-instrumentation-grpc's: docs/architecture.md ("Observability").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

SERVICE_NAMES = ("gateway", "tokenizer", "engine", "detokenizer")
_EXPORTERS = ("otlp", "console", "none")
# Services whose calls are probed by load balancers; never traced.
_UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")

_enabled = False
_initialized = False


def exporters_from_env(env: Mapping[str, str], *, console: bool = False) -> list[str]:
    """The span exporters the environment asks for (a subset of otlp, console); `console` adds one."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if raw:
        names = [name.strip() for name in raw.split(",") if name.strip()]
        unknown = [name for name in names if name not in _EXPORTERS]
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter(s) {', '.join(unknown)}")
    else:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = ["otlp"] if endpoint else []
    if console:
        names.append("console")
    return [name for name in dict.fromkeys(names) if name != "none"]


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    protocol = (
        (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        .strip()
        .lower()
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not grpc or http/protobuf")
    return OTLPSpanExporter()


def init_tracing(service: str, *, console: bool = False, env: Mapping[str, str] | None = None) -> bool:
    """Installs the global tracer provider for `sluice-<service>` with the exporters the environment
    asks for (docs/architecture.md, "Observability"); `console` adds the console exporter. Returns
    whether tracing is on. Only the first call in a process counts; make it before building servers and
    channels. Spans still buffered are flushed at interpreter exit (or by `shutdown_tracing`)."""
    global _enabled, _initialized
    assert service in SERVICE_NAMES, service
    if _initialized:
        return _enabled
    _initialized = True
    env = os.environ if env is None else env
    names = exporters_from_env(env, console=console)
    if not names:
        _enabled = False
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: f"sluice-{service}"}))
    for name in names:
        exporter = _otlp_exporter(env) if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on for sluice-%s: %s", service, ", ".join(names))
    return True


def shutdown_tracing() -> None:
    """Exports the spans still buffered and stops the exporters (a no-op when tracing is off)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if _enabled and shutdown is not None:
        shutdown()


def tracing_enabled() -> bool:
    return _enabled


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# --- context in messages and metadata ----------------------------------------------------------------


def inject(carrier: dict[str, str] | None = None, ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Writes the current (or given) context into `carrier` (traceparent, tracestate) and returns it;
    empty when tracing is off or no span is active. Use with a message's `trace_context` map:
    `message.trace_context.update(inject())`."""
    carrier = {} if carrier is None else carrier
    if _enabled:
        propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The context a carrier (a `trace_context` map, or `{"traceparent": ...}`) holds; the empty
    context when it holds none."""
    if not carrier:
        return otel_context.Context()
    return propagate.extract(carrier, context=otel_context.Context())


def extract_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The context in gRPC invocation metadata (keys are lower-case there)."""
    return extract({key: value for key, value in metadata or () if isinstance(value, str)})


def _set_grpc_code(span: Span, code: grpc.StatusCode | None, details: str | None = None) -> None:
    if code is None or code == grpc.StatusCode.OK:
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))


# --- server interceptor -------------------------------------------------------------------------------


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span, child of the caller's metadata context, around every unary-request call
    (unary and server-streaming). Client-streaming and bidirectional calls get no span: they are the
    multiplexed streams, whose requests carry their own context."""

    def __init__(self) -> None:
        self.tracer = get_tracer("sluice.grpc.server")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or handler.request_streaming or method.startswith(_UNTRACED_PREFIXES):
            return handler
        parent = extract_metadata(details.invocation_metadata)
        attributes = _rpc_attributes(method)
        tracer = self.tracer
        name = method.lstrip("/")

        @contextlib.contextmanager
        def server_span(context: grpc.aio.ServicerContext) -> Iterator[None]:
            with tracer.start_as_current_span(
                name,
                context=parent,
                kind=SpanKind.SERVER,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    yield
                except BaseException as exc:
                    _finish_server_error(span, context, exc)
                    raise

        serializers = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.response_streaming:
            stream_behavior = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                with server_span(context):
                    async for response in stream_behavior(request, context):
                        yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, **serializers)

        behavior = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with server_span(context):
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **serializers)


def _finish_server_error(span: Span, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """`context.abort` raises after setting the code; anything else is an internal error."""
    code = context.code() if isinstance(exc, grpc.aio.AbortError) else None
    if code is not None:
        _set_grpc_code(span, code, context.details())
    else:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a service's grpc.aio server takes; none when tracing is off."""
    return [_ServerInterceptor()] if _enabled else []


# --- client interceptors ------------------------------------------------------------------------------


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in inject().items():
        metadata.add(key, value)
    return details._replace(metadata=metadata)  # type: ignore[attr-defined]


class _UnaryUnaryClient(grpc.aio.UnaryUnaryClientInterceptor):
    """A CLIENT span around each unary call, whose context travels in the call's metadata."""

    def __init__(self) -> None:
        self.tracer = get_tracer("sluice.grpc.client")

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(_UNTRACED_PREFIXES):
            return await continuation(details, request)
        with self.tracer.start_as_current_span(
            method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes=_rpc_attributes(method),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            call = await continuation(_with_context(details), request)
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                _set_grpc_code(span, exc.code(), exc.details())
            return call


class _UnaryStreamClient(grpc.aio.UnaryStreamClientInterceptor):
    """Server-streaming calls carry the caller's current context in metadata (the caller owns the
    span: the call outlives this interceptor)."""

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_context(details), request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors for `grpc.aio.insecure_channel(..., interceptors=...)`; none when tracing is
    off. Streaming-request calls (the multiplexed streams) are left alone: their messages carry the
    context."""
    return [_UnaryUnaryClient(), _UnaryStreamClient()] if _enabled else []
