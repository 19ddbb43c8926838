"""The benchmark launcher: a `Stack` of the four sluice services, started on free loopback ports and stopped
without leaving a process behind."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import psutil
import pytest

from sluice import launcher, plan, ports
from sluice.bench.stack import Stack, StackOptions
from sluice.plan import LIGHT_NICE
from sluice.ports import free_port_run

pytestmark = pytest.mark.e2e
SERVICES = {"tokenizer", "engine", "detokenizer", "gateway"}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, resp.read()


def test_free_port_run_is_bindable() -> None:
    first = free_port_run(3)
    for port in range(first, first + 3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_stack_starts_serves_and_stops_every_service(tiny_model_dir: Path) -> None:
    stack = Stack(StackOptions(str(tiny_model_dir)))
    with stack:
        assert set(stack.pids) == SERVICES
        assert all(_alive(pid) for pid in stack.pids.values())
        status, body = _get(f"{stack.http_url}/readyz")
        assert status == 200 and json.loads(body)["status"] == "ready"
        assert set(stack.metrics_urls) == SERVICES
        status, body = _get(stack.metrics_urls["engine"])
        assert status == 200 and b"# TYPE" in body
        cpu = stack.cpu_seconds()
        assert set(cpu) == SERVICES and all(seconds > 0 for seconds in cpu.values())
        assert stack.openai_url == f"{stack.http_url}/v1"
    assert not any(_alive(pid) for pid in stack.pids.values())


def test_a_service_that_dies_at_start_up_is_named_with_its_output(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    stack = Stack(StackOptions(str(empty), metrics=False, startup_timeout_s=120))
    with pytest.raises(RuntimeError) as failure:
        stack.start()
    message = str(failure.value)
    assert message.split(" ")[0] in {"tokenizer", "engine", "detokenizer"}
    assert "exited with code" in message and "its last output:" in message
    assert len(message.splitlines()) > 1
    assert set(stack.pids) == SERVICES
    assert not any(_alive(pid) for pid in stack.pids.values())


def test_up_flags_set_the_stacks_cpu_policy(tiny_model_dir: Path) -> None:
    """`StackOptions.up_flags` are `sluice up` flags: the old policy's one engine thread and no nice
    for the light stages; without them the light stages run LIGHT_NICE lower (nothing is started)."""
    old = Stack(StackOptions(str(tiny_model_dir), up_flags=("--engine-threads", "1", "--light-nice", "0")))
    engine = next(c for c in old._children if c.kind == "engine")
    assert engine.flags[engine.flags.index("--threads") + 1] == "1"
    assert {c.nice for c in old._children} == {0}
    new = Stack(StackOptions(str(tiny_model_dir)))
    assert {c.kind: c.nice for c in new._children} == {
        "tokenizer": LIGHT_NICE,
        "engine": 0,
        "detokenizer": LIGHT_NICE,
        "gateway": LIGHT_NICE,
    }


def test_ports_are_reserved_for_every_replica_auto_engines_start(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `--engines auto` (engines=0) the replicas are counted after the plan resolves them: every
    child's gRPC and metrics port is distinct and reserved by the picker, and each replica's metrics URL
    is its own port (nothing is started)."""
    monkeypatch.setattr(launcher, "host_load", lambda: 0.0)
    monkeypatch.setattr(plan, "usable_cores", lambda: 3)
    stack = Stack(StackOptions(str(tiny_model_dir), engines=0, up_flags=("--tokenizers", "2")))
    replicas = [c for c in stack._children if c.kind != "gateway"]
    assert [c.kind for c in replicas].count("engine") == 3 and len(replicas) == 6
    metrics = [int(c.flags[c.flags.index("--metrics-port") + 1]) for c in replicas]
    grpc = [c.grpc_port for c in stack._children]
    http = int(stack.http_url.rsplit(":", 1)[1])
    used = [*grpc, *metrics, http]
    assert len(set(used)) == len(used)
    assert set(used) <= ports._handed_out
    assert stack.metrics_urls == {"gateway": f"{stack.http_url}/metrics"} | {
        c.name: f"http://127.0.0.1:{port}/metrics" for c, port in zip(replicas, metrics, strict=True)
    }


def test_the_setup_names_the_engines_threads_and_dtype(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Stack.setup`, the note of sluice's row in a side-by-side table, says what the plan gave the engines:
    their count and threads, and the dtype asked for (an engine flag over SLUICE_DTYPE); nothing starts."""
    monkeypatch.setattr(launcher, "host_load", lambda: 0.0)
    monkeypatch.setattr(plan, "usable_cores", lambda: 2)
    monkeypatch.delenv("SLUICE_DTYPE", raising=False)
    model = str(tiny_model_dir)
    assert Stack(StackOptions(model, up_flags=("--engine-threads", "2"))).setup == "1 engine, 2 threads"
    assert Stack(StackOptions(model, engines=0)).setup == "2 engines, 1 thread each"
    env = {"SLUICE_DTYPE": "bfloat16"}
    assert Stack(StackOptions(model, env=env, up_flags=("--engine-threads", "1"))).setup == (
        "1 engine, 1 thread, bfloat16"
    )
    asked = StackOptions(model, env=env, engine_flags=("--dtype", "float32", "--threads", "2"))
    assert Stack(asked).setup == "1 engine, 2 threads, float32"
