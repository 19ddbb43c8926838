"""Restarts by `sluice up`: its restart policy alone (backoff, give-up window), then stage faults
under a real `sluice up`: tokenizer, engine and detokenizer are each killed (SIGKILL) in turn while
streams run.

For each kill: the streams that depended on the stage end with an `unavailable` error frame and
never hang (streams that did not depend on it, already tokenized when the tokenizer dies, go on);
a request sent while the stage is down ends (`unavailable`, or done if the gateway waited for the
stage); the launcher starts the stage again; once `/readyz` says ready a new request succeeds; no
other child was restarted (same pids).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import psutil
import pytest
import websockets

from sluice import launcher, plan, supervise
from sluice.plan import Child
from sluice.supervise import RestartPolicy, RestartTracker, Supervisor, Watcher, describe_exit
from tests.e2e.conftest import Pipeline, start_pipeline

CHILDREN = ("tokenizer", "engine", "detokenizer", "gateway")
POLICY = RestartPolicy(max_restarts=5, window_s=60.0, initial_backoff_s=0.5, max_backoff_s=8.0)
STREAMS = 4
LONG = 100_000  # max_tokens: no stream ends on its own during the test
WAIT_S = 120.0  # generous: two shared cores, other tests running


# ----- the restart policy, without processes


def test_backoff_doubles_with_each_restart_up_to_the_cap() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=10, window_s=60.0))
    assert [tracker.on_exit(float(t)) for t in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_gives_up_after_max_restarts_within_the_window() -> None:
    tracker = RestartTracker(POLICY)
    assert all(tracker.on_exit(t) is not None for t in (0.0, 1.0, 2.0, 3.0, 4.0))
    assert tracker.on_exit(59.9) is None


def test_restarts_older_than_the_window_are_forgotten() -> None:
    tracker = RestartTracker(POLICY)
    for t in (0.0, 10.0, 20.0, 30.0, 40.0):
        assert tracker.on_exit(t) is not None
    assert tracker.on_exit(60.0) == 8.0  # the restart at 0 left the window; four remain
    assert tracker.on_exit(65.0) is None  # 10, 20, 30, 40 and 60 are within 60 s of 65
    quiet = RestartTracker(POLICY)
    quiet.on_exit(0.0)
    assert quiet.on_exit(100.0) == 0.5  # a child that ran a whole window starts over from the first backoff


@dataclass
class _Exited:
    """A stand-in for a Popen: `poll()` gives `code` (None while running); `signals` lists what it
    was sent."""

    pid: int
    code: int | None = None
    signals: list[int] = field(default_factory=list)

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)


class _FakeSupervisor(Supervisor):
    """A Supervisor whose children are `_Exited` stand-ins; `starts` lists every start by name."""

    def __init__(self, names: list[str]) -> None:
        super().__init__([Child(name, 0, ()) for name in names], env={})
        self.starts: list[str] = []
        for child in self.children:
            self.start_child(child)

    def start_child(self, child: Child) -> None:
        self.starts.append(child.name)
        self.procs[child.name] = _Exited(pid=len(self.starts))  # type: ignore[assignment]

    def kill(self, name: str) -> None:
        self.procs[name].code = -signal.SIGKILL  # type: ignore[attr-defined]


def test_the_watcher_restarts_only_the_dead_child_after_its_backoff() -> None:
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, POLICY)
    supervisor.kill("engine")
    assert watcher.check(100.0) is None
    assert watcher.check(100.4) is None
    assert supervisor.starts == ["tokenizer", "engine"]  # still backing off
    assert watcher.check(100.5) is None
    assert supervisor.starts == ["tokenizer", "engine", "engine"]
    assert supervisor.procs["engine"].poll() is None
    supervisor.kill("engine")
    assert watcher.check(101.0) is None
    assert watcher.check(101.9) is None
    assert watcher.check(102.0) is None  # the second backoff is 1 s
    assert supervisor.starts == ["tokenizer", "engine", "engine", "engine"]


def test_the_watcher_gives_up_on_a_child_that_keeps_dying() -> None:
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, RestartPolicy(max_restarts=2, window_s=60.0))
    now = 0.0
    for _ in range(2):
        supervisor.kill("tokenizer")
        assert watcher.check(now) is None
        now += 10.0
        assert watcher.check(now) is None
    supervisor.kill("tokenizer")
    assert watcher.check(now) == "tokenizer"
    assert supervisor.starts.count("engine") == 1


def test_a_child_that_refuses_its_configuration_stops_everything_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit status 2 is a refused setting (bad model, flag, pool size): no restart, give up with 2, the
    line saying why; a crash (status 1) or a signal is restarted as before."""
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, POLICY, now=0.0)
    supervisor.procs["tokenizer"].code = 1  # type: ignore[attr-defined]
    assert watcher.check(1.0) is None
    assert watcher.check(1.5) is None and supervisor.starts.count("tokenizer") == 2
    supervisor.procs["engine"].code = supervise.CONFIG_ERROR_STATUS  # type: ignore[attr-defined]
    assert watcher.check(2.0) == "engine"
    assert watcher.give_up_status == 2
    assert supervisor.starts.count("engine") == 1
    err = capsys.readouterr().err
    assert "tokenizer exited with code 1 during start-up; restarting it in 0.5s" in err
    assert "engine exited with code 2 during start-up: it refused its configuration" in err
    assert "not restarting it" in err


