"""`sluice bench serve --structured json_schema` through every API and `--tools` through chat completions,
against a real `sluice up`: every output is checked, and with room enough for the longest output each
schema allows, every one is valid.

The room: a token is at least one byte; the engine allows at most 20 whitespace characters in each gap
between two JSON tokens; the largest fixed schema's output has at most 16 such gaps and 110 bytes besides
(strings of at most 16 characters, 4 bytes each at worst), so 512 tokens always reach the end of the
JSON, and of a tool call (its tags, name and arguments) likewise. A constrained output ends there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench import serve
from tests.e2e.conftest import Pipeline

pytestmark = pytest.mark.e2e

NUM, OUTPUT_LEN = 3, 512


def _run(pipeline: Pipeline, api: str, out: Path, *flags: str) -> dict:
    argv = [
        "--api", api, "--url", pipeline.api_url(api), "--num-requests", str(NUM), "--sigma", "0",
        "--output-len", str(OUTPUT_LEN), "--input-len", "8", "--no-progress", "--json", str(out), *flags,
    ]  # fmt: skip
    assert serve.main(argv) == 0
    return json.loads(out.read_text())


def _check_all_valid(doc: dict, printed: str, heading: str) -> None:
    summary = doc["summary"]
    assert (summary["completed"], summary["failed"]) == (NUM, 0), summary["errors"]
    assert (summary["valid_outputs"], summary["valid_fraction"]) == (NUM, 1.0)
    assert [r["valid"] for r in doc["records"]] == [True] * NUM
    assert all(r["output_tokens"] < OUTPUT_LEN for r in doc["records"])  # each ended with its grammar
    assert f"{heading} (fraction):" in printed and "1.000" in printed


@pytest.mark.parametrize("api", ["openai", "openai-chat"])
def test_every_json_output_is_valid_on_every_api(
    pipeline: Pipeline, api: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _run(pipeline, api, tmp_path / "serve.json", "--structured", "json_schema")
    _check_all_valid(doc, capsys.readouterr().out, "Valid json_schema outputs")
    assert doc["config"]["structured"] == "json_schema"
    texts = [json.loads(r["text"]) for r in doc["records"]]
    assert [sorted(t) for t in texts] == [
        ["age", "kind", "name"],
        ["express", "item", "quantity"],
        ["city", "tags"],
    ]


def test_every_required_tool_call_is_valid(
    pipeline: Pipeline, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _run(pipeline, "openai-chat", tmp_path / "serve.json", "--tools")
    _check_all_valid(doc, capsys.readouterr().out, "Valid tool calls")
    assert doc["config"]["tools"] is True
    for record in doc["records"]:
        (call,) = record["tool_calls"]  # parallel_tool_calls false: exactly one call
        assert call["name"] in ("get_weather", "get_time")
