"""What keeps `sluice up`'s children running: restarts, liveness and warm standbys.

`Supervisor` owns the children and the standbys; `stop` ends them all, exactly once, the gateway before
the stages. `Watcher` and `RestartTracker` are pure (the caller passes the time and the health answers):
every death goes through the `RestartPolicy`, except an exit with CONFIG_ERROR_STATUS, which gives up at
once; a child that served and then has not answered SERVING for `unhealthy_restart_s`, or a restarted one
not SERVING within the start-up timeout, gets SIGTERM and SIGCONT, then SIGKILL after KILL_GRACE_S. A start
takes a ready `Standby` of its kind when there is one; standbys count for nothing in health, and one that
exits by itself turns its kind's off. Every child and standby gets SIGTERM when the launcher dies
(PR_SET_PDEATHSIG); a child runs at its `Child.nice` once it serves, a standby at its kind's. Figures and
history: docs/architecture.md ("`sluice up`") and docs/reliability.md ("Faults and restarts").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import CONFIG_ERROR_STATUS, ChannelTls, client_channel, wait_healthy
from services.common.priority import NICE_ENV, set_every_thread_nice
from sluice.plan import STAGES, Child

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
UNHEALTHY_RESTART_S = 10.0  # a served child not SERVING this long is restarted
HEALTH_TIMEOUT_S = 2.0  # one health check's deadline
HEALTH_INTERVAL_S = 1.0  # how often a serving child is asked
KILL_GRACE_S = 1.0  # SIGTERM → SIGKILL for an unhealthy child (it has nothing left to drain well)
WATCH_INTERVAL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CAP_SYS_NICE = 23  # linux/capability.h

# What a standby imports before it waits: the service's modules and what its start-up imports later (for
# the engine: the executor, hence torch, torch._dynamo through torch.nn.attention, and transformers).
STANDBY_IMPORTS = {
    "tokenizer": ("services.tokenizer.server",),
    "engine": (
        "services.engine.server",
        "services.engine.executor.model_runner",
        "services.engine.executor.sampler",
        "services.engine.executor.grammar_mask",
    ),
    "detokenizer": ("services.detokenizer.server",),
}
STANDBY_ORDER = ("engine", "tokenizer", "detokenizer")  # which kind's standby starts first
STANDBY_NICE = 10  # added to a standby's nice value while it imports (see `_yield_while_importing`)
STANDBY_ENTRY = "sluice.launcher"  # a standby runs `python -m sluice.launcher standby KIND FD`


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again: after `initial_backoff_s`, doubling with each restart of
    that child within the last `window_s` seconds, at most `max_backoff_s`, unless the run that died
    had served (it came up: no crash loop to slow down, so `initial_backoff_s`); never more than
    `max_restarts` times within `window_s` seconds, served or not."""

    max_restarts: int = 5
    window_s: float = 60.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0


@dataclass
class RestartTracker:
    """The restart history of one child under a `RestartPolicy` (pure: the caller passes the time)."""

    policy: RestartPolicy
    restarts: deque[float] = field(default_factory=deque)

    def on_exit(self, now: float, served: bool = False) -> float | None:
        """The child died at `now` (monotonic seconds), after its run had answered SERVING or not: the
        delay before starting it again, or None when it already had `max_restarts` restarts within
        the window (give up). A returned delay counts as a restart at `now`."""
        while self.restarts and now - self.restarts[0] >= self.policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.max_restarts:
            return None
        delay = self.policy.initial_backoff_s * (1 if served else 2 ** len(self.restarts))
        self.restarts.append(now)
        return min(delay, self.policy.max_backoff_s)

    @property
    def recent(self) -> int:
        """Restarts counted in the window as of the last `on_exit`."""
        return len(self.restarts)


