"""The whole pipeline, four real processes started by `sluice up`, driven over the WebSocket."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import websockets
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from sluice import plan
from sluice.launcher import access_line
from sluice.plan import LIGHT_NICE, default_engine_threads
from tests.e2e.conftest import STARTUP_DEADLINE_S, Pipeline, launch_pipeline, start_pipeline

pytestmark = pytest.mark.e2e

PROMPTS = ("Once upon a time", "The quick brown fox")
MAX_TOKENS = 24


async def generate_all(url: str, requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Sends every generate on one socket; returns per id the concatenated text and the done frame."""
    results: dict[str, dict[str, Any]] = {r["id"]: {"text": "", "done": None} for r in requests}
    async with websockets.connect(url, max_size=None) as ws:
        for request in requests:
            await ws.send(json.dumps(request))
        while any(r["done"] is None for r in results.values()):
            frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=120))
            assert frame["type"] in ("delta", "done"), frame
            if frame["type"] == "delta":
                assert results[frame["id"]]["done"] is None, "delta after done"
                results[frame["id"]]["text"] += frame["text"]
            else:
                assert results[frame["id"]]["done"] is None, "two done frames"
                results[frame["id"]]["done"] = frame
    return results


def reference(model_dir: Path, prompt: str, max_new_tokens: int) -> tuple[str, int, int]:
    """Greedy text and usage from transformers' own generate on the same model directory."""
    return references(model_dir, [prompt], max_new_tokens)[0]


def references(model_dir: Path, prompts: Sequence[str], max_new_tokens: int) -> list[tuple[str, int, int]]:
    """`reference` of each prompt, the model loaded once."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    out: list[tuple[str, int, int]] = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
        )
        new_ids = generated[0, ids.shape[1] :].tolist()
        out.append((tokenizer.decode(new_ids, skip_special_tokens=True), ids.shape[1], len(new_ids)))
    return out


def greedy_requests(prompts: Sequence[str], max_tokens: int) -> list[dict[str, Any]]:
    """WebSocket generate messages, one per prompt (ids r0, r1, ...), greedy, at most `max_tokens` each."""
    return [
        {
            "type": "generate",
            "id": f"r{i}",
            "prompt": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0},
        }
        for i, prompt in enumerate(prompts)
    ]


def test_two_concurrent_greedy_generations_repeat_exactly(pipeline: Pipeline, tiny_model_dir: Path) -> None:
    first = asyncio.run(generate_all(pipeline.ws_url, greedy_requests(PROMPTS, MAX_TOKENS)))
    second = asyncio.run(generate_all(pipeline.ws_url, greedy_requests(PROMPTS, MAX_TOKENS)))
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        assert first[rid]["text"] == second[rid]["text"]
        text, prompt_tokens, completion_tokens = reference(tiny_model_dir, prompt, MAX_TOKENS)
        done = first[rid]["done"]
        assert first[rid]["text"] == text
        assert done["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": done["usage"]["cached_tokens"],  # the second run finds the first's blocks
        }
        assert done["finish_reason"] == ("length" if completion_tokens == MAX_TOKENS else "stop")


def test_chat_messages_stream_a_reply(pipeline: Pipeline) -> None:
    request = {
        "type": "generate",
        "id": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "params": {"max_tokens": 8, "temperature": 0.7, "seed": 3},
    }
    result = asyncio.run(generate_all(pipeline.ws_url, [request]))["chat"]
    assert result["done"]["finish_reason"] in ("stop", "length")
    assert 0 < result["done"]["usage"]["completion_tokens"] <= 8
    assert result["done"]["usage"]["prompt_tokens"] > 1


def test_chat_page_is_served(pipeline: Pipeline) -> None:
    import httpx

    page = httpx.get(f"http://127.0.0.1:{pipeline.http_port}/", timeout=30)
    assert page.status_code == 200
    assert "/v1/ws" in page.text
    assert httpx.get(f"http://127.0.0.1:{pipeline.http_port}/healthz", timeout=30).status_code == 200


def test_a_child_that_keeps_dying_is_named_and_up_gives_up(tiny_model_dir: Path) -> None:
    """With no restarts allowed, the first death is one too many: every child stops, exit 1.
    (Restarts themselves: tests/e2e/test_restart.py.)"""
    running = start_pipeline(tiny_model_dir, "--max-restarts", "0")
    children = psutil.Process(running.proc.pid).children()
    engine = psutil.Process(running.pids()["engine"])
    assert engine in children
    engine.send_signal(signal.SIGKILL)
    code = running.proc.wait(timeout=60)
    assert code == 1
    assert "engine exited with code -9 (SIGKILL) after 0 restarts within 60s; giving up" in running.output()
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_a_directory_that_is_no_model_stops_up_at_once_with_status_2(tmp_path: Path) -> None:
    """No config.json: `sluice up` refuses it before starting anything (status 2, the message)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    running = launch_pipeline(empty)
    assert running.proc.wait(timeout=120) == 2, running.output()
    running.ready.wait(30)  # the output is all read
    assert str(empty) in running.output() and "started" not in running.output()