def test_a_child_that_dies_after_serving_while_others_still_start_is_restarted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The engine has served, the tokenizer has not yet: the engine's death is a restart like any
    other, not a failed start-up (once, `sluice up` stopped everything here)."""
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, POLICY, now=0.0)
    watcher.on_health("engine", supervisor.procs["engine"].pid, True, 1.0)
    assert not watcher.all_served()
    supervisor.kill("engine")
    assert watcher.check(1.5) is None
    assert watcher.check(2.0) is None
    assert supervisor.starts == ["tokenizer", "engine", "engine"]
    assert "engine exited with code -9 (SIGKILL); restarting it in 0.5s" in capsys.readouterr().err
    watcher.on_health("tokenizer", supervisor.procs["tokenizer"].pid, True, 2.1)
    watcher.on_health("engine", 2, True, 2.1)  # the engine's first run answering late: not this run
    assert not watcher.all_served()
    watcher.on_health("engine", supervisor.procs["engine"].pid, True, 2.2)
    assert watcher.all_served()


def test_a_child_that_never_came_up_is_restarted_within_the_policy_then_given_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, RestartPolicy(max_restarts=2, window_s=60.0), now=0.0)
    now = 0.0
    for _ in range(2):
        supervisor.kill("engine")
        assert watcher.check(now) is None
        now += 5.0
        assert watcher.check(now) is None
    assert supervisor.starts.count("engine") == 3
    supervisor.kill("engine")
    assert watcher.check(now) == "engine"
    err = capsys.readouterr().err
    assert "engine exited with code -9 (SIGKILL) during start-up; restarting it in 0.5s" in err
    assert (
        "engine exited with code -9 (SIGKILL) during start-up after 2 restarts within 60s; giving up" in err
    )


def test_a_served_child_that_stops_answering_is_terminated_then_killed_and_restarted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """NOT_SERVING or silent (hung, SIGSTOPped) for longer than unhealthy_restart_s: SIGTERM and
    SIGCONT, SIGKILL after KILL_GRACE_S, and the death goes through the restart policy."""
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, POLICY, unhealthy_restart_s=10.0, now=0.0)
    engine = supervisor.procs["engine"]
    for name in ("tokenizer", "engine"):
        watcher.on_health(name, supervisor.procs[name].pid, True, 1.0)
    watcher.on_health("tokenizer", supervisor.procs["tokenizer"].pid, True, 11.0)
    watcher.on_health("engine", engine.pid, False, 11.0)  # NOT_SERVING: no newer SERVING answer
    assert watcher.check(11.0) is None and engine.signals == []
    assert watcher.check(11.1) is None
    assert engine.signals == [signal.SIGTERM, signal.SIGCONT]
    assert supervisor.procs["tokenizer"].signals == []  # answered within the window
    assert watcher.check(11.1 + supervise.KILL_GRACE_S - 0.1) is None
    assert engine.signals == [signal.SIGTERM, signal.SIGCONT]
    assert watcher.check(11.1 + supervise.KILL_GRACE_S) is None
    assert engine.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    assert "engine has not answered SERVING for 10.1s" in capsys.readouterr().err
    supervisor.kill("engine")
    assert watcher.check(20.0) is None
    assert watcher.check(20.5) is None
    assert supervisor.starts.count("engine") == 2
    assert watcher.check(40.0) is None  # a new run that has not served yet is left to start
    assert supervisor.procs["engine"].signals == []


def test_standbys_are_started_only_for_kinds_whose_replicas_all_serve() -> None:
    """A stage kind is settled (its standbys may start) when every replica of it has answered SERVING in
    its current run; a dead one, due a restart or restarted and not serving yet, unsettles its kind. The
    gateway has no standby."""
    supervisor = _FakeSupervisor(["tokenizer", "engine", "gateway"])
    watcher = Watcher(supervisor, POLICY, now=0.0)
    assert watcher.settled_kinds() == set()
    for name in ("tokenizer", "engine", "gateway"):
        watcher.on_health(name, supervisor.procs[name].pid, True, 1.0)
    assert watcher.settled_kinds() == {"tokenizer", "engine"}
    supervisor.kill("engine")
    assert watcher.check(2.0) is None
    assert watcher.settled_kinds() == {"tokenizer"}  # due a restart
    assert watcher.check(2.5) is None and supervisor.starts.count("engine") == 2
    assert watcher.settled_kinds() == {"tokenizer"}  # restarted, not serving yet
    watcher.on_health("engine", supervisor.procs["engine"].pid, True, 3.0)
    assert watcher.settled_kinds() == {"tokenizer", "engine"}


class _Recorded(_Exited):
    """A stand-in that exits on SIGTERM and logs `(name, signal)` in a shared list."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        super().__init__(pid=0)
        self.name, self.log = name, log

    def send_signal(self, sig: int) -> None:
        self.log.append((self.name, sig))
        if sig == signal.SIGTERM:
            self.code = -sig

    def wait(self, timeout: float | None = None) -> int | None:
        self.log.append((self.name, 0))
        return self.code


