"""The fault schedule (issue 21): one `sluice up --tokenizers 2 --engines 2 --detokenizers 2` under steady
load while a seeded schedule breaks random stage replicas at random moments.

Load: WebSocket and SSE clients, each sending one greedy request after another (32 new tokens, one of
a few prompts; half a second's pause after a failed one), every completed text compared with a lone run
of the same prompt (transformers' `generate` on the same model directory, before the stack starts).

Beside it, a pathological client sends every 2-5 s a request whose constraint the grammar engine cannot
take (a `choice` of 2,001 strings, a JSON schema `anyOf` of 3,000 branches): each must get an answer
of its own (400, an error of its own, or a completion), and the other clients' texts stay exact.

Faults, one kind after another in a shuffled order per round, every 1-6 s on a random replica that is
not still recovering (so they overlap): SIGKILL; SIGSTOP for longer than the launcher's health timeout,
then SIGCONT; the engine fault hook (SLUICE_FAULT_INJECTION=1 and SIGUSR1: the step loop fails; the
engine recovers in its process within its budget, else stays up NOT_SERVING until the launcher restarts
it; SIGUSR2: the model runner raises on every step for RUNNER_FAULT_S, each such step failing its own
requests `internal`). `sluice up` runs with its defaults otherwise, a warm standby per stage kind
included. The first fault comes within a second of the ready line, and a third of the replicas coming
back get another within a second of answering SERVING again.

Checks: every request completes with exactly the lone run's text, or ends with an `unavailable` error
within FAILED_WITHIN_S of a fault, or `internal` within that of a runner's raising (never another error,
never a hang); after each fault the gateway's
/readyz names the fault's stage ready again (a replica of it SERVING) within READY_WITHIN_S of the last
fault on that stage (both replicas of a stage can be down at once; other stages' faults are their own),
and the faulted replica comes back (replaced or resumed, SERVING, and named serving by /readyz: the
recovery time of the summary); afterwards every engine's KV
free list is full, nothing runs or waits there and the gateway has nothing in flight (the engines' Stats
RPC and the gateway's in-flight gauge, as tests/reliability/conftest.py reads them); `sluice up` never
gave up.

SLUICE_CHAOS_S sets the duration of the load (60 s by default, 180 s under `make chaos`),
SLUICE_CHAOS_SEED the schedule's seed, and SLUICE_CHAOS_SUMMARY the path of a JSON summary (requests,
faults by kind, failovers, errors, recovery times p50/p99); without it the summary goes to the test's
temporary directory; beside it, NAME.log holds what `sluice up` and its children printed. Both are
written before the checks run, so a failing run still leaves them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
import torch
import websockets
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from gateway.settings import GatewaySettings
from services.common.pb import engine_pb2, engine_pb2_grpc
from services.engine.server import RUNNER_FAULT_S
from tests.e2e.conftest import Pipeline, start_pipeline

CHAOS_S = float(os.environ.get("SLUICE_CHAOS_S", "60"))
SEED = int(os.environ.get("SLUICE_CHAOS_SEED", "21"))
SUMMARY_ENV = "SLUICE_CHAOS_SUMMARY"

pytestmark = [pytest.mark.chaos, pytest.mark.e2e, pytest.mark.timeout(int(CHAOS_S) + 900)]

REPLICAS = 2
STAGES = ("tokenizer", "engine", "detokenizer")  # the launcher's port order
KINDS = ("kill", "stop", "fail", "raise")
ENGINE_ONLY = ("fail", "raise")  # kinds only an engine can take (its fault hook)
HEALTH_TIMEOUT_S = 1.0
UNHEALTHY_RESTART_S = 3.0
UP_FLAGS = (
    *(flag for stage in STAGES for flag in (f"--{stage}s", str(REPLICAS))),
    "--health-timeout-s", str(HEALTH_TIMEOUT_S),
    "--unhealthy-restart-s", str(UNHEALTHY_RESTART_S),
    "--max-restarts", "30",  # the schedule kills far more often than the policy is meant for
    "--standby", "1",  # sluice up's default, which the suite's other pipelines turn off
)  # fmt: skip
# A request that finds no replica of a stage waits for one up to the gateway's upstream wait, then fails.
FAILED_WITHIN_S = GatewaySettings().upstream_wait_s + 5.0
READY_WITHIN_S = 15.0
STOP_S = (HEALTH_TIMEOUT_S + 0.5, 5.0)  # how long a SIGSTOP lasts: some outlast --unhealthy-restart-s
GIVE_UP_S = 90.0  # a fault not recovered from this long is recorded as never recovered
GAP_S = (1.0, 6.0)  # between two scheduled faults
HANG_S = 60.0  # a request with no end this long after it was sent has hung
RETRY_PAUSE_S = 0.5  # a client's pause after a failed request
QUIET_WITHIN_S = 60.0
WS_CLIENTS = 3
SSE_CLIENTS = 3
MAX_TOKENS = 32
PATHOLOGICAL_GAP_S = (2.0, 5.0)  # between two requests of the pathological client
# Constraints past what the grammar engine takes (a row of more than 2,000 items), or slow to compile: a
# `choice` of 2,001 strings, and a JSON schema whose anyOf has 3,000 branches.
PATHOLOGICAL = (
    {"choice": [f"option {i:04d}" for i in range(2001)]},
    {"json": {"type": "object", "properties": {"k": {"anyOf": [{"const": i} for i in range(3000)]}},
              "required": ["k"], "additionalProperties": False}},
)  # fmt: skip
PROMPTS = (
    "Once upon a time",
    "The quick brown fox",
    "def main():",
    "In the beginning the sea was",
    "import os\nimport sys\n",
    "A list of colours: red,",
)


@dataclass
class Outcome:
    """How one request ended: `exact`, `mismatch`, `unavailable`, `error` or `hung`."""

    api: str
    prompt: str
    sent: float
    ended: float
    kind: str
    detail: str = ""


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    pid: int
    stop_s: float = 0.0
    recovered_before: int = 0  # a failed loop: the engine's in-process recoveries logged before it
    ready_s: float | None = None  # until /readyz next named the fault's stage ready
    recovery_s: float | None = None  # until the replica was back, SERVING, and seen so by the gateway
    resumed: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def stage(self) -> str:
        """The stage kind of the target: `engine` for `engine-2`."""
        return self.target.rsplit("-", 1)[0]


def lone_runs(model_dir: Path) -> dict[str, str]:
    """Each prompt's greedy text from transformers' own `generate`, one prompt at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GenerationConfig.from_pretrained(model_dir)
    texts = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=config.eos_token_id, pad_token_id=0
        )
        texts[prompt] = tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    return texts