def test_a_model_the_services_refuse_stops_up_at_once_with_status_2(tmp_path: Path) -> None:
    """A directory with a config.json of a model type nothing serves and no tokenizer: the first service
    to refuse it exits with status 2 (a configuration error, its message logged alone); `sluice up`
    says so, restarts nothing, stops the rest and exits 2 (it used to restart the engine five times
    over 45 s, and a service that found a file missing crashed with a traceback, restarted too)."""
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    (bogus / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["Nope"]}))
    running = launch_pipeline(bogus)
    assert running.proc.wait(timeout=STARTUP_DEADLINE_S) == 2, running.output()
    running.ready.wait(30)
    out = running.output()
    assert "refused its configuration" in out and "not restarting it" in out, out
    assert "services.common.grpc_server ERROR" in out, out  # the service's own message, alone
    assert "restarting it in" not in out and "sluice is up" not in out, out
    started = [line for line in out.splitlines() if " started (pid " in line]
    assert len(started) == 4, started  # each child once: no restart


def test_sigterm_stops_every_child(tiny_model_dir: Path) -> None:
    running = start_pipeline(tiny_model_dir, "--standby", "1")
    # The four services and their standbys by now. A service is known by its start line's pid, not by its
    # command line: a standby between fork and exec still shows the launcher's.
    children = psutil.Process(running.proc.pid).children()
    services = running.pids()
    assert sorted(services) == ["detokenizer", "engine", "gateway", "tokenizer"], running.output()
    assert set(services.values()) <= {c.pid for c in children}, [c.cmdline() for c in children]
    assert running.stop(signal.SIGTERM) == 0
    psutil.wait_procs(children, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_up_says_whether_the_apis_are_open(pipeline: Pipeline) -> None:
    assert "every API is open" in pipeline.output()
    assert "required" in access_line({"SLUICE_API_KEYS": "k1"})
    assert "required" in access_line({"SLUICE_API_KEYS_FILE": "/keys"})


def _nice(pid: int) -> int:
    """The nice value of process `pid`'s main thread (field 19 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[16])


def test_the_light_stages_run_at_a_lower_priority_than_the_engine(pipeline: Pipeline) -> None:
    """`sluice up`'s default: the engine at the launcher's nice value with the threads its start-up line
    names (one per usable core, one less on a busy host), the tokenizer, detokenizer and gateway
    LIGHT_NICE lower."""
    launcher_nice = _nice(pipeline.proc.pid)
    nice = {name: _nice(pid) for name, pid in pipeline.pids().items()}
    light = min(19, launcher_nice + LIGHT_NICE)
    assert nice == {"tokenizer": light, "engine": launcher_nice, "detokenizer": light, "gateway": light}
    line = next(line for line in pipeline.lines if "torch thread(s)" in line)
    threads = int(line.split("engine: ")[1].split()[0])
    assert threads in (default_engine_threads(0.0), default_engine_threads(plan.BUSY_LOAD)), line
    assert f"nice +{LIGHT_NICE}" in line
    engine_cmdline = psutil.Process(pipeline.pids()["engine"]).cmdline()
    assert engine_cmdline[engine_cmdline.index("--threads") + 1] == str(threads)


def test_the_default_engines_are_the_ones_named_and_serve_greedy_text(tiny_model_dir: Path) -> None:
    """`--engines auto` (`sluice up`'s default): the engines started are those its start-up line counts,
    each with the threads that line names, the light stages at their priority (LIGHT_NICE lower beside
    one engine, the same beside several), and greedy text through them equals `generate`."""
    running = start_pipeline(tiny_model_dir, "--engines", "auto")
    try:
        line = next(line for line in running.lines if "torch thread(s)" in line)
        count = int(line.split("nice +0, ")[1].split()[0])
        threads = line.split("engine: ")[1].split()[0]
        engines = plan.replica_names("engine", count)
        assert sorted(n for n in running.pids() if n.startswith("engine")) == engines, running.output()
        for name in engines:
            cmdline = psutil.Process(running.pids()[name]).cmdline()
            assert cmdline[cmdline.index("--threads") + 1] == threads
        launcher_nice = _nice(running.proc.pid)
        light = launcher_nice if count > 1 else min(19, launcher_nice + LIGHT_NICE)
        nice = {name: _nice(pid) for name, pid in running.pids().items() if not name.startswith("engine")}
        assert set(nice.values()) == {light}, (nice, line)
        prompts = PROMPTS * 2  # more requests than engines: the gateway spreads them
        results = asyncio.run(generate_all(running.ws_url, greedy_requests(prompts, MAX_TOKENS)))
    finally:
        code = running.stop()
    assert code == 0, running.output()
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"]["text"] == reference(tiny_model_dir, prompt, MAX_TOKENS)[0]