def test_stop_stops_the_gateway_before_the_stages() -> None:
    log: list[tuple[str, int]] = []
    supervisor = Supervisor([Child(n, 0, ()) for n in ("tokenizer", "engine", "gateway")], env={})
    supervisor.procs = {n: _Recorded(n, log) for n in ("tokenizer", "engine", "gateway")}  # type: ignore[misc]
    supervisor.stop()
    gateway_done = log.index(("gateway", 0))
    stage_terms = [i for i, (name, sig) in enumerate(log) if name != "gateway" and sig == signal.SIGTERM]
    assert len(stage_terms) == 2 and min(stage_terms) > gateway_done, log


def test_planned_ports_that_clash_are_refused_naming_both(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        launcher.parse_args(["--port", "50051"])
    err = capsys.readouterr().err
    assert "port 50051" in err and "--port" in err and "tokenizer's gRPC port" in err
    with pytest.raises(SystemExit):
        launcher.parse_args(["--metrics-base-port", "50052", "--engines", "2"])
    err = capsys.readouterr().err
    assert "engine-1's gRPC port" in err and "tokenizer's metrics port" in err
    args = launcher.parse_args(["--engines", "2", "--metrics-base-port", "9300"])
    planned = {port for port, _ in plan.planned_ports(args)}
    children = plan.plan_children(args, "/m")
    assert {c.grpc_port for c in children} | {args.port} | set(range(9300, 9304)) == planned


def test_ports_among_outgoing_connections_local_ports_get_a_warning(tmp_path: Path) -> None:
    """A restart cannot bind a port that a client's connection took as its local port meanwhile."""
    proc_file = tmp_path / "ip_local_port_range"
    proc_file.write_text("32768\t60999\n")
    ephemeral = plan.ephemeral_ports(proc_file)
    assert ephemeral == range(32768, 61000)
    args = launcher.parse_args(["--port", "8000", "--grpc-base-port", "50050"])
    warning = plan.ephemeral_warning(plan.planned_ports(args), ephemeral)
    assert warning is not None and "50050, 50051, 50052, 50053" in warning and "8000" not in warning
    low = launcher.parse_args(["--port", "8000", "--grpc-base-port", "20050"])
    assert plan.ephemeral_warning(plan.planned_ports(low), ephemeral) is None
    assert plan.ephemeral_ports(tmp_path / "absent") is None


def test_exit_codes_name_the_signal() -> None:
    assert describe_exit(-9) == "code -9 (SIGKILL)"
    assert describe_exit(1) == "code 1"


# ----- kills under a real `sluice up`


async def _recv(ws: Any) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout=WAIT_S))


