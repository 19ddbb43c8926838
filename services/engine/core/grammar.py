"""Structured outputs, host side: grammar specs, their compiles off the step thread, one state per request.

A request's grammar is a `GrammarSpec` (a JSON schema or object, regex, choice or grammar). The model's
`GrammarCompiler` compiles it on worker threads (llguidance, chosen by measurement: docs/benchmarks.md) and
caches it by key; the engine's `GrammarQueue` holds the request back until it is ready. Each request then
holds a `GrammarState`, advanced only with the tokens it keeps (`rollback`/`replay` for speculation and
preemption); the executor's masks (executor/grammar_mask.py) forbid the rest. An ended grammar allows only
EOS. Bad input raises `GrammarError` naming the problem (INVALID_ARGUMENT). llguidance's errors are sticky,
so `GrammarState` checks each token before consuming it. JSON whitespace is bounded (`JSON_WHITESPACE`,
services/common/constraints.py); `strict` schemas refuse keywords the library cannot enforce and close every
object schema (`additionalProperties: false`), non-strict ones follow JSON Schema's defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import llguidance

from services.common.constraints import JSON_WHITESPACE, closed_schema
from services.common.errors import INTERNAL, INVALID_ARGUMENT
from services.common.models import tokenizer_size

if TYPE_CHECKING:
    import torch

    from services.engine.core.request import Request

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_THREADS = 2
GRAMMAR_POLL_S = 0.001  # how often an engine with nothing else to do looks at grammars compiling
_MAX_ERROR_CHARS = 400

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A grammar the request gave cannot be used; the message names the problem (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to match: never a compiled object, so it travels in messages.

    `text` by kind: json_schema, the schema as JSON text; json_object, empty; regex, the pattern (Rust
    regex syntax, matched against the whole output); choice, a JSON list of strings; grammar, a Lark or
    GBNF (llama.cpp) grammar. `strict` matters for json_schema only. Construction checks the JSON-level
    shape and raises GrammarError; the library's own checks run when it is compiled.
    """

    kind: GrammarKind
    text: str = ""
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        self._canonical_text()

    @property
    def key(self) -> str:
        """Stable cache key: equal for specs that compile to the same grammar (JSON whitespace aside)."""
        strict = self.strict and self.kind == "json_schema"
        blob = f"{self.kind}\0{int(strict)}\0{self._canonical_text()}".encode()
        return hashlib.sha256(blob).hexdigest()

    def grammar(self) -> str:
        """The llguidance grammar for this spec (raises GrammarError when it cannot be built)."""
        if self.kind == "json_schema":
            schema = _parse_json(self.text, "json_schema")
            if self.strict:
                schema = closed_schema(schema, every_object=True)
            return _json_grammar(schema, lenient=not self.strict)
        if self.kind == "json_object":
            return _json_grammar({"type": "object"}, lenient=True)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in _parse_json(self.text, "choice"))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        try:
            return llguidance.grammar_from("grammar", self.text)
        except ValueError as exc:
            raise GrammarError(f"grammar: {_first_lines(str(exc))}") from exc

    def _canonical_text(self) -> str:
        if self.kind == "json_schema":
            schema = _parse_json(self.text, "json_schema")
            if not isinstance(schema, dict):
                raise GrammarError("json_schema: the schema must be a JSON object")
            return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if self.kind == "choice":
            choices = _parse_json(self.text, "choice")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice: expected a non-empty JSON list of strings")
            return json.dumps(choices, separators=(",", ":"), ensure_ascii=False)
        if self.kind == "json_object":
            return ""
        if not self.text:
            raise GrammarError(f"{self.kind}: the {self.kind} is empty")
        return self.text


def _parse_json(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"{kind}: not valid JSON ({exc})") from exc


def _json_grammar(schema: dict[str, Any], *, lenient: bool) -> str:
    options: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE, "lenient": lenient}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        raise GrammarError(f"json_schema: {_first_lines(str(exc))}") from exc


def _first_lines(message: str) -> str:
    """The library's error without its parser-state dump, bounded in length."""
    return message.split("\n<state>")[0].strip()[:_MAX_ERROR_CHARS]