# ----- load


class Load:
    """Clients that send one request after another until `until`; `outcomes` collects every end."""

    def __init__(self, pipeline: Pipeline, model: str, references: dict[str, str], seed: int) -> None:
        self.pipeline = pipeline
        self.model = model
        self.references = references
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.pathological: list[Outcome] = []  # the pathological client's, apart: never "exact"
        self.until = 0.0

    def judge(self, api: str, prompt: str, sent: float, text: str) -> Outcome:
        exact = text == self.references[prompt]
        detail = "" if exact else f"got {text!r}, lone run {self.references[prompt]!r}"
        return Outcome(api, prompt, sent, time.monotonic(), "exact" if exact else "mismatch", detail)

    def failed(self, api: str, prompt: str, sent: float, code: str, message: str) -> Outcome:
        kind = "unavailable" if code == "unavailable" else "error"
        return Outcome(api, prompt, sent, time.monotonic(), kind, f"{code}: {message}")

    async def ws_client(self, n: int) -> None:
        count = 0
        while time.monotonic() < self.until:
            try:
                async with websockets.connect(self.pipeline.ws_url, max_size=None) as ws:
                    while time.monotonic() < self.until:
                        count += 1
                        await self.record(await self.ws_request(ws, f"w{n}-{count}"))
            except (OSError, websockets.ConnectionClosed) as exc:
                now = time.monotonic()
                await self.record(Outcome("ws", "", now, now, "error", f"socket lost: {exc!r}"))

    async def record(self, outcome: Outcome) -> None:
        """Keeps the outcome; after a failure the client pauses, as a client backing off would (sending
        again at once turns an outage into a storm that starves the restarts of CPU)."""
        self.outcomes.append(outcome)
        if outcome.kind != "exact":
            await asyncio.sleep(RETRY_PAUSE_S)

    async def ws_request(self, ws: Any, rid: str) -> Outcome:
        prompt = self.rng.choice(PROMPTS)
        sent = time.monotonic()
        params = {"max_tokens": MAX_TOKENS, "temperature": 0}
        await ws.send(json.dumps({"type": "generate", "id": rid, "prompt": prompt, "params": params}))
        text = ""
        try:
            async with asyncio.timeout(HANG_S):
                while True:
                    frame = json.loads(await ws.recv())
                    if frame.get("id") != rid:
                        continue
                    if frame["type"] == "delta":
                        text += frame["text"]
                    elif frame["type"] == "done":
                        return self.judge("ws", prompt, sent, text)
                    else:
                        return self.failed(
                            "ws", prompt, sent, frame.get("code", ""), frame.get("message", "")
                        )
        except TimeoutError:
            return Outcome("ws", prompt, sent, time.monotonic(), "hung", f"no end after {HANG_S:g}s")

    async def sse_client(self) -> None:
        async with httpx.AsyncClient(base_url=self.pipeline.http_url, timeout=HANG_S) as http:
            while time.monotonic() < self.until:
                await self.record(await self.sse_request(http))

    async def sse_request(self, http: httpx.AsyncClient) -> Outcome:
        prompt = self.rng.choice(PROMPTS)
        sent = time.monotonic()
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True}  # fmt: skip
        text = ""
        try:
            async with asyncio.timeout(HANG_S), http.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    error = json.loads(await reply.aread()).get("error", {})
                    return self.failed("sse", prompt, sent, error.get("code", ""), error.get("message", ""))
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        return self.failed(
                            "sse", prompt, sent, error.get("code", ""), error.get("message", "")
                        )
                    text += "".join(choice.get("text") or "" for choice in event["choices"])
            return self.judge("sse", prompt, sent, text)
        except TimeoutError:
            return Outcome("sse", prompt, sent, time.monotonic(), "hung", f"no end after {HANG_S:g}s")
        except httpx.HTTPError as exc:
            return Outcome("sse", prompt, sent, time.monotonic(), "error", f"connection: {exc!r}")

    async def pathological_client(self) -> None:
        """Sends, beside the exact traffic, a request whose constraint the grammar engine cannot take
        (PATHOLOGICAL, in turn) every PATHOLOGICAL_GAP_S: each must end, refused (400) or failed alone
        with an error of its own, or completed, while the other clients' texts stay exact."""
        async with httpx.AsyncClient(base_url=self.pipeline.http_url, timeout=HANG_S) as http:
            count = 0
            while time.monotonic() < self.until:
                constraint = PATHOLOGICAL[count % len(PATHOLOGICAL)]
                count += 1
                self.pathological.append(await self.pathological_request(http, constraint))
                await asyncio.sleep(self.rng.uniform(*PATHOLOGICAL_GAP_S))

    async def pathological_request(self, http: httpx.AsyncClient, constraint: dict[str, Any]) -> Outcome:
        what = next(iter(constraint))
        body = {"model": self.model, "prompt": "Pick one:", "max_tokens": 8, "temperature": 0,
                "structured_outputs": constraint}  # fmt: skip
        sent = time.monotonic()
        try:
            reply = await http.post("/v1/completions", json=body)
        except httpx.TimeoutException:
            return Outcome("pathological", what, sent, time.monotonic(), "hung", f"no end after {HANG_S:g}s")
        except httpx.HTTPError as exc:
            return Outcome("pathological", what, sent, time.monotonic(), "error", f"connection: {exc!r}")
        ended = time.monotonic()
        if reply.status_code == 200:
            return Outcome("pathological", what, sent, ended, "completed", reply.json()["choices"][0]["text"])
        error = reply.json().get("error", {})
        kind = "refused" if reply.status_code == 400 else "failed"
        return Outcome("pathological", what, sent, ended, kind, f"{reply.status_code} {error.get('code')}: "
                       f"{str(error.get('message'))[:200]}")  # fmt: skip

    async def run(self, duration_s: float) -> None:
        self.until = time.monotonic() + duration_s
        clients = [self.ws_client(n) for n in range(WS_CLIENTS)] + [
            self.sse_client() for _ in range(SSE_CLIENTS)
        ]
        await asyncio.gather(*clients, self.pathological_client())


