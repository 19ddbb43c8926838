"""`compose.yaml` run for real: the image built, the stack started in containers under docker-compose 1.29
and Compose v2, streamed over HTTP and WebSocket, scaled to two engines, an engine killed, and removed.

Run by `make compose` (which installs the engine and both Compose generations, starts dockerd, builds the
image's base from Debian's packages and sets SLUICE_COMPOSE_TEST=1); `make test` does not collect it
(tests/deploy/conftest.py). The gateway's ports are chosen free on 127.0.0.1's side and every request goes
to 127.0.0.1. One project name and one `models` volume serve both generations, so the embedded model is
trained once: 1.29 runs first and leaves the volume, v2 runs second and removes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from sluice.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROJECT = f"sluicecompose{os.getpid()}"
IMAGE = "sluice:latest"
BASE_IMAGE = os.environ.get("SLUICE_BASE_IMAGE", "sluice-base:bookworm")
UP_DEADLINE_S = 900.0  # the model job trains the embedded model (150 s) on a busy 2-core machine
REQUEST_TIMEOUT_S = 180.0
BUILD_TIMEOUT_S = 1800.0  # the image without a layer cache: torch and the paged kernel
# The suite's 300 s per test would cut the first test short: it holds the image's build (139 s without a
# cache on a fresh machine) and the model's training before its stack serves; each part has its own bound.
pytestmark = pytest.mark.timeout(int(BUILD_TIMEOUT_S + UP_DEADLINE_S + 4 * REQUEST_TIMEOUT_S))

V1 = ["docker-compose"]
V2 = ["docker", "compose"]


@pytest.fixture(scope="module")
def stack_env() -> dict[str, str]:
    """The environment both Compose generations run with: the CPU engine, no observability services, the
    base from Debian's packages, and free host ports for the gateway."""
    env = dict(os.environ)
    env.update(
        COMPOSE_PROFILES="cpu",
        SLUICE_OTLP_ENDPOINT="",
        SLUICE_BASE_IMAGE=BASE_IMAGE,
        SLUICE_TORCH_VARIANT="cpu",
        SLUICE_HTTP_PORT=str(free_port()),
        SLUICE_GRPC_PORT=str(free_port()),
    )
    return env