async def _start_streams(ws: Any, tag: str) -> list[str]:
    """Starts STREAMS long greedy generations; returns once each has streamed text."""
    ids = [f"{tag}-{i}" for i in range(STREAMS)]
    params = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    for rid in ids:
        await ws.send(
            json.dumps({"type": "generate", "id": rid, "prompt": f"Story {rid}:", "params": params})
        )
    streaming: set[str] = set()
    while streaming != set(ids):
        frame = await _recv(ws)
        assert frame["type"] == "delta", frame
        streaming.add(frame["id"])
    return ids


async def _ends(ws: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    """Reads until every id got its terminal frame (deltas in between are skipped)."""
    ends: dict[str, dict[str, Any]] = {}
    while set(ends) != set(ids):
        frame = await _recv(ws)
        if frame["type"] != "delta":
            assert frame["id"] not in ends, f"two terminal frames: {frame}"
            ends[frame["id"]] = frame
    return ends


async def _still_streaming(ws: Any, ids: list[str]) -> None:
    """Every stream sends more text, then is cancelled by the client."""
    fresh: set[str] = set()
    while fresh != set(ids):
        frame = await _recv(ws)
        assert frame["type"] == "delta", frame
        fresh.add(frame["id"])
    for rid in ids:
        await ws.send(json.dumps({"type": "cancel", "id": rid}))
    for frame in (await _ends(ws, ids)).values():
        assert frame["type"] == "done" and frame["finish_reason"] == "cancelled", frame


async def _wait_ready(client: httpx.AsyncClient) -> None:
    """Polls /readyz until every upstream answers SERVING."""
    deadline = time.monotonic() + WAIT_S
    while (reply := await client.get("/readyz")).status_code != 200:
        assert reply.status_code == 503, reply.text
        assert time.monotonic() < deadline, f"not ready after {WAIT_S:.0f}s: {reply.text}"
        await asyncio.sleep(0.1)


async def _one_generation(url: str) -> dict[str, Any]:
    """One short generation on a socket of its own; returns its terminal frame."""
    async with websockets.connect(url) as ws:
        params = {"max_tokens": 8, "temperature": 0}
        await ws.send(json.dumps({"type": "generate", "id": "one", "prompt": "Once upon", "params": params}))
        return (await _ends(ws, ["one"]))["one"]


def standbys(pipeline: Pipeline) -> dict[str, list[psutil.Process]]:
    """The launcher's standby processes by stage kind (`python -m sluice.launcher standby KIND FD`); one
    handed over keeps that command line, but it is then a replica, with a start line of its own."""
    found: dict[str, list[psutil.Process]] = {}
    replicas = set(pipeline.pids().values())
    for proc in psutil.Process(pipeline.proc.pid).children():
        with_args = proc.cmdline()
        if "sluice.launcher" in with_args and "standby" in with_args and proc.pid not in replicas:
            found.setdefault(with_args[-2], []).append(proc)
    return found


def _kill(pid: int) -> None:
    victim = psutil.Process(pid)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=WAIT_S)


