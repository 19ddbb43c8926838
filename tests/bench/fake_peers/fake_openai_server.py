"""A stand-in for a peer server in the peers benchmark's tests: `python fake_openai_server.py MODEL PORT NAME
EVENTS` serves OpenAI streaming completions on 127.0.0.1:PORT under the model name MODEL (as the real start
scripts do), one short text chunk per token asked for, usage in a chunk of its own; it appends "start NAME",
one "request NAME INFLIGHT MODEL IGNORE_EOS" line per completion (INFLIGHT: requests in progress, this one
included) and "stop NAME" (on SIGTERM) to the file EVENTS."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from aiohttp import web


def main() -> None:
    model, port, name, events = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    inflight = 0

    def note(line: str) -> None:
        with events.open("a") as f:
            f.write(line + "\n")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal inflight
        body = await request.json()
        inflight += 1
        note(f"request {name} {inflight} {body['model']} {body.get('ignore_eos')}")
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body["max_tokens"])
            for k in range(n):
                await asyncio.sleep(0.05)  # long enough for the concurrent run's requests to overlap
                choice = {"index": 0, "text": "w ", "finish_reason": "length" if k == n - 1 else None}
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            inflight -= 1

    def stop(*_: object) -> None:
        note(f"stop {name}")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    note(f"start {name}")
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


if __name__ == "__main__":
    main()