class Supervisor:
    """Owns the child processes: starts them, waits for health, stops them all exactly once. With
    `standby` N, also keeps up to N `Standby` processes per stage kind (`top_up_standbys`): a start of a
    child takes a ready one of its kind when there is one, else starts the child cold."""

    def __init__(self, children: list[Child], env: dict[str, str] | None = None, standby: int = 0) -> None:
        self.children = children
        self.env = os.environ.copy() if env is None else env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.standby = standby
        self.standbys: dict[str, list[Standby]] = {}
        self._standby_off: set[str] = set()  # kinds whose standby failed
        self._retired: list[Standby] = []  # stopped standbys, reaped by `stop`
        self._early_kind: str | None = None  # the kind whose standby `start` started with the children
        self._preexec = _parent_death_signal()

    def start(self) -> None:
        """Starts every child, and with `standby` on, the engine's standby at once beside them (the
        first kind of STANDBY_ORDER the children have), importing at its lower priority: a restart
        right after the ready line, which waits for it (`early_standby_settled`), is then a take-over,
        not a cold start."""
        for child in self.children:
            self.start_child(child)
        kinds = {child.kind for child in self.children}
        early = next((kind for kind in STANDBY_ORDER if kind in kinds), None)
        if self.standby > 0 and early is not None:
            self._early_kind = early
            self._start_standby(early)

    def early_standby_settled(self) -> bool:
        """False while the standby started with the children still imports; True once it is ready, has
        failed (its kind then restarts cold), was handed over to a restart, or none was started."""
        spares = self.standbys.get(self._early_kind, []) if self._early_kind else []
        if not spares or self._early_kind in self._standby_off:
            return True
        state = spares[0].poll()
        if state is None:
            self._standby_failed(
                self._early_kind, f"it exited with {describe_exit(spares[0].proc.poll() or 0)}"
            )
            return True
        return state

    def start_child(self, child: Child) -> None:
        """Starts (or starts again) one child, from a ready standby of its kind when there is one, and
        prints its pid. The child gets SIGTERM if the launcher dies (see `_parent_death_signal`). A cold
        start runs at the launcher's priority until the child serves, then `child.nice` lower (NICE_ENV,
        services/common/priority.py): its imports and loading do not wait behind busy engines; a
        standby already runs at its kind's."""
        standby, proc, how = self._ready_standby(child.kind), None, ""
        if standby is not None:
            with contextlib.suppress(OSError):  # it died since it said ready: a cold start then
                proc, how = standby.hand_over(child.argv), " from a standby"
        if proc is None:
            env = {**self.env, NICE_ENV: str(child.nice)} if child.nice > 0 else self.env
            proc = subprocess.Popen(self.command(child), env=env, preexec_fn=self._preexec)
        self.procs[child.name] = proc
        print(f"sluice up: {child.name} started (pid {proc.pid}){how}", flush=True)

    def _kind_nice(self, kind: str) -> int:
        """The nice increment of `kind`'s children (a standby of the kind starts at theirs)."""
        return next((child.nice for child in self.children if child.kind == kind), 0)

    def _child_preexec(self, nice: int) -> Callable[[], None] | None:
        """Popen's `preexec_fn` for a standby `nice` lower in priority than the launcher."""
        return with_nice(self._preexec, nice)

    @staticmethod
    def command(child: Child) -> list[str]:
        """The command line that runs `child`."""
        return [sys.executable, "-m", "sluice.cli", *child.argv]

    def top_up_standbys(self, kinds: set[str]) -> None:
        """Starts standbys of `kinds` (stage kinds) up to `standby` of each, one at a time: none starts
        while another still imports (the engine's first), so that the spares' imports take at most one
        core from the serving replicas. A standby that exits by itself, or cannot be started, turns
        standbys of its kind off (no crash loop of spares): its replicas restart cold from then on."""
        importing = False
        for kind in kinds - self._standby_off:
            for spare in self.standbys.setdefault(kind, []):
                state = spare.poll()
                if state is None:
                    self._standby_failed(kind, f"it exited with {describe_exit(spare.proc.poll() or 0)}")
                    break
                importing |= not state
        if importing:
            return
        for kind in sorted(kinds - self._standby_off, key=STANDBY_ORDER.index):
            if len(self.standbys[kind]) < self.standby:
                self._start_standby(kind)
                return

    def _start_standby(self, kind: str) -> None:
        try:
            nice = self._kind_nice(kind)
            self.standbys.setdefault(kind, []).append(Standby(kind, self.env, self._child_preexec(nice)))
        except OSError as exc:
            self._standby_failed(kind, str(exc))

    def _standby_failed(self, kind: str, why: str) -> None:
        self.standbys.setdefault(kind, [])
        print(
            f"sluice up: the {kind} standby failed ({why}); {kind} replicas restart cold from now on",
            file=sys.stderr,
            flush=True,
        )
        self._standby_off.add(kind)
        for spare in self.standbys[kind]:
            spare.stop()
        self._retired += self.standbys[kind]
        self.standbys[kind] = []

    def _ready_standby(self, kind: str) -> Standby | None:
        """Takes a ready standby of `kind` out of the pool, or None (none, or none done importing)."""
        spares = self.standbys.get(kind, [])
        for spare in spares:
            if spare.poll():
                spares.remove(spare)
                return spare
        return None

    def dead_child(self) -> tuple[str, int] | None:
        dead = self.dead_children()
        return dead[0] if dead else None

    def dead_children(self) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited (a code -N: killed by signal N)."""
        return [(name, code) for name, proc in self.procs.items() if (code := proc.poll()) is not None]

    def terminate(self, name: str) -> None:
        """SIGTERM to a running child, then SIGCONT so that a stopped one acts on it."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)

    async def wait_all_healthy(self, host: str, timeout_s: float, tls: ChannelTls | None = None) -> None:
        """Returns when every child is SERVING (the stages asked over `tls` when given, the gateway's
        public port in plaintext); raises RuntimeError naming a child that died first. The benchmark
        stacks start this way (sluice/bench/stack.py); `sluice up` watches with a `Watcher` instead."""
        checks = [
            asyncio.ensure_future(
                wait_healthy(
                    f"{host}:{child.grpc_port}",
                    timeout_s=timeout_s,
                    tls=None if child.kind == "gateway" else tls,
                )
            )
            for child in self.children
        ]
        try:
            while not all(task.done() for task in checks):
                dead = self.dead_child()
                if dead is not None:
                    raise RuntimeError(f"{dead[0]} exited with code {dead[1]} during start-up")
                await asyncio.wait(checks, timeout=0.2)
            for task in checks:
                task.result()
        finally:
            for task in checks:
                task.cancel()

    def stop(self) -> None:
        """Stops the gateway first, then the stages (its generations in flight finish on them): each
        group gets SIGTERM, then SIGKILL once STOP_GRACE_S has passed."""
        gateway = [name for name in self.procs if name == "gateway"]
        stages = [name for name in self.procs if name != "gateway"]
        spares = [spare for kind in self.standbys.values() for spare in kind] + self._retired
        self.standbys, self._retired = {}, []
        for spare in spares:
            spare.stop()
        for group in (gateway, stages):
            for name in group:
                self.terminate(name)
            for name in group:
                self._reap(name)
        for spare in spares:
            self._reap_process(spare.proc, f"the {spare.kind} standby")

    def _reap(self, name: str) -> None:
        self._reap_process(self.procs[name], name)

    @staticmethod
    def _reap_process(proc: subprocess.Popen[bytes], name: str) -> None:
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"sluice up: {name} did not stop in {STOP_GRACE_S:.0f}s; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()


