"""Plain HTTP routes of the gateway: chat page, health, readiness, models."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.upstream import Replicas
from tests.gateway.conftest import WAIT_S, dead_address
from tests.gateway.fakes import MODEL, FakeUpstreams


async def test_healthz(http: httpx.AsyncClient) -> None:
    response = await http.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readyz_follows_the_upstreams(make_gateway, upstreams: FakeUpstreams) -> None:  # type: ignore[no-untyped-def]
    server = await make_gateway(readyz_cache_s=0.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.get("/readyz")
        assert response.status_code == 200
        assert response.json()["stages"]["engine"] == {"ready": True, "serving": 1, "replicas": [True]}
        await upstreams.stop("engine")
        response = await http.get("/readyz")
    assert response.status_code == 503
    stages = response.json()["stages"]
    assert stages["engine"] == {"ready": False, "serving": 0, "replicas": [False]}
    assert stages["tokenizer"]["ready"] is True


async def test_readyz_needs_one_serving_replica_of_every_stage_and_names_no_address(
    make_gateway, upstreams: FakeUpstreams
) -> None:  # type: ignore[no-untyped-def]
    """Readiness is "every stage can serve": one engine replica of two down leaves the gateway ready.
    The body counts replicas by stage and names no internal address."""
    dead = dead_address()
    server = await make_gateway(engine=(dead, upstreams.addresses["engine"]), readyz_cache_s=0.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.get("/readyz")
        assert response.status_code == 200
        assert {kind: stage["ready"] for kind, stage in response.json()["stages"].items()} == {
            "tokenizer": True,
            "engine": True,
            "detokenizer": True,
        }
        assert response.json()["stages"]["engine"] == {"ready": True, "serving": 1, "replicas": [False, True]}
        assert "127.0.0.1" not in response.text
        await upstreams.stop("engine")
        response = await http.get("/readyz")
    assert response.status_code == 503
    assert response.json()["stages"]["engine"]["ready"] is False
    assert "127.0.0.1" not in response.text


async def test_readyz_counts_no_engine_where_another_stage_serves(
    make_gateway, upstreams: FakeUpstreams
) -> None:  # type: ignore[no-untyped-def]
    """An engine address where the detokenizer serves (two services given overlapping ports): that server
    answers health for itself, not for sluice.v1.Engine, so the gateway is not ready and routes nothing
    there, rather than failing every request with a call the server does not have."""
    server = await make_gateway(engine=(upstreams.addresses["detokenizer"],), readyz_cache_s=0.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.get("/readyz")
    assert response.status_code == 503
    stages = response.json()["stages"]
    assert stages["engine"] == {"ready": False, "serving": 0, "replicas": [False]}
    assert stages["detokenizer"]["ready"] is True


async def test_readyz_checks_the_upstreams_at_most_once_per_cache_period(
    make_gateway, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Anyone may ask /readyz as often as they like: the health fan-out runs once per `readyz_cache_s`
    (concurrent and later askers within it share its answer)."""
    server = await make_gateway(readyz_cache_s=3600.0)
    checks: list[str] = []
    real = Replicas.check_health

    async def counting(self: Replicas, timeout_s: float) -> dict[str, bool]:
        checks.append(self.kind)
        return await real(self, timeout_s)

    monkeypatch.setattr(Replicas, "check_health", counting)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        replies = await asyncio.gather(*(http.get("/readyz") for _ in range(5)))
        replies.append(await http.get("/readyz"))
    assert [r.status_code for r in replies] == [200] * 6
    assert sorted(checks) == ["detokenizer", "engine", "tokenizer"]


async def _ready_status_until(http: httpx.AsyncClient, status: int) -> list[int]:
    """Asks /readyz until it answers `status` (or WAIT_S passes); returns every status answered."""
    seen: list[int] = []
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not seen or seen[-1] != status:
        if asyncio.get_running_loop().time() > deadline:
            break
        seen.append((await http.get("/readyz")).status_code)
        await asyncio.sleep(0.02)
    return seen


@pytest.mark.parametrize("loss", ["not serving", "server gone"])
async def test_readyz_drops_the_moment_a_stage_loses_its_last_replica_whatever_the_cache(
    make_gateway, upstreams: FakeUpstreams, loss: str
) -> None:  # type: ignore[no-untyped-def]
    """The cached answer is good only while no replica was lost: an engine that turns NOT_SERVING, or
    whose server goes away, makes /readyz answer 503 at once, within a cache period of an hour (coming
    back up is seen within the cache period, as before: `test_readyz_follows_the_upstreams`)."""
    server = await make_gateway(readyz_cache_s=3600.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        assert (await http.get("/readyz")).status_code == 200
        if loss == "not serving":
            await upstreams.health["engine"].set_serving(False)
        else:
            await upstreams.stop("engine")
        seen = await _ready_status_until(http, 503)
        assert seen[-1] == 503, seen
        body = (await http.get("/readyz")).json()["stages"]
    assert body["engine"] == {"ready": False, "serving": 0, "replicas": [False]}
    assert body["tokenizer"]["ready"] and body["detokenizer"]["ready"]


async def test_models(http: httpx.AsyncClient) -> None:
    response = await http.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]


async def test_models_without_tokenizer_is_503(make_gateway, upstreams: FakeUpstreams) -> None:  # type: ignore[no-untyped-def]
    server = await make_gateway(upstream_wait_s=0.2)  # waits that long for the tokenizer to come back
    await upstreams.stop("tokenizer")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.get("/v1/models")
    assert response.status_code == 503
    assert response.json()["error"]["message"]


async def test_chat_page_is_self_contained_and_speaks_the_protocol(http: httpx.AsyncClient) -> None:
    response = await http.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "new WebSocket(" in page and "/v1/ws" in page
    for needle in ('type: "generate"', 'type: "cancel"', "messages:", 'id="stop"', "first token", "tok/s"):
        assert needle in page, needle
    # No external assets: nothing is fetched from another origin.
    for needle in ("http://", "https://", "<link ", "src="):
        assert needle not in page, needle


@pytest.mark.parametrize(
    ("origin", "allowed", "status"),
    [
        (None, (), 200),  # not a browser
        ("own", (), 200),  # the gateway's own page
        ("https://evil.example", (), 403),
        ("null", (), 403),
        ("https://app.example", ("https://app.example",), 200),
        ("https://evil.example", ("*",), 200),
    ],
)
async def test_a_browser_page_of_another_origin_may_not_drive_the_http_api(
    make_gateway,
    upstreams: FakeUpstreams,
    origin: str | None,
    allowed: tuple[str, ...],
    status: int,  # type: ignore[no-untyped-def]
) -> None:
    gateway = await make_gateway(allowed_origins=allowed)
    base = f"http://127.0.0.1:{gateway.port}"
    headers = {} if origin is None else {"Origin": base if origin == "own" else origin}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=base, timeout=WAIT_S, headers=headers) as client:
        responses = [await client.post("/v1/completions", json=body),
                     await client.post("/v1/chat/completions", json={**body, "messages": [
                         {"role": "user", "content": "hi"}]}),
                     await client.get("/v1/models")]  # fmt: skip
    assert [r.status_code for r in responses] == [status] * 3
    if status == 403:
        assert responses[0].json()["error"]["code"] == "origin_not_allowed"
        assert upstreams.engine.submits == []  # refused before any work
    else:
        assert len(upstreams.engine.submits) == 2
