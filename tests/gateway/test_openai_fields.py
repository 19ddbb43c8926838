"""Every field of OpenAI's chat completions and completions requests is either honoured or refused with a
400 that names it: none is accepted and ignored. The field names come from the installed `openai`
package's request TypedDicts, so a field OpenAI adds fails this test until it is given a sample
value below and either implemented (then listed in `HONOURED` with what the gateway does with it) or
refused."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from gateway import pipeline
from gateway.server import GatewayHandle
from tests.gateway.conftest import WAIT_S
from tests.gateway.fakes import MODEL

README = Path(__file__).resolve().parents[2] / "README.md"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

FIELDS = {
    CHAT: sorted(chat_create_params.CompletionCreateParamsStreaming.__annotations__),
    COMPLETIONS: sorted(completion_create_params.CompletionCreateParamsStreaming.__annotations__),
}

# A realistic value for each field, with the fields it needs beside it (merged into a minimal body).
SAMPLES: dict[str, dict[str, Any]] = {
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto"},
    "functions": {"functions": [TOOLS[0]["function"]]},
    "logit_bias": {"logit_bias": {"50": 5}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "max_tokens": {"max_tokens": 3},
    "messages": {"messages": MESSAGES},
    "metadata": {"metadata": {"k": "v"}},
    "modalities": {"modalities": ["text", "audio"]},
    "model": {"model": MODEL},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": TOOLS},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt": {"prompt": "x"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "prompt_cache_options": {"prompt_cache_options": {"ttl": "24h"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": "u1"},
    "seed": {"seed": 3},
    "service_tier": {"service_tier": "flex"},
    "stop": {"stop": ["zz"]},
    "store": {"store": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "suffix": {"suffix": "x"},
    "temperature": {"temperature": 0.5},
    "tool_choice": {"tool_choice": "required", "tools": TOOLS},
    "tools": {"tools": TOOLS},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.5},
    "user": {"user": "u1"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {}},
}
# Where the completions field differs.
COMPLETIONS_SAMPLES = {"logprobs": {"logprobs": 2}, "best_of": {"best_of": 2, "n": 2}}

# Fields the gateway implements, per endpoint, and what it does with each. Every other field is refused.
_COMMON = {
    "frequency_penalty": "sampling penalty, in the engine's sampler",
    "logit_bias": "token id -> bias added to its logit, in the engine's sampler",
    "n": "choices per prompt, one engine request each",
    "max_tokens": "the most tokens generated",
    "model": "checked against the served model (404 for another)",
    "presence_penalty": "sampling penalty, in the engine's sampler",
    "seed": "per-request sampling seed",
    "stop": "stop strings, matched by the detokenizer",
    "stream": "SSE streaming",
    "stream_options": "include_usage: a last chunk with usage",
    "temperature": "sampling temperature",
    "top_p": "nucleus sampling",
    "user": "the end-user id, recorded on the request's trace span (user.id)",
}
HONOURED = {
    CHAT: {
        **_COMMON,
        "logprobs": "the sampled token's logprob",
        "max_completion_tokens": "the newer name of max_tokens",
        "messages": "rendered with the model's chat template",
        "parallel_tool_calls": "false: the required-call grammar allows one call",
        "response_format": "text, json_object or json_schema, enforced by the engine's grammar",
        "tool_choice": "none, auto, required or a named function (required and named: the engine's grammar)",
        "tools": "rendered by the chat template; calls read back by --tool-call-parser",
        "top_logprobs": "top alternatives per token",
    },
    COMPLETIONS: {
        **_COMMON,
        "best_of": "only equal to n",
        "echo": "the prompt first; with logprobs, its tokens' logprobs",
        "logprobs": "top alternatives per token",
        "prompt": "the text to complete",
    },
}


def test_every_field_has_a_sample_and_every_honoured_field_exists() -> None:
    for path, fields in FIELDS.items():
        assert set(fields) <= set(SAMPLES), (
            f"{path}: give these fields a sample: {set(fields) - set(SAMPLES)}"
        )
        assert set(HONOURED[path]) <= set(fields), (
            f"{path}: not OpenAI fields: {set(HONOURED[path]) - set(fields)}"
        )


def body_for(path: str, field: str) -> dict[str, Any]:
    base: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": "x"}
    sample = COMPLETIONS_SAMPLES.get(field, SAMPLES[field]) if path == COMPLETIONS else SAMPLES[field]
    return {**base, "max_tokens": 3, **sample}


@pytest.mark.parametrize(("path", "field"), [(path, f) for path, fields in FIELDS.items() for f in fields])
async def test_each_field_is_honoured_or_refused_by_name(
    gateway: GatewayHandle, path: str, field: str
) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as http:
        response = await http.post(path, content=json.dumps(body_for(path, field)))
    if field in HONOURED[path]:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, f"{field} was accepted: {response.text[:200]}"
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def readme_table() -> dict[str, tuple[str, str]]:
    """The README's "Request fields" table: OpenAI field → (chat cell, completions cell)."""
    text = README.read_text(encoding="utf-8")
    rows = {}
    for line in text[text.index("**Request fields.**") :].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.match(r"\| `(\w+)` \| (\S+) \| (\S+) \|", line)
        if match:
            rows[match[1]] = (match[2], match[3])
    return rows


def test_the_readme_table_says_what_is_honoured_and_refused() -> None:
    def cell(path: str, field: str) -> str:
        if path == COMPLETIONS and field == "response_format":
            return "yes"  # not OpenAI's on completions, but vLLM's (tests/gateway/test_structured.py)
        if field not in FIELDS[path]:
            return "—"
        return "yes" if field in HONOURED[path] else "refused"

    table = readme_table()
    assert set(table) == set(FIELDS[CHAT]) | set(FIELDS[COMPLETIONS])
    for field, cells in table.items():
        assert cells == (cell(CHAT, field), cell(COMPLETIONS, field)), field


async def test_user_is_recorded_on_the_request_span(
    gateway: GatewayHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Mapping[str, object]] = []
    real = pipeline.RequestTrace

    def recording(*args: Any) -> pipeline.RequestTrace:
        seen.append(args[-1])  # the span's attributes
        return real(*args)

    monkeypatch.setattr(pipeline, "RequestTrace", recording)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as http:
        for user in ("u1", None):
            response = await http.post(CHAT, content=json.dumps({**body_for(CHAT, "model"), "user": user}))
            assert response.status_code == 200, response.text
    assert [attributes.get("user.id") for attributes in seen] == ["u1", None]