class CompiledGrammar:
    """A spec compiled for one tokenizer: immutable, shared by every request with the same key.

    `new_state()` gives a request its own matcher (a copy of the compiled one, microseconds)."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher, eos_ids: frozenset[int]) -> None:
        self.spec = spec
        self._matcher = matcher
        self._eos_ids = eos_ids

    def new_state(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self._eos_ids)


class GrammarState:
    """One request's position in its grammar, advanced only with the tokens the request keeps.

    Invariants: the matcher never enters llguidance's (sticky) error state through a forbidden token:
    every token is checked before it is consumed, and `accept` stops at the first one the grammar forbids;
    the only way in is the library giving up on the grammar (`accept` raises GrammarError, and the state
    is of no further use: its request ends). `_recorded[i]` says whether
    kept token i is held by the matcher (EOS accepted after the grammar ended is not), so `rollback(n)`
    undoes exactly the last n accepted tokens. Not thread-safe: the step thread owns it.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos_ids = eos_ids
        self._recorded: list[bool] = []

    @property
    def num_tokens(self) -> int:
        """How many tokens have been accepted (and not rolled back)."""
        return len(self._recorded)

    def accept(self, tokens: Sequence[int]) -> int:
        """Accepts `tokens` in order while the grammar allows them; returns how many it accepted (fewer
        than given means tokens[result] is forbidden, and the state holds exactly the accepted prefix).
        Raises GrammarError when the library gives up on the grammar itself (a limit of its parser, e.g.
        a `choice` of more than 2,000 strings): the request cannot go on with it."""
        for i, token in enumerate(tokens):
            if self._matcher.is_stopped():
                if token not in self._eos_ids:
                    return i
                self._recorded.append(False)
                continue
            if self._matcher.validate_tokens([token]) != 1:
                if self._matcher.is_error():
                    raise self._gave_up()
                return i
            if not self._matcher.consume_token(token):
                raise self._gave_up()
            self._recorded.append(True)
        return len(tokens)

    def _gave_up(self) -> GrammarError:
        """The matcher's own limits stopped it (e.g. more than 2,000 alternatives alive at once): the
        grammar, not the token, is the problem."""
        detail = _first_lines(self._matcher.get_error())
        return GrammarError(f"grammar: the matcher cannot follow it after {self.num_tokens} tokens: {detail}")

    def rollback(self, n: int) -> None:
        """Undoes the last `n` accepted tokens (0 <= n <= num_tokens)."""
        if not 0 <= n <= len(self._recorded):
            raise ValueError(f"cannot roll back {n} of {len(self._recorded)} accepted tokens")
        undone = self._recorded[len(self._recorded) - n :]
        del self._recorded[len(self._recorded) - n :]
        held = sum(undone)
        if held and not self._matcher.rollback(held):
            raise RuntimeError(f"grammar matcher could not roll back {held} tokens")

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher, for the executor's batched mask fill (which leaves it as it was)."""
        return self._matcher

    def is_terminated(self) -> bool:
        """True when the grammar has ended: nothing but EOS may follow (the request finishes with stop)."""
        return self._matcher.is_stopped()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row]; bitmask: (rows, words) int32 on the host (the
        executor fills a whole step's rows at once: executor/grammar_mask.py)."""
        words = bitmask[row]
        assert words.device.type == "cpu" and words.element_size() == 4 and words.is_contiguous()
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def reset(self) -> None:
        """Back to the start of the grammar, as after `new_state()`."""
        self._matcher.reset()
        self._recorded.clear()

    def replay(self, tokens: Sequence[int]) -> int:
        """Resets, then accepts `tokens` (a preempted request's kept output); returns how many it accepted."""
        self.reset()
        return self.accept(tokens)


@dataclass(eq=False)
class _Job:
    """One compile, shared by every handle on its key while it is queued or running."""

    spec: GrammarSpec
    future: Future[CompiledGrammar] | None = None
    started: float | None = None  # time.monotonic() when a worker took it; None while queued
    wanted: int = 0  # handles on it not cancelled


class GrammarHandle:
    """One request's wait for a compile, in flight or done. `ready()` never blocks; once it is True,
    `result()` returns the compiled grammar at once or raises its GrammarError. `cancel()` when the
    request no longer waits (it ended)."""

    def __init__(self, job: _Job, future: Future[CompiledGrammar], compiler: GrammarCompiler) -> None:
        self.spec = job.spec
        self._job = job
        self._future = future
        self._compiler: GrammarCompiler | None = compiler

    def ready(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CompiledGrammar:
        return self._future.result(timeout)

    @property
    def started(self) -> float | None:
        """`time.monotonic()` when the compile began running (None while it is queued)."""
        return self._job.started

    def cancel(self) -> None:
        """The request no longer waits for this compile (idempotent): a queued compile that no other
        request waits for is dropped from the queue and never runs. A running one cannot be stopped (the
        library has no way to): it finishes on its worker and its result is cached for later requests."""
        compiler, self._compiler = self._compiler, None
        if compiler is not None:
            compiler._release(self._job)


class GrammarCompiler:
    """Compiles GrammarSpecs for one model's tokenizer on worker threads and caches them by key.

    Contract: `submit` never waits for a compile: a cached key returns a handle on the same compile
    (the same CompiledGrammar object once done), otherwise the compile is queued on the executor:
    `max_workers` threads, so that one slow compile (a schema with thousands of branches takes about a
    second) does not hold up the others. llguidance releases the GIL while it compiles (measured on 2 busy
    cores: a worker building the matcher of a 3,000-branch schema for 1.0 s kept a main thread's 1 ms
    sleep loop out 104 ms in all, as a worker that only sleeps did, 214 ms, against 1,712 ms for one
    running Python), so compiles run beside the step thread. A compile whose every handle was cancelled
    before it started never runs. Successful compiles stay in a least-recently-used cache of `cache_size`
    keys; failed and cancelled ones are forgotten. Thread-safe. The compiler owns the executor it creates
    (`close` shuts it down); one passed in stays the caller's. The engine bounds how long a compile may run
    (`grammar_compile_timeout_s`, `GrammarQueue`); a queued one waits for its turn, bounded
    by its requests' deadlines.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        eos_ids: frozenset[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_workers: int = DEFAULT_COMPILE_THREADS,
        executor: Executor | None = None,
    ) -> None:
        self.vocab_size: int = tokenizer.vocab_size  # bits per bitmask row, >= the model's logits width
        self.eos_ids = eos_ids
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, _Job] = OrderedDict()
        self._lock = threading.RLock()  # a future cancelled under it runs `_forget_failure` at once

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, *, vocab_size: int, eos_ids: frozenset[int], **kwargs: Any
    ) -> GrammarCompiler:
        """Sized from `model_dir`'s tokenizer.json and the model's `vocab_size` (the larger of the two:
        models pad their output layer), with the model's `eos_ids` (the engine passes its runner's).
        Building the tokenizer's index takes about 25 ms at 8k tokens and 1 s at 152k."""
        text = (Path(model_dir) / "tokenizer.json").read_text()
        n_vocab = max(vocab_size, tokenizer_size(Path(model_dir)) or 0)
        tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=sorted(eos_ids) or None)
        return cls(tokenizer, frozenset(tokenizer.eos_tokens), **kwargs)

    def submit(self, spec: GrammarSpec) -> GrammarHandle:
        key = spec.key
        with self._lock:
            job = self._cache.get(key)
            if job is not None and job.future is not None:
                self._cache.move_to_end(key)
                job.wanted += 1
                return GrammarHandle(job, job.future, self)
            job = _Job(spec, wanted=1)
            future = job.future = self._executor.submit(self._run, job)
            self._cache[key] = job
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failure(key, done))
        return GrammarHandle(job, future, self)

    def close(self) -> None:
        """Cancels queued compiles and, when the compiler made its executor, shuts it down."""
        with self._lock:
            for job in self._cache.values():
                if job.future is not None:
                    job.future.cancel()
            self._cache.clear()
        if self._owns_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _release(self, job: _Job) -> None:
        """A handle on `job` was cancelled: the compile leaves the queue once nobody waits for it."""
        with self._lock:
            job.wanted -= 1
            if job.wanted > 0 or job.future is None or not job.future.cancel():
                return  # still wanted, or running or done (a running compile cannot be stopped)
            key = job.spec.key
            if self._cache.get(key) is job:
                del self._cache[key]

    def _run(self, job: _Job) -> CompiledGrammar:
        job.started = time.monotonic()
        return self._compile(job.spec)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        matcher = llguidance.LLMatcher(self._tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind}: {_first_lines(matcher.get_error())}")
        return CompiledGrammar(spec, matcher, self.eos_ids)

    def _forget_failure(self, key: str, future: Future[CompiledGrammar]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                job = self._cache.get(key)
                if job is not None and job.future is future:
                    del self._cache[key]


class GrammarQueue:
    """The engine's grammar waiting room: requests held back, outside the scheduler, until their grammar
    compiled (the step never waits for a compile). Used on the engine's thread only.

    Contract: `take` hands out, in arrival order, the requests whose compile is done, each with its own
    `GrammarState`, and the failures: a compile error (`invalid_argument`, the compiler's words), a compile
    that has been RUNNING longer than `timeout_s` (the grammar is too complex: `invalid_argument`), a
    failure of the compiler itself (`internal`). Time spent queued behind other compiles never counts (the
    request's own deadline bounds that wait). `cancel` a request that ends meanwhile (a queued compile
    nobody else waits for never runs)."""

    def __init__(self, compiler: GrammarCompiler | None, timeout_s: float) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self.compiling: dict[Request, GrammarHandle] = {}

    def __len__(self) -> int:
        return len(self.compiling)

    def submit(self, req: Request) -> None:
        assert self.compiler is not None and req.sampling.grammar is not None, "validated"
        self.compiling[req] = self.compiler.submit(req.sampling.grammar)

    def cancel(self, req: Request) -> None:
        """`req` no longer waits for its compile (nothing when it does not wait)."""
        handle = self.compiling.pop(req, None)
        if handle is not None:
            handle.cancel()

    def clear(self) -> None:
        for handle in self.compiling.values():
            handle.cancel()
        self.compiling = {}

    def take(self, now: float) -> tuple[list[Request], list[tuple[Request, str, str]]]:
        """(ready requests, (request, error class, detail) of those that failed); see the class docstring.
        A request that timed out stays here until the engine fails it (which cancels its wait)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str, str]] = []
        for req, handle in list(self.compiling.items()):
            if not handle.ready():  # read once: a compile may finish between two reads
                if self.timed_out(handle, now):
                    ran = f"{now - handle.started:.1f}s" if handle.started is not None else "?"
                    timeout = f"grammar_compile_timeout_s ({self.timeout_s:g}s)"
                    detail = f"grammar: compiling it took longer than {timeout} (running {ran}): it is too "
                    failed.append((req, INVALID_ARGUMENT, detail + "large or complex; simplify it"))
                continue
            del self.compiling[req]
            try:
                req.grammar = handle.result().new_state()
            except GrammarError as exc:
                failed.append((req, INVALID_ARGUMENT, str(exc)))
            except Exception as exc:  # the compiler itself failed (or was closed)
                failed.append((req, INTERNAL, f"grammar compile failed: {exc!r}"))
            else:
                ready.append(req)
        return ready, failed

    def idle_s(self, now: float) -> float:
        """How long an engine with nothing else to do may wait before looking again: `GRAMMAR_POLL_S` while
        every compile is unsettled (poll, never spin), 0 when one is settled or none waits."""
        if self.compiling and not any(self.settled(h, now) for h in self.compiling.values()):
            return GRAMMAR_POLL_S
        return 0.0

    def settled(self, handle: GrammarHandle, now: float) -> bool:
        """Whether a compile is done or has been running longer than `timeout_s`."""
        return handle.ready() or self.timed_out(handle, now)

    def timed_out(self, handle: GrammarHandle, now: float) -> bool:
        """Whether a compile has been running longer than `timeout_s` at `now`. A compile still queued never
        has: the queue's length says nothing about the grammar."""
        started = handle.started
        return started is not None and now - started >= self.timeout_s


def model_grammar_compiler(
    model_dir: Path, vocab_size: int, eos_ids: frozenset[int], threads: int
) -> GrammarCompiler | None:
    """The model's grammar compiler, from its tokenizer.json (None, with a warning, without one: requests
    with a grammar are then refused)."""
    if not (model_dir / "tokenizer.json").exists():
        log.warning("structured outputs off: %s has no tokenizer.json", model_dir)
        return None
    return GrammarCompiler.from_model_dir(
        model_dir, vocab_size=vocab_size, eos_ids=eos_ids, max_workers=threads
    )