async def _kill_under_load(pipeline: Pipeline, stage: str) -> None:
    before = pipeline.pids()
    assert set(before) == set(CHILDREN), pipeline.output()
    async with websockets.connect(pipeline.ws_url) as ws:
        ids = await _start_streams(ws, stage)
        _kill(before[stage])
        while_down = asyncio.ensure_future(_one_generation(pipeline.ws_url))
        if stage == "tokenizer":
            await _still_streaming(ws, ids)
        else:
            for frame in (await _ends(ws, ids)).values():
                assert frame["type"] == "error" and frame["code"] == "unavailable", frame
                assert stage in frame["message"] and "127.0.0.1" not in frame["message"], frame
    # The gateway fails it at once, or waits for the stage (upstream_wait_s) and serves it.
    ended = await while_down
    assert ended["type"] == "done" or (ended["type"] == "error" and ended["code"] == "unavailable"), ended
    restarted = await asyncio.to_thread(pipeline.wait_for_start, stage, before[stage], WAIT_S)
    async with httpx.AsyncClient(base_url=pipeline.http_url, timeout=WAIT_S) as client:
        await _wait_ready(client)
    after = await _one_generation(pipeline.ws_url)
    assert after["type"] == "done" and after["usage"]["completion_tokens"] > 0, after
    now = pipeline.pids()
    assert now == {**before, stage: restarted}, pipeline.output()
    children = psutil.Process(pipeline.proc.pid).children()  # the replicas and the warm standbys
    spares = {proc.pid for procs in standbys(pipeline).values() for proc in procs}
    assert {child.pid for child in children} - spares == set(now.values())
    assert f"{stage} exited with code -9" in pipeline.output()


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path) -> Iterator[Pipeline]:
    """This module's own `sluice up` (it kills stages), with a warm standby per kind as by default."""
    running = start_pipeline(tiny_model_dir, "--standby", "1")
    yield running
    code = running.stop()
    assert code == 0, running.output()


@pytest.mark.e2e
@pytest.mark.parametrize("stage", ["tokenizer", "engine", "detokenizer"])
def test_a_killed_stage_fails_only_its_requests_and_is_restarted(pipeline: Pipeline, stage: str) -> None:
    asyncio.run(_kill_under_load(pipeline, stage))


