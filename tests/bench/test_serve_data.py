"""Workloads of `sluice bench serve`: seeded, within their bounds, and files read with clear errors; the
fixed constraints and tools, which the engine compiles, and the checks of outputs against them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.engine.core.grammar import GrammarCompiler, GrammarSpec
from sluice.bench.serve_data import (
    CONSTRAINTS,
    TOOLS,
    WORDS,
    BenchRequest,
    ToolCall,
    check_output,
    jsonl_requests,
    shared_prefix_requests,
    synthetic_requests,
    with_structure,
)


def test_synthetic_requests_are_reproducible() -> None:
    first = synthetic_requests(20, seed=7, input_len=32, output_len=16)
    assert synthetic_requests(20, seed=7, input_len=32, output_len=16) == first
    assert synthetic_requests(20, seed=8, input_len=32, output_len=16) != first
    assert len({r.prompt for r in first}) == 20  # no two prompts alike


def test_synthetic_lengths_stay_within_bounds_and_prompts_match_their_estimate() -> None:
    requests = synthetic_requests(500, 0, input_len=20, output_len=10, sigma=1.5)
    assert {r.prompt_len for r in requests} <= set(range(1, 81))  # clipped to [1, 4 × the mean]
    assert {r.output_len for r in requests} <= set(range(1, 41))
    assert min(r.prompt_len for r in requests) == 1 and max(r.prompt_len for r in requests) == 80
    for r in requests:
        words = r.prompt.split(" ")
        assert len(words) == r.prompt_len and set(words) <= set(WORDS)


def test_sigma_zero_gives_fixed_lengths() -> None:
    requests = synthetic_requests(10, 3, input_len=17, output_len=9, sigma=0)
    assert {(r.prompt_len, r.output_len) for r in requests} == {(17, 9)}


def test_log_normal_lengths_have_the_asked_mean() -> None:
    requests = synthetic_requests(4000, 1, input_len=100, output_len=40, sigma=0.5)
    prompt_lens = np.array([r.prompt_len for r in requests])
    output_lens = np.array([r.output_len for r in requests])
    assert prompt_lens.mean() == pytest.approx(100, rel=0.05)
    assert output_lens.mean() == pytest.approx(40, rel=0.05)
    assert prompt_lens.std() > 20  # spread, not fixed


def test_synthetic_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        synthetic_requests(0, 0)
    with pytest.raises(ValueError):
        synthetic_requests(3, 0, sigma=-1)


def test_shared_prefix_requests_share_one_context_per_tenant() -> None:
    requests = shared_prefix_requests(12, 5, num_prefixes=3, prefix_len=40, suffix_len=6, output_len=7)
    assert (
        shared_prefix_requests(12, 5, num_prefixes=3, prefix_len=40, suffix_len=6, output_len=7) == requests
    )
    prefixes = [r.prompt.split("\n")[0] for r in requests]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) == 4 for p in set(prefixes))  # tenants take turns
    assert all(len(p.split(" ")) == 40 for p in prefixes)
    assert len({r.prompt for r in requests}) == 12  # each with its own question
    assert {(r.output_len, r.prompt_len) for r in requests} == {(7, 46)}


def test_jsonl_requests_read_both_length_keys(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "one", "output_len": 3}\n\n{"prompt": "two", "max_tokens": 5, "x": 1}\n')
    requests = jsonl_requests(path)
    assert [(r.prompt, r.output_len, r.prompt_len) for r in requests] == [("one", 3, 0), ("two", 5, 0)]


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        '["a list"]',
        '{"output_len": 3}',
        '{"prompt": "x"}',
        '{"prompt": "x", "output_len": 0}',
        '{"prompt": "x", "max_tokens": true}',
        '{"prompt": 3, "output_len": 2}',
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine", "output_len": 3}\n\n' + bad + "\n")
    with pytest.raises(ValueError, match="line 3"):
        jsonl_requests(path)


def test_empty_jsonl_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no requests"):
        jsonl_requests(path)


def test_structure_is_rotated_over_the_requests() -> None:
    requests = with_structure(synthetic_requests(7, seed=0, output_len=8), "choice", tools=False)
    assert [r.constraint for r in requests] == [CONSTRAINTS["choice"][i % 3] for i in range(7)]
    assert all(r.tools == () for r in requests)
    with_tools = with_structure(requests, None, tools=True)
    assert all(r.constraint is None and r.tools == TOOLS for r in with_tools)
    with pytest.raises(ValueError, match="unknown constraint"):
        with_structure(requests, "xml", tools=False)


@pytest.mark.parametrize(
    ("index", "good", "bad"),
    [
        (0, '{"name": "Rex", "kind": "dog", "age": 3}', '{"name": "Rex", "kind": "cow", "age": 3}'),
        (0, '{"name":"Tom","kind":"cat","age":0}', '{"name": "Rex", "kind": "dog", "age": 3, "x": 1}'),
        (1, '{"item": "tea", "quantity": 2, "express": false}', '{"item": "tea", "quantity": 2'),
        (2, '{"city": "Oslo", "tags": ["snow"]}', '{"city": "a very long city name", "tags": []}'),
    ],
)
def test_json_outputs_must_parse_and_match_the_schema(index: int, good: str, bad: str) -> None:
    schema = CONSTRAINTS["json_schema"][index]
    request = BenchRequest("p", 8, constraint=schema)
    assert check_output(request, good, []) is True
    assert check_output(request, bad, []) is False


def test_regex_and_choice_outputs_must_match_whole() -> None:
    word, date, answer = CONSTRAINTS["regex"]
    assert word.check("Paris 75") and not word.check("Paris 75 ") and not word.check("paris 75")
    assert date.check("2026-12-01") and not date.check("x2026-12-01")
    assert answer.check("maybe, later.") and not answer.check("maybe, later")
    colors = CONSTRAINTS["choice"][1]
    assert colors.check("green") and not colors.check("greenish") and not colors.check("")


def test_tool_calls_must_name_a_declared_tool_with_valid_arguments() -> None:
    request = BenchRequest("p", 8, tools=TOOLS)
    weather = ToolCall("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    assert check_output(request, "", [weather, ToolCall("get_time", '{"timezone": "UTC"}')]) is True
    assert check_output(request, "", []) is False  # no call at all
    assert check_output(request, "", [ToolCall("get_news", "{}")]) is False
    assert check_output(request, "", [ToolCall("get_weather", '{"city": "Oslo"}')]) is False  # unit missing
    assert check_output(request, "", [weather, ToolCall("get_time", '{"timezone": ')]) is False
    assert check_output(BenchRequest("p", 8), "anything", []) is None  # nothing to check


def test_every_constraint_and_tool_compiles_in_the_engine(tiny_model_dir: Path) -> None:
    compiler = GrammarCompiler.from_model_dir(tiny_model_dir, vocab_size=0, eos_ids=frozenset())
    try:
        specs = [GrammarSpec(c.kind, c.text, strict=True) for pool in CONSTRAINTS.values() for c in pool]
        specs += [GrammarSpec("json_schema", json.dumps(t["function"]["parameters"])) for t in TOOLS]
        for spec in specs:
            compiler.submit(spec).result(timeout=60)
    finally:
        compiler.close()
