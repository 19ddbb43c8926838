"""The HTTP application: chat page `/`, WebSocket `/v1/ws`, OpenAI-compatible `/v1/completions`,
`/v1/chat/completions` and `/v1/models`, vLLM's `/tokenize` and `/detokenize`, `/healthz`, `/readyz`,
`/metrics` (Prometheus).

Every response carries `X-Request-Id`: the client's own when valid (`params.client_request_id`), else a
fresh one (`RequestIds`); the generation endpoints name their response by it. The API routes (`/v1/`,
`/tokenize`, `/detokenize`) need `Authorization: Bearer KEY` when keys are on (the WebSocket may send its
key in its first frame instead) and refuse 403 a browser's request from another origin
(`auth.origin_allowed`) and any request whose `Host` is not allowed (`HostCheck`: docs/security.md); the
page and the health routes stay open. Every error of an API route, and every 5xx of any route, is
OpenAI-style JSON that names no internal address and holds no stack trace.
"""

from __future__ import annotations

import logging
import uuid
from importlib import resources

from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import params
from gateway.auth import ApiKeys, allowed_hosts, host_allowed, origin_allowed
from gateway.choices import host_name
from gateway.openai_api import OpenAIHandlers
from gateway.openai_protocol import DROP_CONNECTION, REQUEST_ID, ApiError
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.tokenize_api import TokenizeHandlers
from gateway.ws import serve_socket
from services.common.metrics import render

log = logging.getLogger(__name__)


def chat_page() -> str:
    """The chat page: one self-contained HTML file shipped with the package."""
    return resources.files("gateway").joinpath("static/index.html").read_text(encoding="utf-8")


def with_connection_drop(app: ASGIApp) -> ASGIApp:
    """Wraps the outermost ASGI app so that a response or a WebSocket can drop its connection at once
    (a client that stopped reading): each HTTP and WebSocket scope gets `scope[DROP_CONNECTION]`, a
    callable that aborts the connection's transport, when the server's `send` exposes it (uvicorn's
    does, as the bound method of a cycle or protocol with a `transport`); else the key is absent and
    the response or socket just ends."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] in ("http", "websocket") and callable(getattr(transport, "abort", None)):
            scope[DROP_CONNECTION] = transport.abort
        await app(scope, receive, send)

    return wrapped


class RequestIds:
    """ASGI middleware: each HTTP request's id in `scope[REQUEST_ID]` (the client's `X-Request-Id`
    when valid, else a fresh one), and in the `X-Request-Id` header of its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        request_id = params.client_request_id(asked.decode("latin-1")) or uuid.uuid4().hex
        scope[REQUEST_ID] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _is_api_path(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class HostCheck:
    """ASGI middleware against DNS rebinding: an API request or WebSocket handshake whose `Host`
    names no allowed host (`auth.allowed_hosts`) is refused, 403 naming the host (400 without a usable
    Host), as OpenAI-style JSON; a WebSocket is refused before it opens, with that body where the
    server can send one (else a bare 403)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and _is_api_path(scope["path"]):
            host = Headers(scope=scope).get("host")
            if not host_allowed(host, self.allowed):
                await self._refuse(host, scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(host: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        name = host_name(host)
        log.info("%s %s refused: host %r is not allowed", scope["type"], scope["path"], host)
        if name is None:
            error = ApiError(400, "the request has no usable Host header", code="host_not_allowed")
        else:
            error = ApiError(403, f"host {name!r} is not allowed (the gateway's --allowed-hosts lists the "
                             "host names it answers to)", code="host_not_allowed")  # fmt: skip
        if scope["type"] == "http" or "websocket.http.response" in scope.get("extensions", {}):
            await error.response()(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008})


def create_app(pipeline: Pipeline, settings: GatewaySettings, keys: ApiKeys) -> FastAPI:
    app = FastAPI(title="sluice gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestIds)
    app.add_middleware(HostCheck, allowed=allowed_hosts(settings.allowed_hosts, settings.host))
    _add_error_handlers(app)
    _add_open_routes(app, pipeline)
    _add_api_routes(app, pipeline, settings, keys)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI-style JSON; an unexpected one a 500 that names no internals."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        """Any other failure: a JSON 500 that names no internals (the log has the details)."""
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return ApiError(500, "internal error", type_="server_error", code="internal_error").response()


def _add_open_routes(app: FastAPI, pipeline: Pipeline) -> None:
    """The routes open without a key: the chat page, health and metrics."""
    page = chat_page()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the gateway process is up and answers HTTP (it asks no upstream)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Readiness: every stage can serve, i.e. at least one replica of each answers its gRPC health
        check with SERVING. 200 when ready, else 503. The body gives each stage's readiness, its count
        of serving replicas and each replica's health in the stage's order, never an address; the
        checks are made at most once a second (`readyz_cache_s`), however often this is asked."""
        upstreams = await pipeline.check_ready()
        stages = {
            kind: {"ready": any(serving), "serving": sum(serving), "replicas": serving}
            for kind, serving in upstreams.items()
        }
        ready = all(stage["ready"] for stage in stages.values())
        body = {"status": "ready" if ready else "not ready", "stages": stages}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition of the gateway's metrics."""
        body, content_type = render(pipeline.metrics.registry)
        return Response(body, media_type=content_type)


def _add_api_routes(app: FastAPI, pipeline: Pipeline, settings: GatewaySettings, keys: ApiKeys) -> None:
    """The `/v1/` routes and `/tokenize`, `/detokenize`: a trusted origin and, with keys on, a key (the
    WebSocket checks its own)."""
    handlers = OpenAIHandlers(pipeline, settings)
    tokens = TokenizeHandlers(pipeline, settings, handlers)

    async def authorized(request: Request) -> None:
        if not keys.check_bearer(request.headers.get("authorization")):
            raise ApiError(
                401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key"
            )

    async def trusted_origin(request: Request) -> None:
        """A browser page of another origin may not drive the API (with keys off, any page the user
        visits could otherwise POST to it); clients that send no Origin are not browsers."""
        origin = request.headers.get("origin")
        if not origin_allowed(origin, request.headers.get("host"), settings.allowed_origins):
            log.info("%s %s refused: origin %r is not allowed", request.method, request.url.path, origin)
            raise ApiError(403, "this origin may not use the API (the gateway's --allowed-origins lists the "
                           "origins that may)", code="origin_not_allowed")  # fmt: skip

    guarded = [Depends(trusted_origin), Depends(authorized)]

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        served = await handlers.model_name(None)
        card = {"id": served, "object": "model", "created": 0, "owned_by": "sluice",
                "max_model_len": await handlers.max_model_len()}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> Response:
        return await tokens.tokenize(request)

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> Response:
        return await tokens.detokenize(request)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await handlers.handle(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await handlers.handle(request, chat=True)

    @app.websocket("/v1/ws")
    async def websocket(ws: WebSocket) -> None:
        await serve_socket(ws, pipeline, settings, keys)