def test_a_restarted_child_that_never_serves_is_killed_and_restarted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A restart whose new run never answers SERVING (hung in start-up, stopped) is not left alone once
    the stack is up: past the start-up timeout it gets SIGTERM, SIGKILL after the grace, and restarts."""
    supervisor = _FakeSupervisor(["tokenizer", "engine"])
    watcher = Watcher(supervisor, POLICY, unhealthy_restart_s=10.0, startup_timeout_s=30.0, now=0.0)
    for name in ("tokenizer", "engine"):
        watcher.on_health(name, supervisor.procs[name].pid, True, 1.0)
    supervisor.kill("engine")
    assert watcher.check(2.0) is None
    assert watcher.check(2.5) is None  # restarted at 2.5
    engine = supervisor.procs["engine"]
    assert watcher.check(32.5) is None and engine.signals == []  # within its start-up timeout
    assert watcher.check(32.6) is None
    assert engine.signals == [signal.SIGTERM, signal.SIGCONT]
    assert "engine has not answered SERVING 30.1s after its restart" in capsys.readouterr().err
    assert watcher.check(32.6 + supervise.KILL_GRACE_S) is None
    assert engine.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    supervisor.kill("engine")
    assert watcher.check(40.0) is None
    assert watcher.check(41.0) is None
    assert supervisor.starts.count("engine") == 3


def test_a_child_that_had_served_is_restarted_without_growing_backoff() -> None:
    """The backoff slows a crash loop (runs that never come up); a run that had served and then died
    (killed, or stopped for not serving) is started again after the initial delay, however many
    restarts the window holds, and still counts toward giving up."""
    tracker = RestartTracker(RestartPolicy(max_restarts=4, window_s=60.0))
    assert [tracker.on_exit(float(t), served=True) for t in range(4)] == [0.5] * 4
    assert tracker.on_exit(4.0, served=True) is None
    crashing = RestartTracker(RestartPolicy(max_restarts=4, window_s=60.0))
    assert [crashing.on_exit(float(t), served=t == 2) for t in range(4)] == [0.5, 1.0, 0.5, 4.0]


def test_standby_defaults_to_one_and_refuses_a_negative_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.parse_args([]).standby == 1
    assert launcher.parse_args(["--standby", "0"]).standby == 0
    with pytest.raises(SystemExit):
        launcher.parse_args(["--standby", "-1"])
    assert "--standby must be at least 0" in capsys.readouterr().err


class _FakeStandby:
    """A stand-in for a `Standby`: `poll()` gives `state` (True ready, False importing, None exited)."""

    made: ClassVar[list[_FakeStandby]] = []

    def __init__(self, kind: str, env: dict[str, str], preexec: object) -> None:
        self.kind, self.state, self.stopped = kind, False, False
        self.proc = _Exited(pid=1000 + len(self.made), code=None)
        self.made.append(self)

    def poll(self) -> bool | None:
        return self.state

    def stop(self) -> None:
        self.stopped = True


def test_a_standby_that_exits_by_itself_turns_its_kind_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Top-ups keep one standby per settled kind; one that exits (an import failing, say) is not
    replaced, its kind restarts cold from then on, and the line says so; other kinds keep theirs."""
    monkeypatch.setattr(supervise, "Standby", _FakeStandby)
    _FakeStandby.made = []
    supervisor = Supervisor([Child(n, 0, ()) for n in ("tokenizer", "engine")], env={}, standby=1)
    for _ in range(2):
        supervisor.top_up_standbys({"tokenizer", "engine"})
        _FakeStandby.made[-1].state = True  # imported: the next kind's may start
    assert sorted(s.kind for s in _FakeStandby.made) == ["engine", "tokenizer"]
    engine = supervisor.standbys["engine"][0]
    engine.state, engine.proc.code = None, 1
    supervisor.top_up_standbys({"tokenizer", "engine"})
    assert supervisor.standbys["engine"] == [] and engine.stopped
    assert "the engine standby failed (it exited with code 1); engine replicas restart cold" in (
        capsys.readouterr().err
    )
    supervisor.top_up_standbys({"tokenizer", "engine"})
    assert len(_FakeStandby.made) == 2 and len(supervisor.standbys["tokenizer"]) == 1