# ----- faults


def replica_ports(pipeline: Pipeline) -> dict[str, int]:
    """Each stage replica's gRPC port, in the launcher's plan (consecutive from the base + 1)."""
    names = [f"{stage}-{i}" for stage in STAGES for i in range(1, REPLICAS + 1)]
    return {name: pipeline.grpc_base_port + 1 + offset for offset, name in enumerate(names)}


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def readyz(pipeline: Pipeline) -> dict[str, Any] | None:
    """The body of /readyz, ready (200) or not (503: it names each stage's readiness too); None when the
    gateway gave no such answer."""
    try:
        with urllib.request.urlopen(f"{pipeline.http_url}/readyz", timeout=5.0) as reply:
            return dict(json.loads(reply.read()))
    except urllib.error.HTTPError as error:
        return dict(json.loads(error.read())) if error.code == 503 else None
    except (OSError, ValueError):
        return None


def stages(body: dict[str, Any] | None) -> dict[str, Any]:
    """The stages a /readyz body names (none for an answer without them)."""
    return dict(body.get("stages", {})) if body is not None else {}


def stage_ready(pipeline: Pipeline, stage: str) -> bool:
    """/readyz names `stage` ready: a replica of it answers SERVING."""
    return bool(stages(readyz(pipeline)).get(stage, {}).get("ready"))


