"""TLS and mutual TLS between the gateway and the stages, with certificates made here (trustme), and
the loopback-only default of every service's address."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect

from gateway.pipeline import Pipeline
from gateway.server import create_server as create_gateway
from gateway.settings import GatewaySettings
from services.common.grpc_server import (
    ChannelTls,
    ServerHandle,
    client_channel,
    server_credentials,
    wait_healthy,
)
from services.common.metrics import GatewayMetrics
from services.common.pb import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.settings import load_settings
from services.detokenizer.server import create_server as create_detokenizer
from services.detokenizer.settings import DetokenizerSettings
from services.engine.server import create_server as create_engine
from services.engine.settings import EngineSettings
from services.tokenizer.core import TokenizerCore
from services.tokenizer.server import create_server as create_tokenizer
from services.tokenizer.settings import TokenizerSettings
from sluice import cli, launcher

WAIT_S = 30.0  # generous bound on one wait; refusals come back at once
STAGE_SETTINGS = (TokenizerSettings, EngineSettings, DetokenizerSettings)
StartTokenizer = Callable[..., Awaitable[str]]


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for 127.0.0.1 and a client certificate, both signed by
    it, and a client certificate signed by another CA."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    stranger_cert: str
    stranger_key: str


def _leaf(ca: trustme.CA, directory: Path, name: str, *identities: str) -> tuple[str, str]:
    leaf = ca.issue_cert(*identities)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    leaf.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    return str(cert), str(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server = _leaf(ca, directory, "server", "127.0.0.1", "localhost")
    client = _leaf(ca, directory, "client", "gateway.sluice.test")
    stranger = _leaf(trustme.CA(), directory, "stranger", "gateway.sluice.test")
    return Pki(str(directory / "ca.pem"), *server, *client, *stranger)


def _stage_tls(pki: Pki, *, mutual: bool) -> dict[str, str]:
    fields = {"tls_cert_file": pki.server_cert, "tls_key_file": pki.server_key}
    return {**fields, "tls_client_ca_file": pki.ca} if mutual else fields


@pytest.fixture
async def tokenizer_at(tiny_model_dir: Path) -> AsyncIterator[StartTokenizer]:
    """`await tokenizer_at(**tls_fields)` starts a tokenizer with those settings; returns its address."""
    started: list[ServerHandle[grpc.aio.Server, TokenizerCore]] = []

    async def start(**tls: str) -> str:
        settings = TokenizerSettings(model=str(tiny_model_dir), port=0, **tls)
        tokenizer = await create_tokenizer(settings)
        await tokenizer.start()
        started.append(tokenizer)
        return f"127.0.0.1:{tokenizer.port}"

    yield start
    for tokenizer in started:
        await tokenizer.stop(0)


async def _health(address: str, tls: ChannelTls | None) -> int:
    """One health Check over a fresh channel; raises AioRpcError when the call fails."""
    async with client_channel(address, tls=tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=WAIT_S
        )
        return reply.status


async def _refused(address: str, tls: ChannelTls | None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await _health(address, tls)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_tls_stage_answers_tls_clients_and_refuses_plaintext(
    pki: Pki, tokenizer_at: StartTokenizer
) -> None:
    address = await tokenizer_at(**_stage_tls(pki, mutual=False))
    tls = ChannelTls(pki.ca)
    await wait_healthy(address, timeout_s=WAIT_S, tls=tls)
    async with client_channel(address, tls=tls) as channel:
        reply = await tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(
            tokenizer_pb2.TokenizeRequest(request_id="t", text="Once upon a time"), timeout=WAIT_S
        )
    assert len(reply.ids) > 0
    await _refused(address, None)


async def test_mutual_tls_admits_only_clients_with_a_certificate_from_its_ca(
    pki: Pki, tokenizer_at: StartTokenizer
) -> None:
    address = await tokenizer_at(**_stage_tls(pki, mutual=True))
    member = ChannelTls(pki.ca, pki.client_cert, pki.client_key)
    await wait_healthy(address, timeout_s=WAIT_S, tls=member)
    assert await _health(address, member) == health_pb2.HealthCheckResponse.SERVING
    await _refused(address, ChannelTls(pki.ca))
    await _refused(address, ChannelTls(pki.ca, pki.stranger_cert, pki.stranger_key))
    await _refused(address, None)


async def test_sluice_health_checks_a_mutual_tls_stage(pki: Pki, tokenizer_at: StartTokenizer) -> None:
    address = await tokenizer_at(**_stage_tls(pki, mutual=True))
    flags = ["--tls-ca-file", pki.ca, "--tls-cert-file", pki.client_cert, "--tls-key-file", pki.client_key]
    assert await asyncio.to_thread(cli.main, ["health", address, "--timeout", str(WAIT_S), *flags]) == 0
    assert await asyncio.to_thread(cli.main, ["health", address, "--timeout", "1", *flags[:2]]) == 1


async def test_a_client_that_does_not_trust_the_stage_certificate_is_refused(
    pki: Pki, tokenizer_at: StartTokenizer
) -> None:
    address = await tokenizer_at(**_stage_tls(pki, mutual=False))
    await _refused(address, ChannelTls(pki.stranger_cert))  # a CA file that did not sign the server's


async def test_the_gateway_serves_through_mutual_tls_stages(pki: Pki, tiny_model_dir: Path) -> None:
    """Tokenizer, engine and detokenizer all on mutual TLS; the gateway with its client certificate
    streams a generation over the WebSocket and is ready; without a certificate it is not."""
    model, tls = str(tiny_model_dir), _stage_tls(pki, mutual=True)
    tok = await create_tokenizer(TokenizerSettings(model=model, port=0, **tls))
    det = await create_detokenizer(DetokenizerSettings(model=model, port=0, **tls))
    eng = await create_engine(EngineSettings(model=model, port=0, device="cpu", num_kv_blocks=128, **tls))
    for stage in (tok, det, eng):
        await stage.start()
    addresses = {
        "tokenizer": (f"127.0.0.1:{tok.port}",),
        "engine": (f"127.0.0.1:{eng.port}",),
        "detokenizer": (f"127.0.0.1:{det.port}",),
    }
    settings = GatewaySettings(
        port=0,
        grpc_port=0,
        tls_ca_file=pki.ca,
        tls_cert_file=pki.client_cert,
        tls_key_file=pki.client_key,
        **addresses,
    )
    gateway = await create_gateway(settings)
    await gateway.start()
    anonymous = Pipeline(
        GatewaySettings(tls_ca_file=pki.ca, health_timeout_s=WAIT_S, **addresses), GatewayMetrics()
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as http:
            assert (await http.get("/readyz")).status_code == 200
        async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
            params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
            await ws.send(
                json.dumps({"type": "generate", "id": "g", "prompt": "Once upon", "params": params})
            )
            text = ""
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), WAIT_S)))["type"] == "delta":
                text += frame["text"]
        assert frame["type"] == "done" and frame["usage"]["completion_tokens"] == 6, frame
        assert text
        assert not any(any(serving) for serving in (await anonymous.check_ready()).values())
    finally:
        await anonymous.close()
        await gateway.stop(0.5)
        for stage in (tok, det, eng):
            await stage.stop(0)


@pytest.mark.parametrize("cls", STAGE_SETTINGS)
def test_every_stage_takes_the_same_tls_settings(cls: type) -> None:
    flags = ["--tls-cert-file", "s.pem", "--tls-key-file", "s.key"]
    settings = load_settings(cls, flags, environ={"SLUICE_TLS_CLIENT_CA_FILE": "ca.pem"})
    assert (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file) == (
        "s.pem",
        "s.key",
        "ca.pem",
    )
    assert server_credentials(cls()) is None  # no certificate: plaintext
    for bad in (
        ["--tls-cert-file", "s.pem"],
        ["--tls-key-file", "s.key"],
        ["--tls-client-ca-file", "ca.pem"],
    ):
        with pytest.raises(SystemExit):
            load_settings(cls, bad, environ={})


def test_an_unreadable_tls_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(OSError, match=r"missing\.pem"):
        server_credentials(TokenizerSettings(tls_cert_file=missing, tls_key_file=missing))
    with pytest.raises(OSError, match=r"missing\.pem"):
        ChannelTls(missing).credentials()


def test_gateway_and_launcher_reach_the_stages_with_the_same_tls() -> None:
    assert ChannelTls.from_settings(GatewaySettings()) is None
    settings = GatewaySettings(tls_ca_file="ca.pem", tls_cert_file="c.pem", tls_key_file="c.key")
    assert ChannelTls.from_settings(settings) == ChannelTls("ca.pem", "c.pem", "c.key")
    assert launcher.stage_tls({}) is None
    environ = {
        "SLUICE_TLS_CA_FILE": "ca.pem",
        "SLUICE_TLS_CERT_FILE": "c.pem",
        "SLUICE_TLS_KEY_FILE": "c.key",
    }
    assert launcher.stage_tls(environ) == ChannelTls("ca.pem", "c.pem", "c.key")


def test_every_service_binds_loopback_by_default() -> None:
    for cls in (*STAGE_SETTINGS, GatewaySettings):
        assert cls().host == "127.0.0.1", cls.__name__
        assert load_settings(cls, [], environ={}).host == "127.0.0.1", cls.__name__
    assert launcher.parse_args([]).host == "127.0.0.1"