def describe_exit(code: int) -> str:
    """ "code 1", or "code -9 (SIGKILL)" for a child killed by a signal."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


@dataclass
class _Run:
    """One run of a child process: its pid, when it started, whether and when it last answered
    SERVING, and when it gets SIGKILL after an unhealthy restart's SIGTERM."""

    pid: int
    started: float
    restarted: bool = False  # started by the watcher, after the first start-up
    served: bool = False
    last_serving: float = 0.0
    kill_at: float | None = None


class Watcher:
    """Restarts children that die or stay unhealthy, under one `RestartPolicy` per child (pure: the
    caller passes the time and the health checks' answers).

    A child whose latest run has answered SERVING (`on_health`) and then not for `unhealthy_restart_s`,
    or whose restarted run has not answered SERVING within `startup_timeout_s` of its start, gets
    SIGTERM, and SIGKILL after KILL_GRACE_S; every death, whether the run had served or was still
    starting, goes through the restart policy, except an exit with CONFIG_ERROR_STATUS, which gives up
    at once. (The first start-up's own limit is the launcher's `_wait`'s.)"""

    def __init__(
        self,
        supervisor: Supervisor,
        policy: RestartPolicy,
        *,
        unhealthy_restart_s: float = UNHEALTHY_RESTART_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        now: float | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.policy = policy
        self.unhealthy_restart_s = unhealthy_restart_s
        self.startup_timeout_s = startup_timeout_s
        self.trackers = {child.name: RestartTracker(policy) for child in supervisor.children}
        self.due: dict[str, float] = {}  # child name → monotonic time of its next start
        self.give_up_status = 1  # `sluice up`'s exit status once `check` gives up on a child
        started = time.monotonic() if now is None else now
        self.runs = {name: _Run(proc.pid, started) for name, proc in supervisor.procs.items()}

    def on_health(self, name: str, pid: int, serving: bool, asked_at: float) -> None:
        """The answer of a health check of `name` (run `pid`) sent at `asked_at`."""
        run = self.runs[name]
        if serving and run.pid == pid:
            run.served = True
            run.last_serving = max(run.last_serving, asked_at)

    def all_served(self) -> bool:
        """True once every child's current run has answered SERVING."""
        return all(run.served for run in self.runs.values())

    def settled_kinds(self) -> set[str]:
        """The stage kinds none of whose children is starting, due a restart or being stopped: every
        current run has answered SERVING (standbys are started only then, so that their imports never
        compete with a start)."""
        busy = {
            child.kind
            for child in self.supervisor.children
            if child.name in self.due or not self.runs[child.name].served or self.runs[child.name].kill_at
        }
        return {child.kind for child in self.supervisor.children if child.kind in STAGES} - busy

    def check(self, now: float) -> str | None:
        """Notes new deaths, stops unhealthy children and starts those whose backoff has passed;
        returns the name of a child to give up on, if any."""
        for name, code in self.supervisor.dead_children():
            if name not in self.due and not self._schedule_restart(name, code, now):
                return name
        for child in self.supervisor.children:
            if child.name not in self.due:
                self._check_alive(child.name, now)
        for child in self.supervisor.children:
            if child.name in self.due and self.due[child.name] <= now:
                del self.due[child.name]
                self.supervisor.start_child(child)
                self.runs[child.name] = _Run(self.supervisor.procs[child.name].pid, now, restarted=True)
        return None

    def _schedule_restart(self, name: str, code: int, now: float) -> bool:
        """False when the policy gives up on `name`, or when it refused its configuration (exit status
        CONFIG_ERROR_STATUS: no restart can fix that; `give_up_status` is then that status)."""
        when = "" if self.runs[name].served else " during start-up"
        if code == CONFIG_ERROR_STATUS:
            print(
                f"sluice up: {name} exited with {describe_exit(code)}{when}: it refused its configuration "
                "(its message is above); not restarting it; stopping the others",
                file=sys.stderr,
                flush=True,
            )
            self.give_up_status = CONFIG_ERROR_STATUS
            return False
        delay = self.trackers[name].on_exit(now, self.runs[name].served)
        if delay is None:
            print(
                f"sluice up: {name} exited with {describe_exit(code)}{when} after {self.policy.max_restarts} "
                f"restarts within {self.policy.window_s:g}s; giving up and stopping the others",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f"sluice up: {name} exited with {describe_exit(code)}{when}; restarting it in {delay:g}s "
            f"(restart {self.trackers[name].recent} of {self.policy.max_restarts} allowed within "
            f"{self.policy.window_s:g}s)",
            file=sys.stderr,
            flush=True,
        )
        self.due[name] = now + delay
        return True

    def _check_alive(self, name: str, now: float) -> None:
        """SIGTERM to a served child silent or not SERVING for too long, or to a restarted one that has
        not served within the start-up timeout; SIGKILL once its grace is out."""
        run = self.runs[name]
        if run.kill_at is not None:
            if now >= run.kill_at:
                print(
                    f"sluice up: {name} did not stop {KILL_GRACE_S:g}s after SIGTERM; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                self.supervisor.procs[name].kill()
                run.kill_at = math.inf
            return
        if run.served and now - run.last_serving > self.unhealthy_restart_s:
            why = f"has not answered SERVING for {now - run.last_serving:.1f}s"
        elif not run.served and run.restarted and now - run.started > self.startup_timeout_s:
            why = f"has not answered SERVING {now - run.started:.1f}s after its restart"
        else:
            return
        print(f"sluice up: {name} {why}; stopping it to restart it", file=sys.stderr, flush=True)
        self.supervisor.terminate(name)
        run.kill_at = now + KILL_GRACE_S


Probe = Callable[[Child], Awaitable[bool]]
"""`probe(child)`: whether the child answers its grpc.health.v1 check with SERVING now."""


def health_probe(host: str, tls: ChannelTls | None, timeout_s: float) -> Probe:
    """Asks a child's grpc.health.v1 Check on `host` (the stages over `tls` when given, the gateway's
    public gRPC port in plaintext), on a fresh channel, within `timeout_s`: no answer is not SERVING."""

    async def probe(child: Child) -> bool:
        channel_tls = None if child.kind == "gateway" else tls
        async with client_channel(f"{host}:{child.grpc_port}", tls=channel_tls) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    return probe


class HealthChecks:
    """At most one health check in flight per child, in the background: a starting child is asked
    every WATCH_INTERVAL_S, a serving one every HEALTH_INTERVAL_S; answers go to the `Watcher`."""

    def __init__(self, supervisor: Supervisor, watcher: Watcher, probe: Probe) -> None:
        self.supervisor = supervisor
        self.watcher = watcher
        self.probe = probe
        self.pending: dict[str, tuple[asyncio.Task[bool], int, float]] = {}  # name → (check, pid, sent)
        self.sent: dict[str, float] = {}

    def poll(self, now: float) -> None:
        """Hands finished checks' answers to the watcher and sends the checks that are due."""
        for name, (task, pid, asked_at) in list(self.pending.items()):
            if task.done():
                del self.pending[name]
                serving = not task.cancelled() and task.exception() is None and task.result()
                self.watcher.on_health(name, pid, serving, asked_at)
        for child in self.supervisor.children:
            proc = self.supervisor.procs[child.name]
            run = self.watcher.runs[child.name]
            interval = HEALTH_INTERVAL_S if run.served else WATCH_INTERVAL_S
            if child.name in self.pending or proc.poll() is not None:
                continue
            if now - self.sent.get(child.name, -math.inf) >= interval:
                self.sent[child.name] = now
                task = asyncio.ensure_future(self.probe(child))
                self.pending[child.name] = (task, proc.pid, now)

    def cancel(self) -> None:
        for task, _, _ in self.pending.values():
            task.cancel()


def _parent_death_signal() -> Callable[[], None] | None:
    """A function for Popen's `preexec_fn` that has the child receive SIGTERM when the launcher dies
    (Linux prctl PR_SET_PDEATHSIG), or None elsewhere. libc is looked up here, in the launcher, so that
    the forked child only makes the one call. Linux sends the signal when the *thread* that started
    the child ends: `sluice up` starts every child from its main thread, which lives as long as it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the call: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return set_signal


def with_nice(preexec: Callable[[], None] | None, nice: int) -> Callable[[], None] | None:
    """`preexec` (or nothing) followed by adding `nice` to the forked child's nice value, before it
    runs: the child, and every thread it starts, then has the lower CPU priority. `preexec` itself
    when `nice` is 0. Raising a nice value needs no privilege; the kernel caps it at 19."""
    if nice <= 0:
        return preexec

    def lower() -> None:
        if preexec is not None:
            preexec()
        os.nice(nice)

    return lower


class Standby:
    """A pre-started process for one stage kind: `python -m sluice.launcher standby KIND FD` imports
    STANDBY_IMPORTS[KIND], writes a line to the pipe FD (ready), then waits for one line on its stdin,
    the JSON list of `sluice` arguments of the replica it is to become, and runs them in-process
    (`hand_over`); end of input instead makes it exit 0. It prints nothing unless it fails, and gets
    SIGTERM when the launcher dies, as the children do."""

    def __init__(self, kind: str, env: dict[str, str], preexec: Callable[[], None] | None) -> None:
        self.kind = kind
        ready_r, ready_w = os.pipe()
        command = [sys.executable, "-m", STANDBY_ENTRY, "standby", kind, str(ready_w)]
        try:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, env=env, preexec_fn=preexec, pass_fds=(ready_w,)
            )
        finally:
            os.close(ready_w)
        os.set_blocking(ready_r, False)
        self._ready_r: int | None = ready_r
        self.ready = False

    def poll(self) -> bool | None:
        """True once its imports are done, False while they run, None when it has exited."""
        if self.proc.poll() is not None:
            self._close_pipe()
            return None
        if not self.ready and self._ready_r is not None:
            with contextlib.suppress(BlockingIOError):
                self.ready = bool(os.read(self._ready_r, 64))
                self._close_pipe()
        return self.ready

    def hand_over(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Makes the (ready) standby run `sluice ARGV`; returns its process, now the replica's."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv).encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def stop(self) -> None:
        """Ends a standby that was not handed over: end of input, then SIGTERM (it may still import)."""
        self._close_pipe()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def _close_pipe(self) -> None:
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None


def _may_raise_priority(nice: int) -> bool:
    """Whether this process may set its nice value back to `nice` after raising it: with CAP_SYS_NICE,
    or an RLIMIT_NICE that allows it (nice values down to 20 - the limit)."""
    with open("/proc/self/status") as status:
        caps = next((line.split()[1] for line in status if line.startswith("CapEff:")), "0")
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return bool(int(caps, 16) >> CAP_SYS_NICE & 1) or soft == resource.RLIM_INFINITY or 20 - soft <= nice


def _yield_while_importing() -> Callable[[], None]:
    """Lowers this process's CPU priority by STANDBY_NICE while a standby imports, so that its imports
    yield to the serving replicas, where it may raise it back; returns what raises it back, for every
    thread of the process (a no-op where it may not: the standby then imports at the replicas' priority
    rather than leave a replica at a lower one).

    On Linux a nice value belongs to a thread (PRIO_PROCESS with a pid sets only that thread), and a new
    thread starts with its creator's: threads that the imports started (thread pools, a library's
    workers) would keep the lower priority after the hand-over, so the restore sets each thread's."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if sys.platform != "linux" or not _may_raise_priority(nice):
        return lambda: None
    os.setpriority(os.PRIO_PROCESS, 0, nice + STANDBY_NICE)
    return lambda: set_every_thread_nice(nice)


def standby_main(argv: list[str]) -> int:
    """The standby process (see `Standby`): `standby KIND READY_FD`."""
    kind, ready_fd = argv[0], int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the launcher stops us
    restore_priority = _yield_while_importing()
    for module in STANDBY_IMPORTS[kind]:
        importlib.import_module(module)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    sys.stdin.close()
    restore_priority()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from sluice.cli import main

    return main(json.loads(line))