class Schedule:
    """The seeded fault schedule; `faults` lists every fault injected, with its times.

    A fault comes every GAP_S (uniform) on a replica not still recovering from one, so faults overlap
    (both replicas of a stage can be down at once); and a third of the replicas coming back get another
    fault within a second of answering SERVING again."""

    def __init__(self, pipeline: Pipeline, seed: int) -> None:
        self.pipeline = pipeline
        self.rng = random.Random(seed)
        self.ports = replica_ports(pipeline)
        self.faults: list[Fault] = []
        self.recovering: set[str] = set()
        self._kinds: list[str] = []
        self._watches: list[asyncio.Task[None]] = []
        self._until = 0.0

    def inject(self, kind: str, target: str) -> Fault:
        pid = self.pipeline.pids()[target]
        victim = psutil.Process(pid)
        fault = Fault(kind, target, time.monotonic(), pid)
        if kind == "kill":
            victim.send_signal(signal.SIGKILL)
        elif kind == "fail":
            fault.recovered_before = self.recoveries(pid)
            victim.send_signal(signal.SIGUSR1)
        elif kind == "raise":
            victim.send_signal(signal.SIGUSR2)
        else:
            fault.stop_s = self.rng.uniform(*STOP_S)
            victim.suspend()
            fault.resumed = asyncio.ensure_future(self._resume(victim, fault.stop_s))
        print(f"chaos: {kind} {target} (pid {pid}) at {fault.at:.1f}", flush=True)
        self.faults.append(fault)
        self.recovering.add(target)
        self._watches.append(asyncio.ensure_future(self._watch(fault)))
        return fault

    def recoveries(self, pid: int) -> int:
        """How many in-process recoveries of its step loop the engine `pid` has logged so far."""
        return self.pipeline.output().count(f"(pid {pid}): step loop recovered")

    @staticmethod
    async def _resume(victim: psutil.Process, after_s: float) -> None:
        await asyncio.sleep(after_s)
        if victim.is_running():  # not replaced by the launcher meanwhile (psutil checks the pid's age)
            victim.resume()

    async def _watch(self, fault: Fault) -> None:
        """Records when /readyz is next ready and when the replica is back; then, one time in three, the
        replica gets the next fault within a second."""
        await asyncio.gather(self._ready(fault), self._back(fault))
        self.recovering.discard(fault.target)
        if fault.recovery_s is not None and time.monotonic() < self._until and self.rng.random() < 1 / 3:
            await asyncio.sleep(self.rng.uniform(0.0, 1.0))
            if fault.target not in self.recovering:
                self.inject(self._kind(fault.target), fault.target)

    async def _ready(self, fault: Fault) -> None:
        """The first /readyz asked after the fault that names the fault's stage ready."""
        while not await asyncio.to_thread(stage_ready, self.pipeline, fault.stage):
            if time.monotonic() > fault.at + GIVE_UP_S:
                return
            await asyncio.sleep(0.05)
        fault.ready_s = time.monotonic() - fault.at

    async def _back(self, fault: Fault) -> None:
        """The replica is back: a new process after a kill, resumed or replaced after a stop, recovered
        in its process (its log says so) or replaced after a failed loop; SERVING; and /readyz names it
        serving."""
        port = self.ports[fault.target]
        stage, number = fault.target.rsplit("-", 1)  # `engine-2`: the second of the gateway's engines

        def back() -> bool:
            replaced = self.pipeline.pids().get(fault.target) != fault.pid
            resumed = fault.resumed is not None and fault.resumed.done()
            recovered = fault.kind == "fail" and self.recoveries(fault.pid) > fault.recovered_before
            over = fault.kind == "raise" and time.monotonic() > fault.at + RUNNER_FAULT_S
            return replaced or resumed or recovered or over

        def seen() -> bool:
            named = stages(readyz(self.pipeline)).get(stage)  # ready or not: other stages' faults are theirs
            return named is not None and bool(named["replicas"][int(number) - 1])

        for condition in (back, lambda: serving(port), seen):
            while not await asyncio.to_thread(condition):
                if time.monotonic() > fault.at + GIVE_UP_S:
                    return
                await asyncio.sleep(0.05)
        fault.recovery_s = time.monotonic() - fault.at

    def _kind(self, target: str | None = None) -> str:
        """The next kind in this round's shuffled order that `target` can take (fail: engines only)."""
        if not self._kinds:
            self._kinds.extend(self.rng.sample(KINDS, len(KINDS)))
        for kind in reversed(self._kinds):
            if target is None or kind not in ENGINE_ONLY or target.startswith("engine"):
                self._kinds.remove(kind)
                return kind
        return "kill"

    async def run(self, until: float) -> None:
        """Injects faults until `until`, then waits for every replica to be back (or given up on)."""
        self._until = until
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))  # within a second of the ready line
        while time.monotonic() < until:
            kind = self._kind()
            takes = [n for n in self.ports if kind not in ENGINE_ONLY or n.startswith("engine")]
            free = [n for n in takes if n not in self.recovering]
            if free:
                self.inject(kind, self.rng.choice(free))
            await asyncio.sleep(self.rng.uniform(*GAP_S))
        while not all(task.done() for task in self._watches):
            await asyncio.gather(*self._watches)


