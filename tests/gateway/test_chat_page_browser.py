"""The chat page in headless Chromium, driven over the DevTools protocol: type a message, watch the
reply stream in, press Stop, see the reply end as cancelled, and see the next turn carry the whole
conversation. Needs Debian's `chromium` package; skipped without it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from gateway.server import GatewayHandle
from tests.gateway import fakes
from tests.gateway.conftest import WAIT_S, wait_for
from tests.gateway.fakes import FakeUpstreams

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# `make test` installs chromium; CI must run this test, so there a missing browser is a failure.
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="needs a chromium binary (Debian package 'chromium')",
)

DEVTOOLS_LINE = re.compile(r"DevTools listening on (ws://\S+)")


class DevTools:
    """A minimal DevTools protocol client: one browser connection, commands on one page session."""

    def __init__(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.session: str | None = None

    async def _read(self) -> None:
        async for raw in self._socket:
            message = json.loads(raw)
            future = self._waiting.pop(message.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(message)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        command_id = next(self._ids)
        message: dict[str, Any] = {"id": command_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        future = asyncio.get_running_loop().create_future()
        self._waiting[command_id] = future
        await self._socket.send(json.dumps(message))
        reply = await asyncio.wait_for(future, WAIT_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, expression: str) -> Any:
        """Evaluates JavaScript in the page, awaiting a returned promise."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, condition: str) -> None:
        """Waits until the JavaScript `condition` holds in the page (checked in the page itself)."""
        await self.evaluate(
            "new Promise((resolve) => { const check = () => { if (" + condition + ") resolve(true); "
            "else requestAnimationFrame(check); }; check(); })"
        )

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@pytest.fixture(autouse=True)
def chat_sized_context(upstreams: FakeUpstreams) -> None:
    """A context a conversation of several turns fits in (the fakes' default is 64 tokens, a character
    a token): the page sends the whole conversation each turn."""
    upstreams.tokenizer.context_length = upstreams.engine.max_model_len = 4096


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[str]:
    """A headless Chromium; yields its DevTools WebSocket URL."""
    assert CHROMIUM is not None
    process = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--remote-debugging-port=0",
        f"--user-data-dir={tmp_path / 'profile'}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        while True:
            line = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
            assert line, "chromium exited before its DevTools endpoint was up"
            match = DEVTOOLS_LINE.search(line)
            if match:
                break
        yield match.group(1)
    finally:
        process.kill()
        await process.wait()


# Markup that runs script if a page renders it as HTML rather than as text.
MARKUP = '<img src=x onerror="window.injected=1"><script>window.injected=2</script><b>bold</b>'


@contextlib.asynccontextmanager
async def chat_page(browser: str, gateway: GatewayHandle) -> AsyncIterator[DevTools]:
    """The chat page open and connected in a new tab."""
    async with connect(browser, max_size=None) as socket:
        tools = DevTools(socket)
        try:
            target = await tools.send("Target.createTarget", url="about:blank")
            attached = await tools.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
            tools.session = attached["sessionId"]
            await tools.send("Page.enable")
            await tools.send("Page.navigate", url=f"http://127.0.0.1:{gateway.port}/")
            await tools.until("document.getElementById('status')?.className === 'status open'")
            yield tools
        finally:
            await tools.close()


async def send_message(tools: DevTools, text: str, max_tokens: int) -> None:
    await tools.evaluate(f"document.getElementById('max-tokens').value = '{max_tokens}'")
    await tools.evaluate("document.getElementById('prompt').focus()")
    await tools.send("Input.insertText", text=text)
    await tools.evaluate("document.getElementById('send').click()")


async def test_type_stream_stop_and_continue(
    browser: str, gateway: GatewayHandle, upstreams: FakeUpstreams
) -> None:
    upstreams.engine.step_s = 0.01  # a long reply takes seconds, so Stop lands mid-reply
    async with chat_page(browser, gateway) as tools:
        await send_message(tools, "Tell me a story", 100000)
        await tools.until("document.querySelector('.msg.assistant .bubble').textContent.length >= 5")
        assert await tools.evaluate("document.getElementById('stop').disabled") is False

        await tools.evaluate("document.getElementById('stop').click()")
        await tools.until("document.querySelector('.msg.assistant').dataset.state === 'cancelled'")
        await wait_for(upstreams.engine.aborted)
        reply = await tools.evaluate("document.querySelector('.msg.assistant .bubble').textContent")
        meta = await tools.evaluate("document.querySelector('.msg.assistant .meta').textContent")
        assert reply.startswith("hello")
        assert "first token" in meta and "stopped" in meta

        # The next turn sends the whole conversation, the stopped reply included.
        await send_message(tools, "And then?", 3)
        await tools.until("document.querySelectorAll('.msg.assistant')[1]?.dataset.state === 'done'")
        chat = upstreams.tokenizer.requests[-1].chat.messages
        assert [(m.role, m.content) for m in chat] == [
            ("user", "Tell me a story"),
            ("assistant", reply),
            ("user", "And then?"),
        ]


async def test_markup_in_model_output_errors_and_prompts_shows_as_text(
    browser: str, gateway: GatewayHandle, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fakes, "OUTPUT", MARKUP)  # the fake model's reply is the markup
    async with chat_page(browser, gateway) as tools:
        await send_message(tools, MARKUP, len(MARKUP))
        await tools.until("document.querySelector('.msg.assistant')?.dataset.state === 'done'")
        # An engine error whose words reach the client carries the markup too.
        upstreams.engine.error_next_submit = f"invalid_argument: {MARKUP}"
        await send_message(tools, "again", 5)
        await tools.until("document.querySelectorAll('.msg.assistant')[1]?.dataset.state === 'error'")

        texts = await tools.evaluate(
            "[...document.querySelectorAll('.msg .bubble')].map((b) => b.textContent)"
        )
        assert texts == [MARKUP, MARKUP, "again", ""]
        error = await tools.evaluate(
            "document.querySelectorAll('.msg.assistant')[1].querySelector('.meta').textContent"
        )
        assert MARKUP in error
        # Nothing of it became an element, and none of its script ran.
        assert await tools.evaluate("document.querySelectorAll('#log img, #log script, #log b').length") == 0
        assert await tools.evaluate("window.injected === undefined") is True
