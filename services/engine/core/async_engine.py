"""AsyncEngine: the engine's step loop on its own thread, with asyncio-facing callers.

The loop thread owns the `LLMEngine`: it applies queued submits and aborts, runs `step()`, and
hands outputs to their callers; it sleeps on a condition when there is nothing to do, and while a
dynamic or static batch forms (`LLMEngine.idle_s`), so that a submit or an abort wakes it at once. The
event loop never runs the model.

`AsyncEngine.build(factory)` also constructs the engine on that thread, so that every torch operation of
the process runs on one thread. On CPU this matters: torch's OpenMP runtime (libgomp) keeps one worker
pool per thread that runs parallel work, and once the process has more pool threads than cores, its
workers stop spinning and sleep at every barrier. A model loaded on one thread and stepped on another
made two pools, and on 2 cores the step thread then stood waiting for its woken worker about 45% of
the time (measured with per-thread CPU times: 5.2 s on CPU in 9.8 s of stepping).

A `Caller` is one consumer (a multiplexed gRPC stream or one `Generate` call). Its outputs are
coalesced per request in a single slot: a reader that falls behind gets several steps' tokens merged
into one `RequestOutput`, never a growing queue. `await caller.get()` returns everything pending for
all of the caller's requests at once, so a stream sends one message per step (or fewer).

Request ids are scoped per caller; inside the engine a request is known as `<caller key>/<id>`.

A `ReportFeed` is one consumer's view of the engine's load and prefix cache: it opens with a snapshot
of every cached block hash, taken on the loop thread between steps, and then gets, after each step, the
cache changes (`BlockManager.take_events`) and the new load, merged until the consumer takes them: a
consumer that applies the snapshot and then every report in order knows the cache exactly.

With async scheduling (services/engine/core/engine.py) a step's outputs are those of the step launched before
it; the loop keeps stepping while a launched step is unread (`LLMEngine.has_unfinished_requests`), and
aborts applied between steps take effect at the next one.

A step that raises fails the engine's requests and the loop goes on (outputs it produced before are
delivered). A step that fails `max_step_failures` times in a row (EngineSettings: the step itself is
broken, not one request) counts as a failure of the loop. If the loop itself fails (that, failing a
broken step's requests raised too, or `inject_fault`), it ends every caller's requests with an
`unavailable` error final at once and recovers in-process: the `on_recovery` callbacks learn it failed
(the server turns NOT_SERVING), submits meanwhile are refused `unavailable`, `LLMEngine.reset` rebuilds
the request state over the loaded model (every KV block free, the prefix cache dropped), every report
feed gets a new snapshot (an empty cache: a gateway mirroring it forgets every key; a feed opened
meanwhile gets its first one), the loop starts again and the callbacks learn it serves (SERVING again).
The count of failed steps survives the rebuild: a step still broken after it fails the loop again at its
first failure. Callers stay open. The budget: `loop_recoveries` recoveries within
`loop_recovery_window_s` (EngineSettings). One failure more, a rebuild that raises, or a failure that is
not an `Exception`, is for good: later submits are refused `unavailable` and the `on_fatal` callbacks
run (the server marks itself NOT_SERVING for good, for its supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import INVALID_ARGUMENT, UNAVAILABLE, error_message
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.core.stats import EngineStats

log = logging.getLogger(__name__)

THREAD_NAME = "engine-loop"


@dataclass
class _Submit:
    engine_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    trace_context: Mapping[str, str] | None
    deadline: float | None


@dataclass
class _Abort:
    engine_id: str


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load after a step (all callers together)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    queued_prompt_tokens: int  # prompt tokens not yet computed, waiting and part-prefilled requests
    block_size: int
    prefix_caching: bool


@dataclass
class Report:
    """What a `ReportFeed` hands out: the load, and the cache changes since the previous report
    (`snapshot`: `stored` is the whole cache). A hash is in at most one of `stored` and `removed`."""

    load: EngineLoad
    snapshot: bool
    stored: list[bytes]
    removed: list[bytes]


class ReportFeed:
    """Load and prefix-cache reports for one consumer (see the module docstring). Use `next()` from one
    event loop; `close()` detaches it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._snapshot: list[bytes] | None = None
        self._changes: dict[bytes, bool] = {}
        self._load: EngineLoad | None = None
        self._sent_load: EngineLoad | None = None
        self._event = asyncio.Event()
        self.closed = False

    async def next(self) -> Report:
        """Waits until the load or the cache changed since the previous report (the first report: the
        snapshot) and returns the change."""
        while True:
            self._event.clear()
            with self._lock:
                report = self._take()
            if report is not None:
                return report
            await self._event.wait()

    def close(self) -> None:
        self.closed = True

    def _take(self) -> Report | None:
        load = self._load
        if load is None:
            return None
        if self._snapshot is not None:
            # Changes published after the snapshot was taken stay queued for the next report.
            stored, self._snapshot = self._snapshot, None
            self._sent_load = load
            return Report(load, True, stored, [])
        if not self._changes and load == self._sent_load:
            return None
        changes, self._changes = self._changes, {}
        self._sent_load = load
        stored = [h for h, kept in changes.items() if kept]
        removed = [h for h, kept in changes.items() if not kept]
        return Report(load, False, stored, removed)

    # ---- called on the loop thread -------------------------------------------------------------

    def _start(self, cached: list[bytes], load: EngineLoad) -> None:
        with self._lock:
            self._snapshot, self._load = cached, load
            self._changes.clear()  # everything before the snapshot is in it
        self._wake()

    def _publish(self, changes: dict[bytes, bool], load: EngineLoad) -> None:
        with self._lock:
            if self._load is None:
                return
            self._changes.update(changes)
            self._load = load
        self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the consumer's event loop is gone
            self.closed = True


