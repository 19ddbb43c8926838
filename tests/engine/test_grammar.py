"""Structured-output grammars on the tiny model's tokenizer: random walks under the mask always produce
output that matches, and the state's rollback / replay / termination keep the contract."""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from services.common.errors import INVALID_ARGUMENT
from services.engine.core.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarQueue,
    GrammarSpec,
    GrammarState,
)
from services.engine.executor.grammar_mask import GrammarBatch, apply_bitmask_, bitmask_words
from services.engine.executor.model_runner import read_eos_ids

SAMPLES = 100
MAX_TOKENS = 2000
FINISH_AFTER = 200  # tokens of a json_object walk before it steers towards the end
BITS = torch.arange(32, dtype=torch.int32)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active", "role"],
    "additionalProperties": False,
}
ORDERS = {
    "type": "array",
    "minItems": 1,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "paid": {"type": ["boolean", "null"]},
            "lines": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"enum": ["a-1", "b-2"]},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "price", "lines"],
        "additionalProperties": False,
    },
}
EVENT = {  # strict: objects are closed even without additionalProperties
    "type": "object",
    "properties": {
        "kind": {"const": "click"},
        "at": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
        "meta": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["ok"],
        },
    },
    "required": ["kind", "at", "meta"],
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"
CHOICES = ["positive", "negative", "neutral", "mixed feelings", "ça va"]
GBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
GBNF_TEXT = re.compile(r"\(([0-9]|[1-9][0-9])(,([0-9]|[1-9][0-9]))*\)")


def make_compiler(model_dir: Path, **kwargs: Any) -> GrammarCompiler:
    """The compiler as the engine builds it: the model's vocab_size and EOS ids as its runner reads them."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    eos_ids = read_eos_ids(model_dir, config)
    return GrammarCompiler.from_model_dir(model_dir, vocab_size=config.vocab_size, eos_ids=eos_ids, **kwargs)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> Iterator[GrammarCompiler]:
    made = make_compiler(tiny_model_dir)
    yield made
    made.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> torch.Tensor:
    """Token ids whose bit is set in bitmask[row] (sorted), below `vocab`."""
    bits = ((bitmask[row].unsqueeze(1) >> BITS) & 1).flatten()[:vocab]  # (32·W,) → (vocab,)
    return bits.nonzero().flatten()


def mask_of(state: GrammarState, vocab: int) -> list[int]:
    bitmask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    state.fill_mask(bitmask, 0)
    return allowed(bitmask, 0, vocab).tolist()


def walk(
    state: GrammarState, compiler: GrammarCompiler, gen: torch.Generator, closers: torch.Tensor | None = None
) -> list[int]:
    """Samples uniformly among the allowed tokens until EOS or the grammar's end; the kept ids (EOS
    excluded). After FINISH_AFTER tokens, when `closers` (a (vocab,) bool tensor) is given and some closer
    is allowed, samples uniformly among the allowed closers instead, so that an unbounded grammar ends.
    Fails when the walk does not end within MAX_TOKENS."""
    bitmask = torch.zeros((1, bitmask_words(compiler.vocab_size)), dtype=torch.int32)
    out: list[int] = []
    for step in range(MAX_TOKENS):
        state.fill_mask(bitmask, 0)
        ids = allowed(bitmask, 0, compiler.vocab_size)
        if closers is not None and step >= FINISH_AFTER and closers[ids].any():
            ids = ids[closers[ids]]
        token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
        assert state.accept([token]) == 1
        if token in compiler.eos_ids:
            return out
        out.append(token)
        if state.is_terminated():
            return out
    raise AssertionError(f"the walk did not end within {MAX_TOKENS} tokens")


def sample_texts(
    compiler: GrammarCompiler,
    tokenizer: Tokenizer,
    spec: GrammarSpec,
    seed: int,
    closers: torch.Tensor | None = None,
) -> list[str]:
    compiled = compiler.submit(spec).result()
    gen = torch.Generator().manual_seed(seed)
    return [
        tokenizer.decode(walk(compiled.new_state(), compiler, gen, closers), skip_special_tokens=False)
        for _ in range(SAMPLES)
    ]


@pytest.mark.parametrize(
    ("schema", "strict"),
    [(PERSON, False), (ORDERS, False), (EVENT, True)],
    ids=["person", "orders", "event-strict"],
)
def test_json_schema_samples_validate(
    compiler: GrammarCompiler, tokenizer: Tokenizer, schema: dict[str, Any], strict: bool
) -> None:
    spec = GrammarSpec("json_schema", json.dumps(schema), strict=strict)
    closed = json.loads(json.dumps(schema))
    if strict:
        closed["additionalProperties"] = False
        closed["properties"]["meta"]["additionalProperties"] = False
    for text in sample_texts(compiler, tokenizer, spec, seed=len(json.dumps(schema))):
        jsonschema.validate(json.loads(text), closed)


def test_json_object_samples_are_objects(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    closers = torch.zeros(compiler.vocab_size, dtype=torch.bool)  # (vocab,): '"', '}', ']' and EOS
    for token in range(tokenizer.get_vocab_size()):
        closers[token] = tokenizer.decode([token], skip_special_tokens=False) in ('"', "}", "]")
    closers[sorted(compiler.eos_ids)] = True
    texts = sample_texts(compiler, tokenizer, GrammarSpec("json_object"), seed=3, closers=closers)
    for text in texts:
        assert isinstance(json.loads(text), dict), text
    assert any(len(text) > 100 for text in texts)  # free-form objects, not only {}


def test_regex_samples_match(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    for text in sample_texts(compiler, tokenizer, GrammarSpec("regex", REGEX), seed=4):
        assert re.fullmatch(REGEX, text), text


def test_choice_samples_are_choices(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    texts = sample_texts(compiler, tokenizer, GrammarSpec("choice", json.dumps(CHOICES)), seed=5)
    assert set(texts) <= set(CHOICES)
    assert len(set(texts)) > 1


def test_gbnf_grammar_samples_match(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    for text in sample_texts(compiler, tokenizer, GrammarSpec("grammar", GBNF), seed=6):
        assert GBNF_TEXT.fullmatch(text), text


def test_lark_grammar_is_accepted(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    spec = GrammarSpec("grammar", 'start: "id-" NUM\nNUM: /[0-9]{2}/')
    for text in sample_texts(compiler, tokenizer, spec, seed=7)[:10]:
        assert re.fullmatch(r"id-[0-9]{2}", text), text


def some_path(compiler: GrammarCompiler, spec: GrammarSpec, seed: int) -> list[int]:
    """A kept path through the grammar, ending with an EOS accepted after the grammar's end."""
    state = compiler.submit(spec).result().new_state()
    path = walk(state, compiler, torch.Generator().manual_seed(seed))
    return [*path, min(compiler.eos_ids)]