# ----- afterwards


async def engine_figures(port: int) -> engine_pb2.StatsResponse | None:
    """The engine's Stats; None while it cannot answer (the last fault's replica still restarting)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return await engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None


def gateway_in_flight(pipeline: Pipeline) -> float:
    with urllib.request.urlopen(f"{pipeline.http_url}/metrics", timeout=10.0) as reply:
        text = reply.read().decode()
    line = next(line for line in text.splitlines() if line.startswith("sluice_gateway_requests_in_flight "))
    return float(line.split()[1])


async def quiet(pipeline: Pipeline, ports: dict[str, int]) -> dict[str, Any]:
    """Polls until every engine answers, runs and waits for nothing with its free list full and the
    gateway has nothing in flight; returns the last figures (`quiet`: whether that happened within
    QUIET_WITHIN_S). An engine still restarting after the last fault is polled until it answers."""
    deadline = time.monotonic() + QUIET_WITHIN_S
    while True:
        engines = {}
        for name, port in ports.items():
            if name.startswith("engine"):
                stats = await engine_figures(port)
                if stats is None:
                    engines[name] = {"unreachable": True}
                    continue
                engines[name] = {
                    "running": stats.running,
                    "waiting": stats.waiting,
                    "free_blocks": stats.free_blocks,
                    "num_blocks": stats.num_blocks,
                }
        in_flight = await asyncio.to_thread(gateway_in_flight, pipeline)
        idle = in_flight == 0 and all(
            not e.get("unreachable")
            and e["running"] == 0
            and e["waiting"] == 0
            and e["free_blocks"] == e["num_blocks"]
            for e in engines.values()
        )
        if idle or time.monotonic() > deadline:
            return {"quiet": idle, "engines": engines, "gateway_in_flight": in_flight}
        await asyncio.sleep(0.1)


def violations(outcomes: list[Outcome], faults: list[Fault], pathological: list[Outcome]) -> list[str]:
    """Every request that neither completed exactly nor failed `unavailable` within FAILED_WITHIN_S of
    a fault (of the stage its error names, when it names one), or `internal` within that of the end of a
    model runner's raising; every pathological request that hung or got no JSON answer; every fault
    after which /readyz did not name its stage ready within READY_WITHIN_S of the last fault on that
    stage, and every one whose replica never came back."""
    found = []
    for o in outcomes:
        if o.kind == "exact":
            continue
        named = [stage for stage in STAGES if re.search(rf"\b{stage}\b", o.detail)]
        suspects = [f for f in faults if not named or f.stage in named]
        near = any(f.at <= o.ended <= f.at + FAILED_WITHIN_S for f in suspects)
        # A step whose model runner raised fails its requests (`internal`), those of that step only.
        raised = any(
            f.kind == "raise" and f.at <= o.ended <= f.at + RUNNER_FAULT_S + FAILED_WITHIN_S for f in faults
        )
        if o.kind == "error" and o.detail.startswith(("internal:", "internal_error:")) and raised:
            continue
        if o.kind != "unavailable" or not near:
            late = "" if near else f", not within {FAILED_WITHIN_S:g} s of a fault of {named or 'any stage'}"
            when = f"sent at {o.sent:.1f}, ended {o.kind} at {o.ended:.1f}{late}"
            found.append(f"{o.api} request {o.prompt!r} {when}: {o.detail}")
    for o in pathological:
        if o.kind in ("hung", "error"):  # a JSON answer of its own is all it is owed
            found.append(f"pathological {o.prompt} request sent at {o.sent:.1f}: {o.kind}: {o.detail}")
    for f in faults:
        if f.ready_s is None or f.ready_s - since_last_on_stage(f, faults) > READY_WITHIN_S:
            when = f"{f.kind} of {f.target} at {f.at:.1f}"
            found.append(f"{when}: /readyz named its stage ready again after {f.ready_s} s")
        if f.recovery_s is None:
            found.append(f"{f.kind} of {f.target} at {f.at:.1f}: the replica not back after {GIVE_UP_S:g} s")
    return found


def since_last_on_stage(fault: Fault, faults: list[Fault]) -> float:
    """How long after `fault` came the last fault on its stage before /readyz named the stage ready again
    (0 when none came between): with both of a stage's replicas faulted, its readiness waits for the
    later one."""
    end = fault.at + (fault.ready_s or 0.0)
    later = [g.at for g in faults if g.stage == fault.stage and fault.at <= g.at <= end]
    return max(later) - fault.at


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(
    outcomes: list[Outcome], faults: list[Fault], found: list[str], after: dict[str, Any], output: str
) -> dict[str, Any]:
    kinds = ("exact", "mismatch", "unavailable", "error", "hung")
    recoveries = [f.recovery_s for f in faults if f.recovery_s is not None]
    readies = [f.ready_s for f in faults if f.ready_s is not None]
    return {
        "seed": SEED,
        "duration_s": CHAOS_S,
        "requests": {
            "total": len(outcomes),
            **{kind: sum(o.kind == kind for o in outcomes) for kind in kinds},
            "by_api": {api: sum(o.api == api for o in outcomes) for api in ("ws", "sse")},
        },
        "faults": {kind: sum(f.kind == kind for f in faults) for kind in KINDS},
        "fault_list": [
            {
                "kind": f.kind,
                "target": f.target,
                "at_s": round(f.at - faults[0].at, 2),
                "pid": f.pid,
                "stop_s": round(f.stop_s, 2),
                "ready_s": f.ready_s,
                "recovery_s": f.recovery_s,
            }
            for f in faults
        ],
        "failovers": output.count("failed before its first token; retried on"),
        "errors": sum(o.kind != "exact" for o in outcomes),
        "unavailable_by_stage": {
            stage: sum(
                o.kind == "unavailable" and re.search(rf"\b{stage}\b", o.detail) is not None for o in outcomes
            )
            for stage in STAGES
        },
        "error_messages": Counter(o.detail for o in outcomes if o.kind != "exact").most_common(12),
        "recovery_s": {  # until the faulted replica was back and seen serving by the gateway
            "p50": percentile(recoveries, 50),
            "p99": percentile(recoveries, 99),
            "max": max(recoveries, default=None),
        },
        "ready_s": {  # until /readyz named the fault's stage ready again
            "p50": percentile(readies, 50),
            "p99": percentile(readies, 99),
            "max": max(readies, default=None),
        },
        "restarts_by_launcher": output.count("has not answered SERVING for"),
        "restarts_from_standby": output.count(") from a standby"),
        "loop_recoveries_in_process": output.count("step loop recovered"),
        "after": after,
        "violations": found,
    }


async def _chaos(pipeline: Pipeline, model: str, references: dict[str, str]) -> tuple[Load, Schedule]:
    load = Load(pipeline, model, references, SEED)
    schedule = Schedule(pipeline, SEED)
    running = asyncio.ensure_future(load.run(CHAOS_S))
    await schedule.run(time.monotonic() + CHAOS_S)
    await running
    for fault in schedule.faults:
        if fault.resumed is not None:
            await fault.resumed
    return load, schedule


def test_a_seeded_fault_schedule_under_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    references = lone_runs(tiny_model_dir)
    pipeline = start_pipeline(tiny_model_dir, *UP_FLAGS, env={"SLUICE_FAULT_INJECTION": "1"})
    try:
        load, schedule = asyncio.run(_chaos(pipeline, tiny_model_dir.name, references))
        alive = pipeline.proc.poll() is None
        after = asyncio.run(quiet(pipeline, schedule.ports)) if alive else {"quiet": False}
    finally:
        code = pipeline.stop()
    found = violations(load.outcomes, schedule.faults, load.pathological)
    report = summary(load.outcomes, schedule.faults, found, after, pipeline.output())
    report["pathological"] = {
        "requests": len(load.pathological),
        **Counter(o.kind for o in load.pathological),
        "answers": Counter(o.detail[:120] for o in load.pathological).most_common(6),
    }
    path = Path(os.environ.get(SUMMARY_ENV) or tmp_path / "chaos.json")
    path.write_text(json.dumps(report, indent=2))
    path.with_suffix(".log").write_text(pipeline.output())  # what `sluice up` and its children printed
    keys = ("requests", "unavailable_by_stage", "faults", "failovers", "recovery_s", "ready_s")
    keys += ("pathological",)
    brief = {key: report[key] for key in keys}
    print(f"chaos: summary in {path}: {json.dumps(brief)}")
    assert alive, f"sluice up gave up:\n{pipeline.output()[-5000:]}"
    assert code == 0, pipeline.output()[-5000:]
    assert schedule.faults and {f.kind for f in schedule.faults} == set(KINDS), report["fault_list"]
    assert load.pathological, "the pathological client sent nothing"
    assert not found, "\n".join(found[:30])
    assert after["quiet"], after
