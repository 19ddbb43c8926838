"""`--workers N`: N processes share one port (SO_REUSEPORT) and all drain on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
from tokenizers import Tokenizer

from services.common import grpc_server
from services.common.pb import detokenizer_pb2, detokenizer_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc


def start(name: str, model_dir: Path, workers: int) -> tuple[subprocess.Popen[str], int]:
    cmd = [
        sys.executable,
        "-m",
        "sluice.cli",
        "serve",
        name,
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--workers",
        str(workers),
        "--grace-s",
        "2",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    ports = []
    for line in proc.stdout:
        if found := re.search(r"listening on port (\d+)", line):
            ports.append(int(found.group(1)))
            if len(ports) == workers:
                break
    assert len(ports) == workers and len(set(ports)) == 1, ports
    return proc, ports[0]


def listeners(proc: subprocess.Popen[str], port: int) -> int:
    """How many of the service's processes listen on `port`."""
    root = psutil.Process(proc.pid)
    count = 0
    for p in [root, *root.children(recursive=True)]:
        conns = p.net_connections(kind="tcp")
        count += any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)
    return count


def stop(proc: subprocess.Popen[str]) -> None:
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive


@pytest.mark.parametrize("name", ["tokenizer", "detokenizer"])
async def test_two_workers_share_the_port(model_dir: Path, name: str) -> None:
    proc, port = start(name, model_dir, workers=2)
    try:
        address = f"127.0.0.1:{port}"
        await grpc_server.wait_healthy(address, timeout_s=60)
        assert listeners(proc, port) == 2
        options = [*grpc_server.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        for _ in range(4):  # separate connections, spread over the workers by the kernel
            async with grpc.aio.insecure_channel(address, options=options) as channel:
                if name == "tokenizer":
                    reply = await tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(
                        tokenizer_pb2.TokenizeRequest(text="hello world")
                    )
                    assert reply.ids[0] == 1 and len(reply.ids) > 1
                else:
                    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("hello world").ids
                    reply = await detokenizer_pb2_grpc.DetokenizerStub(channel).Decode(
                        detokenizer_pb2.DecodeRequest(ids=ids, skip_special_tokens=True)
                    )
                    assert reply.text == "hello world"
    finally:
        if proc.poll() is None:
            stop(proc)