@dataclass
class _Subscribe:
    feed: ReportFeed


def error_final(request_id: str, error_class: str, detail: str) -> RequestOutput:
    """The final output of a request that ends with an error before or outside the engine's steps."""
    message = error_message(error_class, detail)
    return RequestOutput(request_id, [], None, True, "error", 0, 0, error=message)


class Caller:
    """One consumer's view of the engine. Use from a single event loop; `close()` aborts what is left."""

    def __init__(self, engine: AsyncEngine, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self.key = key
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[str, RequestOutput] = {}  # coalesced outputs by request id (insertion order)
        self._rejected: list[RequestOutput] = []  # error finals of submits that never entered the engine
        self._event = asyncio.Event()
        self._in_flight: set[str] = set()
        self._input_closed = False
        self._closed = False

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stopping: StoppingParams,
        *,
        trace_context: Mapping[str, str] | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queues a request for the next step. ValueError (nothing queued) on bad input or a request id
        already in flight for this caller. `deadline` (`time.monotonic()`) ends the request with an
        error once passed."""
        if self._closed:
            raise ValueError("caller is closed")
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        engine_id = self._engine_id(request_id)
        self._engine.engine.validate_request(engine_id, prompt_ids, sampling, stopping)
        self._in_flight.add(request_id)
        submit = _Submit(engine_id, list(prompt_ids), sampling, stopping, trace_context, deadline)
        self._engine._post(submit, self, request_id)

    def reject(self, request_id: str, message: str) -> None:
        """Reports a bad submit as a final output with finish_reason "error", class `invalid_argument`
        (the caller goes on)."""
        self._rejected.append(error_final(request_id, INVALID_ARGUMENT, message))
        self._event.set()

    def abort(self, request_id: str) -> None:
        """Aborts one request of this caller; idempotent, unknown ids are ignored."""
        if request_id in self._in_flight:
            self._engine._post(_Abort(self._engine_id(request_id)), self, request_id)

    def close_input(self) -> None:
        """No more submits will come: `get` returns [] once nothing is in flight."""
        self._input_closed = True
        self._event.set()

    def close(self) -> None:
        """Aborts every request still in flight and detaches the caller. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for request_id in list(self._in_flight):
            self._engine._post(_Abort(self._engine_id(request_id)), self, request_id)

    def done(self) -> bool:
        return self._input_closed and not self._in_flight and not self._rejected and not self._pending

    async def get(self) -> list[RequestOutput]:
        """Waits for outputs and returns all pending ones (one per request, merged), rejected submits
        first. Returns [] when the input is closed and nothing is left."""
        while True:
            if self.done():
                return []
            self._event.clear()
            with self._lock:
                outputs = list(self._pending.values())
                self._pending.clear()
            for out in outputs:
                if out.finished:
                    self._in_flight.discard(out.request_id)
            if self._rejected:  # never in flight: a duplicate id must not end the request it duplicates
                outputs[:0] = self._rejected
                self._rejected = []
            if outputs:
                return outputs
            await self._event.wait()

    # ---- called on the loop thread -------------------------------------------------------------

    def _deliver(self, outputs: list[tuple[str, RequestOutput]]) -> None:
        """Adds one step's outputs for this caller, all under one lock, so that `get` never returns
        part of a step: (caller's request id, output) pairs."""
        if self._closed:
            return
        with self._lock:
            was_empty = not self._pending
            for request_id, out in outputs:
                out.request_id = request_id
                slot = self._pending.get(request_id)
                if slot is None:
                    self._pending[request_id] = out
                else:
                    slot.merge(out)
        if was_empty:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the caller's event loop is gone
                self._closed = True

    def _engine_id(self, request_id: str) -> str:
        return f"{self.key}/{request_id}"


class AsyncEngine:
    """Runs an `LLMEngine` on a dedicated thread: `AsyncEngine(engine).start()`, or
    `await AsyncEngine.build(factory)` to construct the engine on that thread too; `stop()` at shutdown."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[tuple[_Submit | _Abort | _Subscribe, Caller | None, str]] = []
        self._feeds: list[ReportFeed] = []
        self._last_load: EngineLoad | None = None
        engine.block_manager.track_events = True
        self._owners: dict[str, tuple[Caller, str]] = {}  # engine id → (caller, caller's request id)
        self._keys = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._failure: str | None = None  # why the loop stopped, after an unrecoverable failure
        self._recovering: str | None = None  # why the loop failed, while it is rebuilt
        self._recoveries: deque[float] = deque()  # monotonic times of the recoveries in the window
        self._fatal_callbacks: list[Callable[[str], None]] = []
        self._failed_callbacks: list[Callable[[str], None]] = []  # see on_recovery
        self._recovered_callbacks: list[Callable[[int], None]] = []
        self._fault_injected = False

    def start(self) -> None:
        """Starts the loop on a new thread."""
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @classmethod
    async def build(cls, factory: Callable[[], LLMEngine]) -> AsyncEngine:
        """Calls `factory()` on a new thread and runs the loop on that same thread; returns once the
        engine is built (the loop is running). An exception from `factory` is raised here."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[AsyncEngine] = loop.create_future()

        def main() -> None:
            try:
                engine = cls(factory())
            except BaseException as exc:
                loop.call_soon_threadsafe(built.set_exception, exc)
                return
            engine._thread = threading.current_thread()
            loop.call_soon_threadsafe(built.set_result, engine)
            engine._run()

        threading.Thread(target=main, name=THREAD_NAME, daemon=True).start()
        return await built

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the loop thread after its current step; requests still in the engine are dropped."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)

    def open_caller(self) -> Caller:
        return Caller(self, f"c{next(self._keys)}", asyncio.get_running_loop())

    def open_feed(self) -> ReportFeed:
        """A new feed of load and cache reports; its first report (the snapshot) comes after the loop
        thread's next pass. `feed.close()` when done."""
        feed = ReportFeed(asyncio.get_running_loop())
        self._post(_Subscribe(feed), None, "")
        return feed

    def idle(self) -> bool:
        """True when no command is queued and the engine holds no request."""
        with self._cond:
            return not self._commands and not self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The engine's figures after its latest step."""
        return self._stats

    def failure(self) -> str | None:
        """None while the loop serves; after an unrecoverable failure, why it stopped."""
        return self._failure

    def on_fatal(self, callback: Callable[[str], None]) -> None:
        """Calls `callback(reason)` once if the loop stops after an unrecoverable failure: on the loop
        thread then, or here at once if it already has. The callback must not block."""
        with self._cond:
            if self._failure is None:
                self._fatal_callbacks.append(callback)
                return
        callback(self._failure)

    def on_recovery(self, failed: Callable[[str], None], recovered: Callable[[int], None]) -> None:
        """Calls `failed(reason)` when the loop has failed and is about to be rebuilt (its callers told),
        and `recovered(n)` once it serves again (`n`: recoveries within the window, this one included);
        both on the loop thread, and they must not block. A failure beyond the budget calls neither
        (see `on_fatal`)."""
        with self._cond:
            self._failed_callbacks.append(failed)
            self._recovered_callbacks.append(recovered)

    def inject_fault(self) -> None:
        """Makes the loop fail at its next pass, as a failure of the loop itself would (callers get
        `unavailable`, then the loop recovers within its budget, else `on_fatal` runs). For
        fault-injection tests only (docs/reliability.md)."""
        with self._cond:
            self._fault_injected = True
            self._cond.notify()

    def _post(self, command: _Submit | _Abort | _Subscribe, caller: Caller | None, request_id: str) -> None:
        """Queues a command for the loop's next pass. While the loop is rebuilt a submit is refused
        `unavailable` at once (an abort has nothing left to end) but a subscription is queued: its feed
        opens with the rebuilt engine's snapshot. After a failure for good, nothing is queued."""
        with self._cond:
            refusal = self._failure or self._recovering
            if refusal is None or (self._failure is None and isinstance(command, _Subscribe)):
                self._commands.append((command, caller, request_id))
                self._cond.notify()
                return
        if isinstance(command, _Submit) and caller is not None:
            caller._deliver([(request_id, error_final(request_id, UNAVAILABLE, refusal))])

    # ---- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception as exc:
                log.exception("engine loop failed")
                if not self._recover(f"engine loop stopped: {exc}"):
                    return
            except BaseException as exc:  # the loop is about to die: no caller may wait on it
                log.exception("engine loop failed")
                self._fail_callers(f"engine loop stopped: {exc}")
                return

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._wait_for_work()
                if self._stopping:
                    return
                if self._fault_injected:
                    raise RuntimeError("injected fault")
                for command, caller, request_id in self._commands:
                    self._apply(command, caller, request_id)
                self._commands.clear()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step must not kill the loop
                log.exception("engine step raised")
                outputs = self.engine.fail_all(f"internal error in engine step: {exc}")  # may raise: fatal
            self._stats = self.engine.stats()  # before the outputs: a caller that saw them sees these figures
            self._dispatch(outputs)  # outputs already produced are delivered, even by a broken step
            self._report()
            if self.engine.step_broken:  # the step fails every time: rebuild, as after a loop failure
                failed = self.engine.failed_steps_in_a_row
                raise RuntimeError(f"{failed} engine steps failed in a row: {self.engine.last_step_error}")

    def _wait_for_work(self) -> None:
        """Waits, holding `_cond`, until a command or a stop arrives, or the engine has a step to run."""
        while not self._commands and not self._stopping and not self._fault_injected:
            if not self.engine.has_unfinished_requests():
                self._cond.wait()
            elif (idle_s := self.engine.idle_s()) > 0:
                self._cond.wait(idle_s)
            else:
                return

    def _apply(self, command: _Submit | _Abort | _Subscribe, caller: Caller | None, request_id: str) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.engine_id)
            return
        if isinstance(command, _Subscribe):
            # Between steps: every change before now was taken by the previous `_report`.
            command.feed._start(list(self.engine.block_manager.cached), self._load())
            self._feeds.append(command.feed)
            return
        assert caller is not None
        try:
            self.engine.add_request(
                command.engine_id,
                command.prompt_ids,
                command.sampling,
                command.stopping,
                trace_context=command.trace_context,
                deadline=command.deadline,
            )
        except ValueError as exc:
            caller._deliver([(request_id, error_final(request_id, INVALID_ARGUMENT, str(exc)))])
            return
        self._owners[command.engine_id] = (caller, request_id)

    def _load(self) -> EngineLoad:
        engine = self.engine
        scheduler, bm = engine.scheduler, engine.block_manager
        queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running)
        return EngineLoad(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_total=bm.num_blocks,
            queued_prompt_tokens=queued,
            block_size=bm.block_size,
            prefix_caching=bm.enable_prefix_caching,
        )

    def _report(self) -> None:
        """Hands the step's cache changes and the load to every open feed."""
        changes = self.engine.block_manager.take_events()
        if not self._feeds:
            return
        load = self._load()
        if not changes and load == self._last_load:
            return
        self._last_load = load
        self._feeds = [feed for feed in self._feeds if not feed.closed]
        for feed in self._feeds:
            feed._publish(changes, load)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hands one step's outputs to their callers: one delivery per caller per step."""
        by_caller: dict[Caller, list[tuple[str, RequestOutput]]] = {}
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:
                continue
            if out.finished:
                del self._owners[out.request_id]
            caller, request_id = owner
            by_caller.setdefault(caller, []).append((request_id, out))
        for caller, delivered in by_caller.items():
            caller._deliver(delivered)

    def _recover(self, reason: str) -> bool:
        """After the loop failed with `reason`: within the budget, ends every caller's requests
        `unavailable`, rebuilds the engine's request state and hands every feed a new snapshot (True:
        serve again); beyond it, or when the rebuild raises, fails for good (`_fail_callers`, False)."""
        settings = self.engine.settings
        window_s, budget = settings.loop_recovery_window_s, settings.loop_recoveries
        now = time.monotonic()
        while self._recoveries and now - self._recoveries[0] >= window_s:
            self._recoveries.popleft()
        if len(self._recoveries) >= budget:
            used = f"{len(self._recoveries)} recoveries within {window_s:g}s already"
            self._fail_callers(f"{reason} ({used})")
            return False
        self._recoveries.append(now)
        with self._cond:
            self._recovering = reason
            self._fault_injected = False
            failed, recovered = list(self._failed_callbacks), list(self._recovered_callbacks)
        _call_each(failed, reason)  # first: the service hears of it before its callers see errors
        self._end_requests(reason, keep_subscribes=True)
        try:
            self.engine.reset()
            self._stats = self.engine.stats()
            self._last_load = None
            with self._cond:  # submits are queued again, for the loop's next pass
                self._recovering = None
            self._feeds = [feed for feed in self._feeds if not feed.closed]
            load = self._load()
            for feed in self._feeds:
                feed._start([], load)  # the cache is empty now: the consumer forgets every key
        except Exception as exc:
            log.exception("engine rebuild failed")
            self._fail_callers(f"{reason}; rebuilding the engine failed: {exc}")
            return False
        _call_each(recovered, len(self._recoveries))
        return True

    def _end_requests(self, reason: str, *, keep_subscribes: bool = False) -> None:
        """Ends every request the loop knows of (in the engine or still queued) with an `unavailable`
        error final; drops the queued commands (but subscriptions, with `keep_subscribes`)."""
        with self._cond:
            owners = list(self._owners.values())
            owners += [
                (caller, rid)
                for cmd, caller, rid in self._commands
                if isinstance(cmd, _Submit) and caller is not None
            ]
            kept = [c for c in self._commands if keep_subscribes and isinstance(c[0], _Subscribe)]
            self._owners, self._commands = {}, kept
        by_caller: dict[Caller, list[tuple[str, RequestOutput]]] = {}
        for caller, request_id in owners:
            final = error_final(request_id, UNAVAILABLE, reason)
            by_caller.setdefault(caller, []).append((request_id, final))
        for caller, finals in by_caller.items():
            caller._deliver(finals)

    def _fail_callers(self, reason: str) -> None:
        """For good: ends every request the loop knows of with an `unavailable` error final, refuses
        later submits, and calls the `on_fatal` callbacks."""
        with self._cond:
            self._failure = reason
            self._recovering = None
            callbacks, self._fatal_callbacks = self._fatal_callbacks, []
        _call_each(callbacks, reason)
        self._end_requests(reason)


def _call_each(callbacks: Sequence[Callable[[Any], None]], arg: object) -> None:
    """Calls every callback with `arg`; one that raises is logged and the others still run."""
    for callback in callbacks:
        try:
            callback(arg)
        except Exception:
            log.exception("engine callback failed")