def masks_along(state: GrammarState, tokens: list[int], vocab: int) -> list[list[int]]:
    """The mask before each token and after the last, accepting them one by one."""
    masks = []
    for token in tokens:
        masks.append(mask_of(state, vocab))
        assert state.accept([token]) == 1
    masks.append(mask_of(state, vocab))
    return masks


def test_rollback_then_reaccept_equals_straight_path(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    path = some_path(compiler, spec, seed=11)
    compiled = compiler.submit(spec).result()
    straight = masks_along(compiled.new_state(), path, compiler.vocab_size)

    state = compiled.new_state()
    for k in (1, 3, 7, len(path)):  # the EOS after the end, tokens before it, and everything
        assert state.accept(path) == len(path)
        state.rollback(k)
        assert state.num_tokens == len(path) - k
        assert mask_of(state, compiler.vocab_size) == straight[len(path) - k]
        assert state.accept(path[len(path) - k :]) == k
        assert state.is_terminated()
        assert mask_of(state, compiler.vocab_size) == straight[-1]
        state.rollback(len(path))
    assert masks_along(state, path, compiler.vocab_size) == straight


def test_replay_after_reset_equals(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("json_schema", json.dumps(ORDERS))
    path = some_path(compiler, spec, seed=12)
    compiled = compiler.submit(spec).result()
    fresh = compiled.new_state()
    state = compiled.new_state()
    state.accept(path[: len(path) // 2])
    state.reset()
    assert state.num_tokens == 0
    assert mask_of(state, compiler.vocab_size) == mask_of(fresh, compiler.vocab_size)
    cut = len(path) - 3
    assert state.replay(path[:cut]) == cut
    assert fresh.accept(path[:cut]) == cut
    assert mask_of(state, compiler.vocab_size) == mask_of(fresh, compiler.vocab_size)


def test_accept_stops_at_the_first_forbidden_token(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = compiler.submit(GrammarSpec("regex", "[0-9]+")).result().new_state()
    digits = tokenizer.encode("12", add_special_tokens=False).ids
    letters = tokenizer.encode("ab", add_special_tokens=False).ids
    assert state.accept([*digits, *letters, *digits]) == len(digits)
    assert state.num_tokens == len(digits)
    assert state.accept(digits) == len(digits)  # the refused token left no error behind


def test_termination_allows_only_eos(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = compiler.submit(GrammarSpec("choice", json.dumps(["yes", "no"]))).result().new_state()
    ids = tokenizer.encode("yes", add_special_tokens=False).ids
    assert not state.is_terminated()
    assert state.accept(ids) == len(ids)
    assert state.is_terminated()
    assert mask_of(state, compiler.vocab_size) == sorted(compiler.eos_ids)
    assert state.accept(tokenizer.encode("no", add_special_tokens=False).ids) == 0
    assert state.accept([max(compiler.eos_ids)]) == 1
    assert mask_of(state, compiler.vocab_size) == sorted(compiler.eos_ids)


def test_cached_compile_returns_the_same_object(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"cached": {"type": "integer"}}}
    first = compiler.submit(GrammarSpec("json_schema", json.dumps(schema))).result()
    again = compiler.submit(GrammarSpec("json_schema", json.dumps(schema, indent=4))).result()
    assert again is first
    assert compiler.submit(GrammarSpec("json_schema", json.dumps(schema), strict=True)).result() is not first
    assert GrammarSpec("regex", "a", strict=True).key == GrammarSpec("regex", "a").key


def test_cache_is_bounded_lru(tiny_model_dir: Path) -> None:
    small = make_compiler(tiny_model_dir, cache_size=2)
    try:
        a, b, c = (GrammarSpec("regex", pattern) for pattern in ("a+", "b+", "c+"))
        first_a = small.submit(a).result()
        small.submit(b).result()
        assert small.submit(a).result() is first_a  # a is now the most recently used
        small.submit(c).result()  # evicts b
        assert small.submit(a).result() is first_a
        first_b = small.submit(b).result()
        assert small.submit(b).result() is first_b
        assert small.submit(c).result() is not None
    finally:
        small.close()


def test_compile_runs_off_the_caller_thread_and_polls_without_blocking(tiny_model_dir: Path) -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    pool.submit(gate.wait)  # the only worker is busy until the gate opens
    polled = make_compiler(tiny_model_dir, executor=pool)
    try:
        handle = polled.submit(GrammarSpec("regex", "[a-z]+"))
        assert not handle.ready()
        gate.set()
        compiled = handle.result()
        assert handle.ready()
        assert compiled.spec == GrammarSpec("regex", "[a-z]+")
    finally:
        gate.set()
        polled.close()
        pool.shutdown()


TOO_MANY_BRANCHES = [
    (GrammarSpec("choice", json.dumps([f"answer number {i}" for i in range(2001)])), "answer number 7"),
    (
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {f"k{i}": {"type": "integer"}},
                            "required": [f"k{i}"],
                        }
                        for i in range(2001)
                    ]
                }
            ),
        ),
        '{"k5": 1}',
    ),
]


