"""Admission never leaves a request hanging: any error while tokenizing, resolving or picking replicas
ends that request at once ("unavailable" for an OSError reaching a replica, else "internal"), and the
next request is served as usual. A name that fails to resolve, or a replica whose channel cannot be
opened, is tried again later rather than failing every request after it."""

from __future__ import annotations

import httpx
import pytest

from gateway import upstream
from gateway.server import create_server
from gateway.stages import Stages
from gateway.upstream import Replicas
from tests.gateway.conftest import WAIT_S, gateway_settings
from tests.gateway.fakes import MODEL, FakeUpstreams

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (OSError("no such file: ca.pem"), 503, "unavailable"),
        (UnicodeError("label too long"), 500, "internal_error"),
    ],
)
async def test_an_unexpected_admission_error_ends_only_that_request(
    upstreams: FakeUpstreams,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    status: int,
    code: str,
) -> None:
    server = await create_server(gateway_settings(upstreams, request_timeout_s=60.0))
    await server.start()
    real = Stages.pick_engine
    errors = [error]

    async def pick_engine(self: Stages, ids: list[int], wait_s: float) -> str:
        if errors:
            raise errors.pop()
        return await real(self, ids, wait_s)

    monkeypatch.setattr(Stages, "pick_engine", pick_engine)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
            failed = await http.post("/v1/completions", json=BODY)
            served = await http.post("/v1/completions", json=BODY)
        assert server.core.in_flight == 0
    finally:
        await server.stop(0.5)
    assert failed.status_code == status, failed.text
    assert failed.json()["error"]["code"] == code
    assert "ca.pem" not in failed.text and "label" not in failed.text
    assert served.status_code == 200, served.text


async def test_a_first_resolution_that_raises_does_not_poison_later_requests(
    upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """getaddrinfo raises UnicodeError for a name IDNA cannot encode (and anything may fail): the name
    is resolved again on a later pick, and requests are served once it resolves."""
    port = upstreams.addresses["engine"].rsplit(":", 1)[1]
    answers: list[Exception | list[str]] = [UnicodeError("label empty or too long"), RuntimeError("resolver")]

    async def resolve(host: str, port: int) -> list[str]:
        answer = answers.pop(0) if answers else ["127.0.0.1"]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(upstream, "resolve_host", resolve)
    settings = gateway_settings(upstreams, engine=(f"dns:///engines:{port}",), upstream_wait_s=WAIT_S)
    server = await create_server(settings)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
            replies = [await http.post("/v1/completions", json=BODY) for _ in range(2)]
    finally:
        await server.stop(0.5)
    assert [r.status_code for r in replies] == [200, 200], replies[0].text


async def test_a_replica_whose_channel_cannot_be_opened_joins_once_it_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Opening a resolved replica's channel re-reads the TLS files: an OSError there leaves that replica
    out (the others stay) until a later resolution opens it."""
    names = {"engines": ["127.0.0.1", "127.0.0.2"]}

    async def resolve(host: str, port: int) -> list[str]:
        return names[host]

    replicas = Replicas("engine", ["dns:///engines:9"], resolve=resolve, resolve_interval_s=60)
    real_open = Replicas._open
    refused = {"127.0.0.2:9"}

    def open_channel(self: Replicas, target: str) -> object:
        if target in refused:
            raise OSError("cannot read the client key")
        return real_open(self, target)

    monkeypatch.setattr(Replicas, "_open", open_channel)
    try:
        await replicas.refresh()
        assert replicas.addresses == ("127.0.0.1:9",)
        refused.clear()
        await replicas.refresh()
        assert replicas.addresses == ("127.0.0.1:9", "127.0.0.2:9")
    finally:
        await replicas.close()
