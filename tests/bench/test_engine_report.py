"""Figures, greedy comparison, ratios and JSON of the engine benchmark, from hand-made results (no
model)."""

from __future__ import annotations

import pytest

from sluice.bench.engine_methods import NOT_ON_CPU, MethodResult, Workload
from sluice.bench.report import (
    REFERENCE,
    Block,
    build_rows,
    engine_json_runs,
    format_methods,
    greedy_match,
    headline_ratios,
)

REF = [[5, 6, 7], [8, 9]]


def _result(name: str, speed: float, outputs: list[list[int]] = REF, **kw: float) -> MethodResult:
    tokens = sum(len(o) for o in outputs)
    return MethodResult(name, wall_s=tokens / speed, output_tokens=tokens, outputs=outputs, **kw)


def _all(speed: float, outputs: list[list[int]] = REF) -> dict[str, MethodResult]:
    results = [
        _result(REFERENCE, 100.0),
        _result("hf-static", 300.0),
        _result("sluice-static", 500.0, forward_share=0.8, kv_efficiency=0.9),
        _result("sluice-dynamic", 600.0, forward_share=0.8, kv_efficiency=0.9),
        _result("sluice-continuous", speed, outputs, forward_share_max_batch=0.93, kv_efficiency=0.97),
    ]
    return {r.name: r for r in results}


def _block(results: dict[str, MethodResult], errors: dict[str, str] | None = None) -> Block:
    work = Workload(prompts=((5,), (6,)), max_new_tokens=(3, 2))
    return Block("tiny", 2, work, {"num_requests": 2}, results, errors or {})


def test_a_request_is_compared_up_to_its_first_difference() -> None:
    assert (greedy_match(REF, REF).differing, greedy_match(REF, REF).tokens_compared) == (0, 5)
    assert greedy_match([[5, 6, 0], [8, 9]], REF).tokens_compared == 5
    assert greedy_match([[5, 0, 7], [8, 9]], REF).tokens_compared == 4
    missing, extra = greedy_match([[5, 6], [8, 9]], REF), greedy_match([[5, 6, 7, 1], [8, 9]], REF)
    assert (missing.differing, missing.tokens_compared) == (1, 5)  # a missing token
    assert (extra.differing, extra.tokens_compared) == (1, 6)  # an extra one
    assert not missing.equal and greedy_match(REF, REF).equal


def test_headline_ratios_are_over_each_transformers_method() -> None:
    ratios = headline_ratios(_all(1000.0), "tiny, 2 requests")
    assert [r.value for r in ratios] == pytest.approx([1000 / 300, 10.0])
    assert ratios[0].name == "[tiny, 2 requests] sluice-continuous tokens/s ÷ hf-static"
    assert ratios[0].line() == "  [tiny, 2 requests] sluice-continuous tokens/s ÷ hf-static: 3.33"


def test_an_equal_method_is_reported_as_equal_in_the_table_and_the_json() -> None:
    block = _block(_all(1000.0))
    assert "yes" in format_methods(block.rows, {}, 2)
    head = engine_json_runs([block], {})["methods"]["sluice-continuous"]
    assert head["greedy_equals_hf-sequential"] is True
    assert (head["mismatching_requests"], head["tokens_compared"]) == (0, 5)


def test_a_slower_headline_and_a_differing_request_are_reported_with_their_values() -> None:
    results = _all(750.0, [[5, 6, 7], [8, 1]])
    rows = build_rows(results)
    assert headline_ratios(results)[0].value == pytest.approx(2.5)
    assert [r.greedy.differing for r in rows if r.result.name == "sluice-continuous"] == [1]
    table = format_methods(rows, {}, 2)
    assert "no (1)" in table and "2.50" in table


def test_without_the_reference_nothing_is_compared() -> None:
    results = _all(1000.0)
    del results[REFERENCE]
    assert headline_ratios(results)[1].value is None
    assert engine_json_runs([_block(results)], {})["methods"]["hf-static"]["mismatching_requests"] is None


def test_a_failed_sluice_method_is_shown_as_failed() -> None:
    results = _all(1000.0)
    del results["sluice-static"]
    errors = {"sluice-static": "RuntimeError: boom"}
    assert "FAILED" in format_methods(build_rows(results), errors, 2)


def test_table_shows_cuda_graphs_and_methods_skipped_on_cpu() -> None:
    results = _all(1000.0)
    results["sluice-continuous"].cuda_graphs = "on"
    results["sluice-dynamic"].cuda_graphs = NOT_ON_CPU
    table = format_methods(build_rows(results), {}, 2, {"sluice-continuous-eager": NOT_ON_CPU})
    column = table.splitlines()[0].index("graphs")
    line = {ln.split()[0]: ln for ln in table.splitlines()[2:]}
    assert line["sluice-continuous"][column:].split()[0] == "on"
    assert line["hf-static"][column:].split()[0] == "-"
    assert "n/a (CPU)" in line["sluice-dynamic"] and "n/a (CPU)" in line["sluice-continuous-eager"]


def test_json_of_several_concurrencies_keeps_the_one_block_layout_at_the_top() -> None:
    work = Workload(prompts=((5,), (6,)), max_new_tokens=(3, 2))
    blocks = [
        Block("tiny", c, work, {"num_requests": c}, _all(speed), {}, {"sluice-continuous-eager": NOT_ON_CPU})
        for c, speed in ((64, 1000.0), (256, 700.0))
    ]
    doc = engine_json_runs(blocks, {"model": "tiny"})
    assert [r["concurrency"] for r in doc["runs"]] == [64, 256]
    assert doc["methods"] == doc["runs"][0]["methods"] and doc["workload"] == {"num_requests": 64}
    assert doc["runs"][1]["methods"]["sluice-continuous"]["ratio_to_hf-static"] == pytest.approx(700 / 300)
    assert doc["runs"][0]["methods"]["sluice-continuous-eager"] == {"skipped": NOT_ON_CPU, "error": None}
    firsts = [r["name"].split("]")[0] for r in doc["ratios"][0:4:2]]
    assert firsts == ["[tiny, 64 requests", "[tiny, 256 requests"]
    assert len(doc["ratios"]) == 4 and "decode_steps" not in doc