@pytest.mark.parametrize(("spec", "text"), TOO_MANY_BRANCHES, ids=["choice", "anyOf"])
def test_a_grammar_the_matcher_gives_up_on_raises_a_grammar_error(
    compiler: GrammarCompiler, tiny_model_dir: Path, spec: GrammarSpec, text: str
) -> None:
    """llguidance follows at most 2,000 alternatives in one parser row: a choice of 2,001 strings with a
    common prefix, or an anyOf of 2,001 objects, compiles, then a valid output is too much for it.
    `accept` says so, briefly."""
    state = compiler.submit(spec).result(timeout=60).new_state()
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    with pytest.raises(GrammarError, match="max is 2000") as err:
        state.accept(ids)
    assert len(str(err.value)) < 1000 and "<state>" not in str(err.value)


class HeldCompiles:
    """Makes a compiler's compiles of `held` specs wait for `gate`; records every spec compiled."""

    def __init__(self, compiler: GrammarCompiler, held: set[GrammarSpec]) -> None:
        self.gate = threading.Event()
        self.compiled: list[GrammarSpec] = []
        real = compiler._compile

        def compile_(spec: GrammarSpec) -> Any:
            self.compiled.append(spec)
            if spec in held:
                self.gate.wait(60)
            return real(spec)

        compiler._compile = compile_  # type: ignore[method-assign]


