"""AsyncEngine: the engine's step loop on its own thread, with asyncio-facing callers.

The loop thread owns the `LLMEngine` (`build` constructs it there too, so torch keeps one OpenMP pool): it
applies queued submits and aborts between steps, runs `step()`, hands outputs to their callers and
publishes the routing reports (core/reports.py); it sleeps while there is nothing to do or a batch forms.
A `Caller` (a gRPC stream or one `Generate`) validates a request once, on its event loop
(`LLMEngine.make_request`); the loop adds it (`LLMEngine.add`: the duplicate-id check). Outputs are
coalesced per request in one slot (never a growing queue); ids are scoped per caller (`<caller key>/<id>`).
A step that raises fails its requests and the loop goes on; a loop failure (or `max_step_failures` in a
row) ends every caller's requests `unavailable` and rebuilds in-process (`LLMEngine.reset`, an empty
snapshot per feed) within `loop_recoveries` per `loop_recovery_window_s`; past that, for good (`on_fatal`).
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

from services.common.errors import INVALID_ARGUMENT, UNAVAILABLE
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.core.reports import ReportFeed, Reports
from services.engine.core.request import Request
from services.engine.core.stats import EngineStats

log = logging.getLogger(__name__)

THREAD_NAME = "engine-loop"


@dataclass
class _Submit:
    request: Request  # validated (`LLMEngine.make_request`)
    trace_context: Mapping[str, str] | None


@dataclass
class _Abort:
    engine_id: str


@dataclass
class _Subscribe:
    feed: ReportFeed


def error_final(request_id: str, error_class: str, detail: str) -> RequestOutput:
    """The final output of a request that ends with an error before or outside the engine's steps."""
    return RequestOutput(request_id, [], None, True, "error", 0, 0, error=detail, error_code=error_class)


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
        engine = self._engine.engine
        request = engine.make_request(self._engine_id(request_id), prompt_ids, sampling, stopping, deadline)
        self._in_flight.add(request_id)
        self._engine._post(_Submit(request, trace_context), self, request_id)

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
        self._reports = Reports()
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
        engine is built (the loop is running). An exception from `factory` is raised here. On CPU this
        matters: torch's OpenMP runtime keeps one worker pool per thread that runs parallel work, and with
        more pool threads than cores its workers sleep at every barrier; a model loaded on one thread and
        stepped on another left the step thread waiting for its woken worker about 45% of the time on 2
        cores (5.2 s on CPU in 9.8 s of stepping)."""
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
            self._reports.publish(self.engine)
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
            self._reports.subscribe(command.feed, self.engine)  # between steps
            return
        assert caller is not None
        try:
            self.engine.add(command.request, trace_context=command.trace_context)
        except ValueError as exc:  # an id already in flight
            caller._deliver([(request_id, error_final(request_id, INVALID_ARGUMENT, str(exc)))])
            return
        self._owners[command.request.request_id] = (caller, request_id)

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
        serve again); beyond it, or when the rebuild raises, fails for good (`_fail_callers`, False).
        Meanwhile submits are refused `unavailable` and callers stay open; the count of failed steps
        survives the rebuild (a step still broken fails the loop again at its first failure)."""
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
            with self._cond:  # submits are queued again, for the loop's next pass
                self._recovering = None
            self._reports.restart(self.engine)  # the cache is empty now: the consumer forgets every key
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
