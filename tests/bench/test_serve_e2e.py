"""`sluice bench serve` against a real `sluice up` through each of its APIs, and the fixed-length
extensions (ignore_eos, min_tokens) end to end.

The model is the tiny test model with every token id declared an EOS id, so a request that does not
ignore EOS ends after one token: fixed output lengths can only come from ignore_eos reaching the engine.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.bench import serve
from tests.e2e.conftest import Pipeline, start_pipeline

pytestmark = pytest.mark.e2e

NUM, OUTPUT_LEN = 6, 8


@pytest.fixture(scope="module")
def always_eos_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("always-eos") / "model"
    shutil.copytree(tiny_model_dir, model)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = list(range(vocab_size))
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


@pytest.fixture(scope="module")
def pipeline(always_eos_model: Path) -> Iterator[Pipeline]:
    running = start_pipeline(always_eos_model)
    yield running
    assert running.stop() == 0, running.output()


@pytest.mark.parametrize("api", ["openai", "openai-chat"])
def test_fixed_length_workload_through_each_api(pipeline: Pipeline, api: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = [
        "--api", api, "--url", pipeline.api_url(api), "--num-requests", str(NUM), "--sigma", "0",
        "--output-len", str(OUTPUT_LEN), "--input-len", "12", "--max-concurrency", "4", "--num-warmup", "1",
        "--slo", "ttft=60000", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    assert serve.main(argv) == 0
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert (summary["completed"], summary["failed"]) == (NUM, 0)
    assert summary["total_output_tokens"] == NUM * OUTPUT_LEN  # ignore_eos: exactly what was asked
    assert [r["output_tokens"] for r in doc["records"]] == [OUTPUT_LEN] * NUM
    assert all(r["prompt_tokens"] > 0 and len(r["itl_s"]) >= 1 for r in doc["records"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[key]
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], key
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # a one-minute TTFT SLO
    assert doc["meta"]["command"].startswith("sluice bench serve --api")
    assert doc["meta"]["machine"]["cpu_count"] >= 1
    # Without ignore_eos the always-EOS model stops every request after its first token.
    assert serve.main([*argv, "--no-ignore-eos"]) == 0
    assert json.loads(out.read_text())["summary"]["total_output_tokens"] == NUM


def test_ignore_eos_gives_exactly_max_tokens_and_min_tokens_is_checked(pipeline: Pipeline) -> None:
    base = f"http://127.0.0.1:{pipeline.http_port}/v1"
    with httpx.Client(base_url=base, timeout=120.0) as http:
        model = http.get("/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "the", "max_tokens": 24, "temperature": 0}
        reply = http.post("/completions", json={**body, "ignore_eos": True, "min_tokens": 24})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 24
        assert http.post("/completions", json=body).json()["usage"]["completion_tokens"] == 1
        refused = http.post("/completions", json={**body, "min_tokens": 25})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "min_tokens"