def test_a_slow_compile_does_not_hold_up_the_next_one(tiny_model_dir: Path) -> None:
    """Compiles run on several threads: while one (a schema with thousands of branches) runs, another
    request's grammar compiles."""
    compiler = make_compiler(tiny_model_dir)
    slow = GrammarSpec("regex", "slow [a-z]+")
    held = HeldCompiles(compiler, {slow})
    try:
        slow_handle = compiler.submit(slow)
        fast = compiler.submit(GrammarSpec("regex", "fast [a-z]+"))
        assert fast.result(timeout=30).spec == GrammarSpec("regex", "fast [a-z]+")
        assert not slow_handle.ready()
    finally:
        held.gate.set()
        compiler.close()


def test_a_cancelled_compile_leaves_the_queue_and_never_runs(tiny_model_dir: Path) -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    pool.submit(gate.wait)  # the only worker is busy until the gate opens
    compiler = make_compiler(tiny_model_dir, executor=pool)
    held = HeldCompiles(compiler, set())
    dropped, shared, kept = (GrammarSpec("regex", p) for p in ("dropped+", "shared+", "kept+"))
    try:
        handle = compiler.submit(dropped)
        assert handle.started is None  # queued
        handle.cancel()
        handle.cancel()  # idempotent
        first, second = compiler.submit(shared), compiler.submit(shared)
        first.cancel()  # the other request still waits for it
        kept_handle = compiler.submit(kept)
        gate.set()
        assert kept_handle.result(timeout=30) is not None and kept_handle.started is not None
        assert second.result(timeout=30) is not None
        assert held.compiled == [shared, kept]
        again = compiler.submit(dropped)  # forgotten, not cached as cancelled: compiled anew
        assert again.result(timeout=30).spec == dropped
    finally:
        gate.set()
        compiler.close()
        pool.shutdown()


def test_a_running_compile_finishes_and_is_cached_after_its_request_cancelled(tiny_model_dir: Path) -> None:
    compiler = make_compiler(tiny_model_dir)
    spec = GrammarSpec("regex", "running [a-z]+")
    held = HeldCompiles(compiler, {spec})
    try:
        handle = compiler.submit(spec)
        for _ in range(60_000):  # until a worker takes it
            if handle.started is not None:
                break
            threading.Event().wait(0.001)
        handle.cancel()
        held.gate.set()
        compiled = handle.result(timeout=30)
        assert compiler.submit(spec).result(timeout=30) is compiled  # cached for the next request
        assert held.compiled == [spec]
    finally:
        held.gate.set()
        compiler.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (lambda: GrammarSpec("yaml", "a: 1"), "unknown grammar kind 'yaml'"),
        (lambda: GrammarSpec("json_schema", '{"type": '), "json_schema: not valid JSON"),
        (lambda: GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
        (lambda: GrammarSpec("choice", '"yes"'), "non-empty JSON list of strings"),
        (lambda: GrammarSpec("choice", "[]"), "non-empty JSON list of strings"),
        (lambda: GrammarSpec("choice", '["a", 1]'), "non-empty JSON list of strings"),
        (lambda: GrammarSpec("regex", ""), "regex is empty"),
    ],
)
def test_malformed_specs_raise(spec: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        spec()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json_schema", '{"type": "objekt"}'), "Invalid type: objekt"),
        (GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}', strict=True), "uniqueItems"),
        (GrammarSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "minLength"),
        (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec("regex", "(?=a)b"), "look-around"),
        (GrammarSpec("grammar", "start: foo"), 'unknown name: "foo"'),
        (GrammarSpec("grammar", "root ::= foo"), "Rule 'foo' not found"),
    ],
)
def test_bad_grammars_fail_their_compile(compiler: GrammarCompiler, spec: GrammarSpec, message: str) -> None:
    handle = compiler.submit(spec)
    with pytest.raises(GrammarError, match=re.escape(message)):
        handle.result()
    assert handle.ready()
    assert compiler.submit(spec) is not handle  # failures are not cached


def test_non_strict_schema_ignores_what_it_cannot_enforce(compiler: GrammarCompiler) -> None:
    compiler.submit(GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}')).result()


def test_strict_closes_objects_but_not_data() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object"}, "v": {"const": {"a": 1}}},
        "$defs": {"d": {"properties": {"x": {}}}},
        "anyOf": [{"type": "object"}, {"type": "string"}],
    }
    spec = GrammarSpec("json_schema", json.dumps(schema), strict=True)
    grammar = json.loads(spec.grammar())
    closed = grammar["grammars"][0]["json_schema"]
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["v"] == {"const": {"a": 1}}
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "string"}]