def compose(cli: list[str], env: dict[str, str], *args: str, timeout: float = 600.0) -> str:
    """Runs `cli -p PROJECT ARGS` in the project root; its output, or a failure with both streams."""
    result = subprocess.run(
        [*cli, "-p", PROJECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{' '.join([*cli, *args])}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def image() -> str:
    """The sluice image on the Debian base, CPU torch (layers cached between runs)."""
    started = time.monotonic()
    result = subprocess.run(
        [
            "docker",
            "build",
            "--network",
            "host",
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            "--build-arg",
            "TORCH_VARIANT=cpu",
            "-t",
            IMAGE,
            ".",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"\nimage {IMAGE} built in {time.monotonic() - started:.0f} s")
    return IMAGE


@pytest.fixture(scope="module")
def teardown(stack_env: dict[str, str]) -> Iterator[None]:
    """Whatever happens, the project's containers and volume are removed at the end."""
    yield
    for cli in (V1, V2):
        subprocess.run(
            [*cli, "-p", PROJECT, "down", "--volumes", "--remove-orphans", "-t", "5"],
            cwd=ROOT,
            env=stack_env,
            capture_output=True,
            timeout=300,
        )


def wait_ready(env: dict[str, str], cli: list[str]) -> float:
    """Waits for the gateway's /readyz (every stage has a serving replica); seconds waited."""
    url = f"http://127.0.0.1:{env['SLUICE_HTTP_PORT']}/readyz"
    started = time.monotonic()
    last = ""
    while time.monotonic() - started < UP_DEADLINE_S:
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return time.monotonic() - started
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(2)
    logs = compose(cli, env, "logs", "--tail", "40")
    raise AssertionError(f"the gateway was not ready in {UP_DEADLINE_S:.0f} s ({last}):\n{logs[-6000:]}")


def served_model(env: dict[str, str]) -> str:
    response = httpx.get(f"http://127.0.0.1:{env['SLUICE_HTTP_PORT']}/v1/models", timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["data"][0]["id"])


def stream_chat(env: dict[str, str], content: str = "Say hello.") -> tuple[str, str]:
    """One streamed chat completion over HTTP/SSE; (the text, its finish reason)."""
    url = f"http://127.0.0.1:{env['SLUICE_HTTP_PORT']}/v1/chat/completions"
    body = {
        "model": served_model(env),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    text, finish = "", ""
    with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


async def ws_chat(env: dict[str, str]) -> dict[str, object]:
    """One chat over the WebSocket; the done frame with the concatenated text under "text"."""
    url = f"ws://127.0.0.1:{env['SLUICE_HTTP_PORT']}/v1/ws"
    request = {
        "type": "generate",
        "id": "c1",
        "messages": [{"role": "user", "content": "hi"}],
        "params": {"max_tokens": 12, "temperature": 0},
    }
    text = ""
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps(request))
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=REQUEST_TIMEOUT_S))
            assert frame["type"] in ("delta", "done"), frame
            if frame["type"] == "delta":
                text += frame["text"]
            else:
                return {**frame, "text": text}


def check_serving(env: dict[str, str]) -> str:
    text, finish = stream_chat(env)
    assert finish in ("stop", "length")
    assert text
    done = asyncio.run(ws_chat(env))
    assert done["finish_reason"] in ("stop", "length"), done
    usage = done["usage"]
    assert isinstance(usage, dict) and 0 < usage["completion_tokens"] <= 12
    return text


def engine_containers(env: dict[str, str], cli: list[str]) -> list[str]:
    ids = compose(cli, env, "ps", "-q", "engine-cpu").split()
    assert ids, "no engine container"
    return ids


def generated_tokens(container: str) -> float:
    """sluice_generation_tokens_total of the engine in `container` (its metrics port, read inside)."""
    probe = (
        "import urllib.request;"
        "print(urllib.request.urlopen('http://127.0.0.1:9090/metrics', timeout=5).read().decode())"
    )
    result = subprocess.run(
        ["docker", "exec", container, "python", "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    total = 0.0
    for line in result.stdout.splitlines():
        if line.startswith("sluice_generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_engines_serving(env: dict[str, str], cli: list[str], count: int) -> list[str]:
    """Waits until `count` engine containers report healthy; their ids."""
    deadline = time.monotonic() + UP_DEADLINE_S
    while time.monotonic() < deadline:
        ids = engine_containers(env, cli)
        states = [
            subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Health.Status}}", cid], capture_output=True, text=True
            ).stdout.strip()
            for cid in ids
        ]
        if len(ids) == count and all(state == "healthy" for state in states):
            return ids
        time.sleep(2)
    raise AssertionError(f"{count} healthy engines not reached: {states}")


def test_docker_compose_v1_runs_the_stack(image: str, stack_env: dict[str, str], teardown: None) -> None:
    """docker-compose 1.29 accepts the file, starts the CPU stack and serves, the engine on the CPU paged
    kernel the image built; `down` keeps the volume."""
    compose(V1, stack_env, "config", "--quiet")
    started = time.monotonic()
    try:
        compose(V1, stack_env, "up", "-d", timeout=UP_DEADLINE_S)
        ready = wait_ready(stack_env, V1)
        took = time.monotonic() - started
        print(f"\ndocker-compose 1.29: up and ready in {took:.0f} s (ready wait {ready:.0f} s)")
        check_serving(stack_env)
        engine_log = compose(V1, stack_env, "logs", "--no-color", "engine-cpu")
        assert "CPU kernels ready" in engine_log, engine_log[-4000:]
    finally:
        compose(V1, stack_env, "down", "-t", "10")


def test_compose_v2_runs_scales_recovers_and_goes_down(
    image: str, stack_env: dict[str, str], teardown: None
) -> None:
    """Compose v2: up, stream over HTTP and WebSocket, two engines both taking traffic, an engine killed
    and the stack serving again, then `down --volumes`."""
    compose(V2, stack_env, "config", "--quiet")
    started = time.monotonic()
    compose(V2, stack_env, "up", "-d", timeout=UP_DEADLINE_S)
    ready = wait_ready(stack_env, V2)
    print(f"\nCompose v2: up and ready in {time.monotonic() - started:.0f} s (ready wait {ready:.0f} s)")
    check_serving(stack_env)

    compose(V2, stack_env, "up", "-d", "--no-recreate", "--scale", "engine-cpu=2", timeout=UP_DEADLINE_S)
    engines = wait_engines_serving(stack_env, V2, 2)
    before = {cid: generated_tokens(cid) for cid in engines}
    # Distinct prompts, several at a time, until both engines have produced tokens (the gateway re-resolves
    # the engine name every 10 s, so the second replica joins the rotation within that).
    deadline = time.monotonic() + 300
    grown: set[str] = set()
    while grown != set(engines) and time.monotonic() < deadline:
        for i in range(6):
            stream_chat(stack_env, f"Count to {i} and say {time.monotonic():.3f}.")
        grown = {cid for cid in engines if generated_tokens(cid) > before[cid]}
    assert grown == set(engines), f"engines that took traffic: {sorted(grown)} of {engines}"

    # An engine dies (its process SIGKILLed from the host: Docker sees a crash; `docker kill` would count
    # as a manual stop, which no restart policy undoes). The survivor serves meanwhile, and Docker
    # restarts the dead one (restart: unless-stopped).
    victim = engines[0]
    pid = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Pid}}", victim], capture_output=True, text=True, check=True
    ).stdout.strip()
    os.kill(int(pid), signal.SIGKILL)
    check_serving(stack_env)
    wait_engines_serving(stack_env, V2, 2)
    wait_ready(stack_env, V2)
    check_serving(stack_env)

    compose(V2, stack_env, "down", "--volumes", "-t", "10")
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"name={PROJECT}"], capture_output=True, text=True
    ).stdout.split()
    assert volumes == []