def test_a_start_takes_a_ready_standby_and_starts_cold_when_it_cannot(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ready standby of the child's kind is handed the child's arguments; one still importing is
    left alone; one whose hand-over fails (it died since it said ready) gives way to a cold start."""
    monkeypatch.setattr(supervise, "Standby", _FakeStandby)
    monkeypatch.setattr(supervise.subprocess, "Popen", lambda *args, **kw: _Exited(pid=7))
    _FakeStandby.made = []
    handed: list[list[str]] = []
    engine = Child("engine", 0, ("--port", "1"))
    supervisor = Supervisor([engine], env={}, standby=1)
    supervisor.top_up_standbys({"engine"})
    spare = supervisor.standbys["engine"][0]
    supervisor.start_child(engine)  # still importing: cold
    assert supervisor.procs["engine"].pid == 7 and supervisor.standbys["engine"] == [spare]
    spare.state = True
    spare.hand_over = lambda argv: handed.append(argv) or spare.proc  # type: ignore[attr-defined]
    supervisor.start_child(engine)
    assert handed == [["serve", "engine", "--port", "1"]]
    assert supervisor.procs["engine"] is spare.proc and supervisor.standbys["engine"] == []
    supervisor.top_up_standbys({"engine"})
    broken = supervisor.standbys["engine"][0]
    broken.state = True

    def hand_over(argv: list[str]) -> None:
        raise BrokenPipeError("the standby is gone")

    broken.hand_over = hand_over  # type: ignore[attr-defined]
    supervisor.start_child(engine)
    assert supervisor.procs["engine"].pid == 7
    out = capsys.readouterr().out
    assert out.count("engine started (pid 7)\n") == 2 and f"(pid {spare.proc.pid}) from a standby" in out


def test_the_engines_standby_starts_with_the_children_and_the_ready_line_waits_for_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart right after the ready line must be a take-over: the engine's standby starts beside the
    children and readiness (of the launcher's ready line) waits until it is imported, or has failed
    (then its kind restarts cold, as the line says); with --standby 0 there is nothing to wait for."""
    monkeypatch.setattr(supervise, "Standby", _FakeStandby)
    monkeypatch.setattr(supervise.subprocess, "Popen", lambda *args, **kw: _Exited(pid=7))
    names = ("tokenizer", "engine", "detokenizer", "gateway")
    _FakeStandby.made = []
    supervisor = Supervisor([Child(n, 0, ()) for n in names], env={}, standby=1)
    supervisor.start()
    assert [s.kind for s in _FakeStandby.made] == ["engine"]
    assert not supervisor.early_standby_settled()
    _FakeStandby.made[0].state = True
    assert supervisor.early_standby_settled()
    failing = Supervisor([Child(n, 0, ()) for n in names], env={}, standby=1)
    failing.start()
    _FakeStandby.made[-1].state, _FakeStandby.made[-1].proc.code = None, 1
    assert failing.early_standby_settled()
    assert "the engine standby failed (it exited with code 1)" in capsys.readouterr().err
    _FakeStandby.made = []
    cold = Supervisor([Child(n, 0, ()) for n in names], env={}, standby=0)
    cold.start()
    assert _FakeStandby.made == [] and cold.early_standby_settled()


def test_standbys_start_one_at_a_time_the_engines_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """No standby starts while another still imports (the spares' imports take one core at most),
    and the engine's, whose cold start costs the most, comes first."""
    monkeypatch.setattr(supervise, "Standby", _FakeStandby)
    _FakeStandby.made = []
    kinds = {"tokenizer", "engine", "detokenizer"}
    supervisor = Supervisor([Child(n, 0, ()) for n in sorted(kinds)], env={}, standby=1)
    supervisor.top_up_standbys(kinds)
    supervisor.top_up_standbys(kinds)
    assert [s.kind for s in _FakeStandby.made] == ["engine"]
    _FakeStandby.made[0].state = True
    supervisor.top_up_standbys(kinds)
    supervisor.top_up_standbys(kinds)
    assert [s.kind for s in _FakeStandby.made] == ["engine", "tokenizer"]
    _FakeStandby.made[1].state = True
    supervisor.top_up_standbys(kinds)
    _FakeStandby.made[2].state = True
    supervisor.top_up_standbys(kinds)
    assert [s.kind for s in _FakeStandby.made] == ["engine", "tokenizer", "detokenizer"]


def test_a_standby_imports_at_a_lower_priority_and_becomes_a_replica_at_its_own() -> None:
    """Where the process may raise its priority back (this test's root, or an RLIMIT_NICE allowing it),
    the standby's imports run STANDBY_NICE lower and the replica it becomes runs at the launcher's."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if not supervise._may_raise_priority(before):
        supervise._yield_while_importing()()
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
        return
    code = (
        "import os; from sluice import supervise; restore = supervise._yield_while_importing(); "
        "low = os.getpriority(os.PRIO_PROCESS, 0); restore(); print(low, os.getpriority(os.PRIO_PROCESS, 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(before + supervise.STANDBY_NICE), str(before)]


def thread_nice_values(pid: int) -> dict[int, int]:
    """Thread id → nice value of every thread of process `pid` (Linux: field 19 of
    /proc/PID/task/TID/stat, counted after the command name in parentheses)."""
    values = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        values[int(task)] = int(fields[16])  # fields[0] is field 3 (the state)
    return values


def test_threads_started_while_a_standby_imports_get_the_replicas_priority_back() -> None:
    """A thread that an import starts inherits the standby's lower priority; on Linux a nice value is
    each thread's own, so after the hand-over every thread, not only the main one, runs at the
    launcher's priority."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if not supervise._may_raise_priority(before):
        pytest.skip("this process may not raise a priority back: a standby imports at its own priority")
    # The child names the threads it had before it lowered its priority (an import may start one): those
    # keep the priority they had; every thread started after must be low until the hand-over.
    code = (
        "import os, sys, threading; from sluice import supervise; early = os.listdir('/proc/self/task'); "
        "restore = supervise._yield_while_importing(); "
        "stop = threading.Event(); workers = [threading.Thread(target=stop.wait) for _ in range(3)]; "
        "[w.start() for w in workers]; print('low', *early, flush=True); sys.stdin.readline(); restore(); "
        "print('restored', flush=True); sys.stdin.readline(); stop.set()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        word, *early = child.stdout.readline().split()
        assert word == "low"
        low = {tid: nice for tid, nice in thread_nice_values(child.pid).items() if str(tid) not in early}
        assert len(low) >= 3 and set(low.values()) == {before + supervise.STANDBY_NICE}, (low, early)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "restored\n"
        restored = thread_nice_values(child.pid)
        assert set(restored) >= set(low) and set(restored.values()) == {before}, restored
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()


class _SleeperSupervisor(Supervisor):
    """A Supervisor whose children are Python processes that start a thread, wait for a line on stdin
    (their start-up), then do what a service does as it starts serving (`priority.lower_when_serving`)
    and sleep a minute (killed by the test)."""

    @staticmethod
    def command(child: Child) -> list[str]:
        code = (
            "import sys, threading, time; from services.common import priority; "
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); sys.stdin.readline(); "
            "priority.lower_when_serving(); time.sleep(60)"
        )
        return [sys.executable, "-c", code]


def _wait_for_nice(pid: int, want: set[int], deadline_s: float = 60.0) -> dict[int, int]:
    """Thread nice values of `pid` once they are `want` (or as they are at the deadline)."""
    end = time.monotonic() + deadline_s
    while (values := thread_nice_values(pid)) and set(values.values()) != want and time.monotonic() < end:
        time.sleep(0.02)
    return values


def test_children_and_standbys_start_at_their_planned_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold start runs at the launcher's priority while it starts (its imports and loading do not
    wait behind busy engines); a light stage then runs `Child.nice` lower, on every thread, once it
    serves; its kind's standbys start that much lower; the engine runs at the launcher's own. Read back
    from /proc."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    children = [Child("tokenizer", 0, (), nice=plan.LIGHT_NICE), Child("engine", 0, ())]
    supervisor = _SleeperSupervisor(children, env=dict(os.environ))
    preexecs: dict[str, Any] = {}

    def standby(kind: str, env: dict[str, str], preexec: object) -> _FakeStandby:
        preexecs[kind] = preexec
        return _FakeStandby(kind, env, preexec)

    monkeypatch.setattr(supervise, "Standby", standby)
    popen = subprocess.Popen

    def with_stdin(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        return popen(*args, stdin=subprocess.PIPE, **kwargs)

    monkeypatch.setattr(supervise.subprocess, "Popen", with_stdin)
    try:
        for child in children:
            supervisor.start_child(child)
        procs = supervisor.procs
        starting = {name: set(_wait_for_nice(proc.pid, {before}).values()) for name, proc in procs.items()}
        assert starting == {"tokenizer": {before}, "engine": {before}}
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write(b"serving\n")
            proc.stdin.flush()
        light = min(19, before + plan.LIGHT_NICE)
        tokenizer = _wait_for_nice(procs["tokenizer"].pid, {light})
        assert len(tokenizer) >= 2 and set(tokenizer.values()) == {light}, tokenizer
        assert set(_wait_for_nice(procs["engine"].pid, {before}).values()) == {before}
    finally:
        for proc in supervisor.procs.values():
            proc.kill()
            proc.wait()
    supervisor._start_standby("tokenizer")
    supervisor._start_standby("engine")
    spare = subprocess.Popen(
        [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=preexecs["tokenizer"],
    )
    assert int(spare.communicate()[0]) == min(19, before + plan.LIGHT_NICE)
    assert preexecs["engine"] is supervisor._preexec  # the engine's standby: only the death signal