def test_vocab_follows_the_model_when_it_exceeds_the_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tokenizer_vocab = config["vocab_size"]
    config["vocab_size"] = tokenizer_vocab + 100
    (tmp_path / "config.json").write_text(json.dumps(config))
    padded = make_compiler(tmp_path)
    try:
        assert padded.vocab_size == tokenizer_vocab + 100
        state = padded.submit(GrammarSpec("json_object")).result().new_state()
        allowed_ids = mask_of(state, padded.vocab_size)
        assert allowed_ids and max(allowed_ids) < tokenizer_vocab
        assert state.accept([tokenizer_vocab + 50]) == 0
    finally:
        padded.close()


def test_batch_fill_matches_each_state_and_leaves_states_unchanged(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    compiled = compiler.submit(GrammarSpec("json_schema", json.dumps(PERSON))).result()
    first, second = compiled.new_state(), compiled.new_state()
    second.accept(tokenizer.encode('{"name": "a', add_special_tokens=False).ids)
    drafts = tokenizer.encode('{"name"', add_special_tokens=False).ids
    bad = tokenizer.encode("]]", add_special_tokens=False).ids[:1]
    batch = GrammarBatch(compiler.vocab_size, threads=2)
    bitmask, rows = batch.fill([first, None, second, compiled.new_state()], [drafts, [], [], bad])
    n = 1 + len(drafts)
    assert bitmask.shape == (n + 1 + 1 + 2, bitmask_words(compiler.vocab_size))
    assert rows == [*range(n), n + 1, n + 2, n + 3]
    expect = compiled.new_state()
    for j in range(n):  # row j: the mask after the first j drafts
        assert allowed(bitmask, j, compiler.vocab_size).tolist() == mask_of(expect, compiler.vocab_size)
        expect.accept(drafts[j : j + 1])
    assert len(allowed(bitmask, n, compiler.vocab_size)) == compiler.vocab_size  # unconstrained row
    assert allowed(bitmask, n + 1, compiler.vocab_size).tolist() == mask_of(second, compiler.vocab_size)
    assert allowed(bitmask, n + 2, compiler.vocab_size).tolist() == mask_of(first, compiler.vocab_size)
    assert bad[0] not in allowed(bitmask, n + 2, compiler.vocab_size).tolist()
    assert len(allowed(bitmask, n + 3, compiler.vocab_size)) == compiler.vocab_size  # after a forbidden draft
    assert first.num_tokens == 0
    assert mask_of(first, compiler.vocab_size) == mask_of(compiled.new_state(), compiler.vocab_size)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2], []])
def test_apply_bitmask_sets_forbidden_logits_to_minus_inf(device: str, rows: list[int]) -> None:
    vocab = 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    logits = torch.randn((3, vocab), generator=gen)
    masked = logits.to(device)
    apply_bitmask_(masked, bitmask, rows)
    masked = masked.cpu()
    for row in range(3):
        keep = set(allowed(bitmask, row, vocab).tolist()) if row in rows else set(range(vocab))
        for token in range(vocab):
            expected = logits[row, token].item() if token in keep else float("-inf")
            assert masked[row, token].item() == expected


class _FinishingHandle:
    """A compile that finishes between the queue's first look and any later one, after `now`."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.looks = 0

    def ready(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def result(self) -> Any:
        raise GrammarError("json_schema: a compile error, reported as such")


def test_a_compile_finishing_while_the_queue_looks_is_not_a_timeout() -> None:
    """take() reads a handle's state once: a compile that was running when it looked and done a moment later
    is reported for what it is at the next take, never as past grammar_compile_timeout_s."""
    queue = GrammarQueue(compiler=None, timeout_s=300.0)
    req = object()
    handle = _FinishingHandle(started=1000.5)
    queue.compiling[req] = handle  # type: ignore[index]
    assert queue.take(now=1000.0) == ([], [])
    ready, failed = queue.take(now=1000.1)
    assert ready == []
    assert failed == [(req, INVALID_ARGUMENT, "json_schema: a compile error, reported as such")]
    running = _FinishingHandle(started=1000.0)
    running.ready = lambda: False  # type: ignore[method-assign]
    queue.compiling[req] = running  # type: ignore[index]
    assert queue.take(now=1299.0) == ([], [])
    assert "grammar_compile_timeout_s (300s) (running 300.0s)" in queue.take(now=1300.0)[1][0][2]
