"""Structured outputs and logit bias in the engine, on the tiny model (real tokenizer, random weights):
every output of a mixed grammar workload is valid, at temperature 0 and 1, under preemption, prefix hits,
chunked prefill, async scheduling and speculation for the other requests of the batch; the step never
waits for a compile; a bad grammar is an invalid_argument final naming the problem; logit bias moves
greedy's pick; a request with none of these takes none of their paths."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from services.common.errors import DEADLINE_EXCEEDED, INVALID_ARGUMENT
from services.engine.core.engine import LLMEngine
from services.engine.core.grammar import GrammarCompiler, GrammarSpec
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.executor.grammar_mask import GrammarBatch
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE

SCHEMAS: list[dict[str, Any]] = [
    {  # flat object: string, integer range, boolean, enum, all required
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "active": {"type": "boolean"},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "active", "role"],
        "additionalProperties": False,
    },
    {  # an array of short strings and a bounded number, one optional field
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["tags", "score"],
        "additionalProperties": False,
    },
    {  # nested objects, an enum of mixed types
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {"type": "integer", "minimum": -5, "maximum": 5},
                    "c": {"enum": ["x", "y", 1, None]},
                },
                "required": ["b", "c"],
                "additionalProperties": False,
            },
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
]
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so", "ça va"]
MAX_NEW = 96


def specs() -> list[GrammarSpec]:
    out = [GrammarSpec("json_schema", json.dumps(s)) for s in SCHEMAS]
    open_object = {k: v for k, v in SCHEMAS[0].items() if k != "additionalProperties"}
    out.append(GrammarSpec("json_schema", json.dumps(open_object), strict=True))  # strict closes it
    out += [
        GrammarSpec("json_object"),
        GrammarSpec("regex", REGEX),
        GrammarSpec("choice", json.dumps(CHOICES)),
    ]
    return out


def check(spec: GrammarSpec, text: str) -> None:
    """Fails unless `text` is a complete output of `spec`."""
    if spec.kind == "json_schema":
        schema = json.loads(spec.text)
        if spec.strict:
            schema = schema | {"additionalProperties": schema.get("additionalProperties", False)}
        jsonschema.validate(json.loads(text), schema)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def steer(tokenizer: Tokenizer) -> tuple[tuple[int, float], ...]:
    """A logit bias that keeps the random model's outputs short: whitespace-only tokens banned (JSON may
    put up to 20 blanks between any two tokens), closing tokens favoured (a number, a string or an open
    object may otherwise run on). The grammar still decides what is allowed: bias first, then the mask."""
    bias: dict[int, float] = {}
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        if text and not text.strip():
            bias[i] = -100.0
        elif text in ('"', "}", "]", '"}', '"]', "}]", "]}", "}}"):
            bias[i] = 8.0
    return tuple(sorted(bias.items()))


def engine_for(model_dir: Path, **kw: object) -> LLMEngine:
    settings: dict[str, object] = dict(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype="float32",
        max_num_batched_tokens=512,
        num_kv_blocks=200,
        max_num_seqs=64,
        max_model_len=256,
    )
    settings.update(kw)
    return LLMEngine(EngineSettings(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return engine_for(tiny_model_dir)


Item = tuple[list[int], SamplingParams, StoppingParams]


def grammar_items(n: int, bias: tuple[tuple[int, float], ...], seed: int = 0) -> list[Item]:
    """n requests cycling through every spec, alternately greedy and sampled (seeded), varied prompts."""
    all_specs = specs()
    items: list[Item] = []
    for i in range(n):
        spec = all_specs[i % len(all_specs)]
        temperature = float((i // len(all_specs)) % 2)
        prompt = [5 + (seed + i * 7) % 900, 9, 40 + i % 50, 3 + (i * 13) % 700]
        sampling = SamplingParams(temperature=temperature, seed=seed + i, grammar=spec, logit_bias=bias)
        items.append((prompt, sampling, StoppingParams(max_new_tokens=MAX_NEW)))
    return items


def run(engine: LLMEngine, items: list[Item], prefix: str = "") -> dict[str, list[RequestOutput]]:
    """Adds every item (ids `prefix` + index), steps until idle; outputs by request."""
    for i, (prompt, sampling, stopping) in enumerate(items):
        engine.add_request(f"{prefix}{i}", prompt, sampling, stopping)
    outs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        assert steps < 5000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for rid, seq in outs.items():
        assert [o.finished for o in seq].count(True) == 1 and seq[-1].finished, rid
    return outs


def ids(seq: list[RequestOutput]) -> list[int]:
    return [t for o in seq for t in o.new_token_ids]


def text_of(seq: list[RequestOutput], tok: Tokenizer) -> str:
    """The output's text, EOS left out (the tiny model's EOS ids are 2 and 4)."""
    return tok.decode([t for t in ids(seq) if t not in (2, 4)], skip_special_tokens=False)


def assert_valid(
    outs: dict[str, list[RequestOutput]], items: list[Item], tok: Tokenizer, prefix: str = ""
) -> None:
    """Every request ended with stop (its grammar ended, or EOS where the grammar accepts) and its text
    is a complete output of its grammar."""
    for i, (_, sampling, _) in enumerate(items):
        seq = outs[f"{prefix}{i}"]
        assert seq[-1].finish_reason == "stop", (i, seq[-1].finish_reason, seq[-1].error)
        assert sampling.grammar is not None
        check(sampling.grammar, text_of(seq, tok))


def test_mixed_grammars_at_temperature_0_and_1_are_all_valid(
    engine: LLMEngine, tokenizer: Tokenizer, steer: tuple[tuple[int, float], ...]
) -> None:
    items = grammar_items(216, steer)
    outs = run(engine, items)
    assert_valid(outs, items, tokenizer)
    for i, (_, sampling, _) in enumerate(items):
        assert sampling.grammar is not None
        if sampling.grammar.kind == "choice" and sampling.greedy:
            assert text_of(outs[str(i)], tokenizer) in CHOICES


def test_greedy_choice_is_one_of_the_choices_without_any_bias(
    engine: LLMEngine, tokenizer: Tokenizer
) -> None:
    spec = GrammarSpec("choice", json.dumps(CHOICES))
    items = [
        ([7, 8, 9 + i], SamplingParams(grammar=spec), StoppingParams(max_new_tokens=16)) for i in range(8)
    ]
    outs = run(engine, items, prefix="choice")
    assert_valid(outs, items, tokenizer, prefix="choice")


def test_preemption_prefix_hits_chunked_prefill_and_async_give_the_same_valid_outputs(
    tiny_model_dir: Path, engine: LLMEngine, tokenizer: Tokenizer, steer: tuple[tuple[int, float], ...]
) -> None:
    shared = list(range(100, 180))  # 5 blocks shared by every prompt: prefix hits
    items = [
        ([*shared, *prompt], sampling, stopping)
        for prompt, sampling, stopping in grammar_items(24, steer, seed=7)
    ]
    expected = run(engine, items, prefix="ref")
    assert_valid(expected, items, tokenizer, prefix="ref")
    for settings in (
        dict(num_kv_blocks=24, max_num_batched_tokens=64),  # preemption and chunked prefill
        dict(async_scheduling="on", max_num_batched_tokens=48),  # async, chunked prefill
    ):
        other = engine_for(tiny_model_dir, **settings)
        got = run(other, items, prefix="ref")
        finals = {
            k: (v[-1].finish_reason, v[-1].error) for k, v in got.items() if v[-1].finish_reason != "stop"
        }
        assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in expected.items()}, (
            settings,
            finals,
        )
        stats = other.stats()
        if settings.get("num_kv_blocks") == 24:
            assert stats.num_preemptions > 0, "the pool is too small for all: preemption must happen"
        assert any(o.cached_tokens > 0 for seq in got.values() for o in seq if o.finished), "prefix hits"


def test_speculation_for_plain_requests_none_for_grammar_requests(
    tiny_model_dir: Path, tokenizer: Tokenizer, steer: tuple[tuple[int, float], ...]
) -> None:
    engine = engine_for(tiny_model_dir, speculative="ngram", speculative_disable_batch_size=64)
    assert engine.speculator is not None
    proposed: list[tuple[bool, int]] = []  # (has a grammar, drafts) per request given drafts
    propose = engine.speculator.propose

    def spy(sched: Any, num_running: int) -> bool:
        drafted = propose(sched, num_running)
        proposed.extend((r.grammar is not None, len(r.draft_ids)) for r, _ in sched.scheduled if r.draft_ids)
        return drafted

    engine.speculator.propose = spy  # type: ignore[method-assign]
    items = grammar_items(8, steer, seed=3)
    repeat = [5, 6, 7, 8] * 6  # a prompt that repeats: the n-gram proposer finds matches
    items += [(repeat, SamplingParams(), StoppingParams(max_new_tokens=24)) for _ in range(4)]
    outs = run(engine, items)
    assert_valid(outs, items[:8], tokenizer)
    assert any(d for g, d in proposed if not g), "plain requests got drafts in the same batches"
    assert not any(g for g, _ in proposed), "no grammar request ever got drafts"
    reference = run(engine_for(tiny_model_dir), items, prefix="ref")
    assert [ids(outs[str(i)]) for i in range(8)] == [ids(reference[f"ref{i}"]) for i in range(8)]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})),
            "nope",
        ),
        (GrammarSpec("regex", "(?=a)b"), "regex"),
        (GrammarSpec("grammar", "start: ("), "grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_ends_its_request_with_invalid_argument(
    engine: LLMEngine, spec: GrammarSpec, words: str
) -> None:
    outs = run(
        engine,
        [
            ([5, 6], SamplingParams(grammar=spec), StoppingParams(max_new_tokens=4)),
            ([5, 7], SamplingParams(), StoppingParams(max_new_tokens=4)),  # unharmed
        ],
        prefix="bad",
    )
    final = outs["bad0"][-1]
    assert final.finish_reason == "error" and not ids(outs["bad0"])
    assert final.error is not None and final.error_code == INVALID_ARGUMENT and words in final.error
    assert outs["bad1"][-1].finish_reason == "length" and len(ids(outs["bad1"])) == 4


@pytest.fixture
def held_compiler(tiny_model_dir: Path) -> Iterator[tuple[GrammarCompiler, threading.Event]]:
    """A compiler whose compiles wait for the event (set it to let them run)."""
    gate = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    pool.submit(gate.wait)  # the pool's only worker is busy until the gate opens
    compiler = GrammarCompiler.from_model_dir(
        tiny_model_dir, vocab_size=8192, eos_ids=frozenset([2, 4]), executor=pool
    )
    yield compiler, gate
    gate.set()
    compiler.close()
    pool.shutdown()


def test_the_step_never_waits_for_a_compile(
    tiny_model_dir: Path, engine: LLMEngine, held_compiler: tuple[GrammarCompiler, threading.Event]
) -> None:
    compiler, gate = held_compiler
    engine.grammars.compiler, saved = compiler, engine.grammars.compiler
    try:
        spec = GrammarSpec("regex", "[a-z]{3} held")
        engine.add_request("g", [5, 6], SamplingParams(grammar=spec), StoppingParams(max_new_tokens=30))
        engine.add_request("p", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=3))
        outs: dict[str, list[RequestOutput]] = {}
        for _ in range(3):  # the plain request runs to its end while the compile is held
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
        assert outs["p"][-1].finished and "g" not in outs
        assert engine.idle_s() > 0, "nothing but a compile to wait for: the driver polls, never spins"
        gate.set()
        for handle in list(engine.grammars.compiling.values()):
            handle.result(timeout=30)
        assert engine.idle_s() == 0, "a finished compile must wake the driver (it waits while idle_s > 0)"
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
        assert outs["g"][-1].finish_reason == "stop"
    finally:
        engine.grammars.compiler = saved


def drive(engine: LLMEngine, outs: dict[str, list[RequestOutput]]) -> None:
    """Steps as the loop thread does (waiting `idle_s` while only compiles are left) until every request
    ended; generous deadline."""
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine never ended its requests"
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        time.sleep(engine.idle_s())


def test_a_compile_past_its_timeout_ends_its_request_only(
    engine: LLMEngine, held_compiler: tuple[GrammarCompiler, threading.Event]
) -> None:
    """A compile that runs longer than grammar_compile_timeout_s (it never ends here) ends its request
    `invalid_argument`, naming the setting. The plain request beside it is unharmed."""
    compiler, gate = held_compiler
    gate.set()  # the worker is free; the compile itself waits
    real, hold = compiler._compile, threading.Event()

    def compile_(spec: GrammarSpec) -> Any:
        hold.wait(60)
        return real(spec)

    compiler._compile = compile_  # type: ignore[method-assign]
    saved = engine.grammars.compiler, engine.grammars.timeout_s
    engine.grammars.compiler = compiler
    engine.grammars.timeout_s = 0.2
    try:
        spec = GrammarSpec("regex", "[a-z]{3} running")
        engine.add_request("g", [5, 6], SamplingParams(grammar=spec), StoppingParams(max_new_tokens=30))
        engine.add_request("p", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=3, ignore_eos=True))
        outs: dict[str, list[RequestOutput]] = {}
        drive(engine, outs)
    finally:
        engine.grammars.compiler, engine.grammars.timeout_s = saved
        hold.set()
    final = outs["g"][-1]
    assert final.finish_reason == "error" and not ids(outs["g"]) and final.error is not None
    assert "grammar_compile_timeout_s (0.2s)" in final.error
    assert final.error_code == INVALID_ARGUMENT
    assert outs["p"][-1].finish_reason == "length" and len(ids(outs["p"])) == 3
    assert not engine.grammars.compiling


def test_a_burst_of_distinct_grammars_queued_past_the_timeout_all_complete(
    engine: LLMEngine, held_compiler: tuple[GrammarCompiler, threading.Event], tokenizer: Tokenizer
) -> None:
    """Time queued behind other compiles is not the grammar's fault: 12 distinct grammars on one compile
    thread, held in the queue for several times grammar_compile_timeout_s, all compile and every request
    ends with a valid output (a queued wait used to end them `unavailable`, with no tokens)."""
    compiler, gate = held_compiler
    timeout = 0.5
    saved = engine.grammars.compiler, engine.grammars.timeout_s
    engine.grammars.compiler = compiler
    engine.grammars.timeout_s = timeout
    specs_ = [GrammarSpec("regex", f"[a-z]{{2}} burst{i}") for i in range(12)]
    outs: dict[str, list[RequestOutput]] = {}
    try:
        for i, spec in enumerate(specs_):
            sampling = SamplingParams(grammar=spec)
            engine.add_request(f"b{i}", [5, 6 + i], sampling, StoppingParams(max_new_tokens=30))
        queued_until = time.monotonic() + 3 * timeout
        while time.monotonic() < queued_until:  # the engine steps while every compile waits in the queue
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
            time.sleep(min(engine.idle_s(), 0.05))
        assert not outs, "no request may end while its compile is only queued"
        assert len(engine.grammars.compiling) == len(specs_)
        gate.set()
        drive(engine, outs)
    finally:
        engine.grammars.compiler, engine.grammars.timeout_s = saved
    for i in range(len(specs_)):
        final = outs[f"b{i}"][-1]
        assert final.finish_reason == "stop", (i, final.finish_reason, final.error)
        text = text_of(outs[f"b{i}"], tokenizer)
        assert re.fullmatch(f"[a-z]{{2}} burst{i}", text), (i, text)
    assert not engine.grammars.compiling


def record_compiles(compiler: GrammarCompiler) -> list[GrammarSpec]:
    """The specs `compiler` compiles from now on, in order (its `_compile` wrapped)."""
    compiled: list[GrammarSpec] = []
    real = compiler._compile

    def compile_(spec: GrammarSpec) -> Any:
        compiled.append(spec)
        return real(spec)

    compiler._compile = compile_  # type: ignore[method-assign]
    return compiled


def test_a_queued_compile_waits_until_its_request_deadline(
    engine: LLMEngine, held_compiler: tuple[GrammarCompiler, threading.Event]
) -> None:
    """A queued compile's wait is bounded by its request's deadline: past it, the request ends
    `deadline_exceeded` with no tokens and its compile leaves the queue (it never runs); the plain request
    beside it is unharmed."""
    compiler, gate = held_compiler
    compiled = record_compiles(compiler)
    saved = engine.grammars.compiler, engine.grammars.timeout_s
    engine.grammars.compiler = compiler
    engine.grammars.timeout_s = 0.05
    try:
        spec = GrammarSpec("regex", "[a-z]{3} queued")
        deadline = time.monotonic() + 0.5
        stopping = StoppingParams(max_new_tokens=30)
        engine.add_request("g", [5, 6], SamplingParams(grammar=spec), stopping, deadline=deadline)
        engine.add_request("p", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=3, ignore_eos=True))
        outs: dict[str, list[RequestOutput]] = {}
        drive(engine, outs)
        gate.set()
    finally:
        engine.grammars.compiler, engine.grammars.timeout_s = saved
    final = outs["g"][-1]
    assert final.finish_reason == "error" and not ids(outs["g"]) and final.error is not None
    assert final.error_code == DEADLINE_EXCEEDED, final.error
    assert outs["p"][-1].finish_reason == "length" and len(ids(outs["p"])) == 3
    assert not engine.grammars.compiling
    compiler.submit(GrammarSpec("regex", "[a-z]{3} after")).result(timeout=30)  # the queue has moved on
    assert spec not in compiled, "the expired request's queued compile never ran"


def test_an_aborted_request_cancels_its_queued_compile(
    engine: LLMEngine, held_compiler: tuple[GrammarCompiler, threading.Event]
) -> None:
    compiler, gate = held_compiler
    compiled = record_compiles(compiler)
    engine.grammars.compiler, saved = compiler, engine.grammars.compiler
    try:
        dropped, kept = GrammarSpec("regex", "[a-z]{3} dropped"), GrammarSpec("regex", "[a-z]{3} kept")
        engine.add_request("g", [5, 6], SamplingParams(grammar=dropped), StoppingParams(max_new_tokens=30))
        engine.add_request("k", [5, 6], SamplingParams(grammar=kept), StoppingParams(max_new_tokens=30))
        engine.abort_request("g")
        gate.set()
        outs: dict[str, list[RequestOutput]] = {}
        drive(engine, outs)
    finally:
        engine.grammars.compiler = saved
    assert outs["g"][-1].finish_reason == "cancelled"
    assert outs["k"][-1].finish_reason == "stop"
    assert compiled == [kept], "the aborted request's compile never ran"


def test_logit_bias_plus_100_makes_greedy_pick_a_token_and_minus_100_bans_it(engine: LLMEngine) -> None:
    stopping = StoppingParams(max_new_tokens=6, ignore_eos=True)
    plain = run(engine, [([11, 12, 13], SamplingParams(), stopping)], prefix="plain")
    natural = ids(plain["plain0"])
    favoured = 777 if 777 not in natural else 778
    outs = run(
        engine,
        [
            ([11, 12, 13], SamplingParams(logit_bias=((favoured, 100.0),)), stopping),
            ([11, 12, 13], SamplingParams(logit_bias=tuple((t, -100.0) for t in set(natural))), stopping),
        ],
        prefix="bias",
    )
    assert ids(outs["bias0"]) == [favoured] * 6
    assert not set(ids(outs["bias1"])) & set(natural)


def test_a_plain_request_takes_no_mask_bias_or_prompt_path(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    for name in ("fill", "mask_"):
        original = getattr(GrammarBatch, name)

        def spy(self: GrammarBatch, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(GrammarBatch, name, spy)
    kept: list[int] = []
    execute = engine.runner.execute

    def spy_execute(*args: Any) -> Any:
        out = execute(*args)
        kept.append(len(engine.runner.prompt_logits))
        return out

    monkeypatch.setattr(engine.runner, "execute", spy_execute)
    items = [
        ([20 + i, 21, 22], SamplingParams(temperature=float(i % 2), seed=i), StoppingParams(max_new_tokens=5))
        for i in range(6)
    ]
    outs = run(engine, items, prefix="plain-path")
    assert all(len(ids(seq)) == 5 for seq in outs.values())
    assert calls == [] and kept and not any(kept)
    assert all(o.prompt_logprobs is None for seq in outs.values() for o in seq)
    spec = GrammarSpec("choice", json.dumps(CHOICES))
    run(engine, [([7, 8], SamplingParams(grammar=spec), StoppingParams(max_new_tokens=8))], prefix="masked")
    assert "mask_" in calls, "the spy sees a grammar request's masks"


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        (SamplingParams(logit_bias=((8192, 1.0),)), "logit_bias: token id 8192"),
        (SamplingParams(logit_bias=((5, 100.5),)), "logit_bias: the bias of token 5"),
        (SamplingParams(logit_bias=((5, float("nan")),)), "logit_bias: the bias of token 5"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias has 301 entries"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    engine: LLMEngine, sampling: SamplingParams, words: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.add_request("refused", [5, 6], sampling, StoppingParams())
    assert "refused" not in engine.requests


def test_an_engine_without_a_tokenizer_refuses_grammars(llama_dir: Path) -> None:
    plain = engine_for(llama_dir, num_kv_blocks=24)  # the test model directory has no tokenizer.json
    assert plain.grammar_compiler is None
    with pytest.raises(ValueError, match="structured outputs are not served"):
        plain.add_request("g", [5, 6], SamplingParams(grammar=GrammarSpec("json_object")), StoppingParams())
