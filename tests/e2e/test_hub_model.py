"""`sluice up --model ORG/NAME` with the network off: the model comes from a Hugging Face cache laid
out as the Hub client lays it out, is resolved once by the launcher, and every service gets the same
snapshot directory; the APIs answer to the Hub id."""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil

from tests.common.test_hub_models import MAIN, REPO, lay_out
from tests.e2e.conftest import start_pipeline


def test_sluice_up_serves_a_hub_id_from_the_cache_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = lay_out(cache, REPO, MAIN, tiny_model_dir).resolve()
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    running = start_pipeline(Path(REPO), "--standby", "0", env=env)
    try:
        children = [c.cmdline() for c in psutil.Process(running.proc.pid).children()]
        models = {argv[argv.index("--model") + 1] for argv in children if "--model" in argv}
        assert models == {str(snapshot)}, children
        listed = httpx.get(f"{running.http_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in listed["data"]] == [REPO]
        body = {"model": REPO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = httpx.post(f"{running.http_url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert running.stop() == 0, running.output()
