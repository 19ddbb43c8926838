"""The gateway as its own process (`sluice serve gateway`): listening line, SIGTERM drain, exit 0."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

from websockets.asyncio.client import connect

from tests.gateway.conftest import WAIT_S, collect, recv, send, wait_for
from tests.gateway.fakes import FakeUpstreams, expected_text

LISTENING = re.compile(r"gateway listening on http://127\.0\.0\.1:(\d+) .* gRPC 127\.0\.0\.1:(\d+)")


async def test_sigterm_drains_then_exits(upstreams: FakeUpstreams) -> None:
    flags = ["--port", "0", "--grpc-port", "0", "--grace-s", "0.3"]
    for name in ("tokenizer", "engine", "detokenizer"):
        flags += [f"--{name}", upstreams.addresses[name]]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from gateway.server import main; sys.exit(main(sys.argv[1:]))",
        *flags,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        match = LISTENING.search(line)
        assert match, line
        http_port = int(match.group(1))
        async with connect(f"ws://127.0.0.1:{http_port}/v1/ws") as client:
            await send(client, {"type": "generate", "id": "ok", "prompt": "x", "params": {"max_tokens": 5}})
            assert (await collect(client, {"ok"}))["ok"]["text"] == expected_text(5)
            await send(
                client, {"type": "generate", "id": "long", "prompt": "x", "params": {"max_tokens": 10**6}}
            )
            assert (await recv(client))["type"] == "delta"
            process.send_signal(signal.SIGTERM)
            end = (await collect(client, {"long"}))["long"]["end"]
            assert end["type"] == "error" and end["code"] == "unavailable"
        assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
        await wait_for(upstreams.engine.aborted)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
