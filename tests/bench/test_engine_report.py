"""Figures, greedy check, ratios and JSON of the engine benchmark, from hand-made results and
logits (no model)."""

from __future__ import annotations

import pytest
import torch

from sluice.bench.engine_methods import (
    NOT_ON_CPU,
    GreedyCheck,
    MethodResult,
    Workload,
    check_greedy,
    compare_request,
)
from sluice.bench.report import (
    REFERENCE,
    Block,
    build_rows,
    engine_json,
    engine_json_runs,
    format_greedy_check,
    format_methods,
    headline_ratios,
)

REF = [[5, 6, 7], [8, 9]]
THRESHOLD = 1e-4
TIED = 3  # at request 0, position 1 the reference scores token TIED a hair below its own choice
LOW = 4  # a token the reference clearly ranks lower, at every position


def _logits() -> list[torch.Tensor]:
    """Reference logits: its own token 1.0, TIED 1.0 - 1e-6 at request 0 position 1, LOW -1.0, others 0."""
    out = []
    for tokens in REF:
        logits = torch.zeros(len(tokens), 10)
        logits[torch.arange(len(tokens)), tokens] = 1.0
        logits[:, LOW] = -1.0
        out.append(logits)
    out[0][1, TIED] = 1.0 - 1e-6
    return out


def _result(name: str, speed: float, outputs: list[list[int]] = REF, **kw: float) -> MethodResult:
    tokens = sum(len(o) for o in outputs)
    return MethodResult(name, wall_s=tokens / speed, output_tokens=tokens, outputs=outputs, **kw)


def _all(speed: float, outputs: list[list[int]] = REF) -> dict[str, MethodResult]:
    results = [
        _result(REFERENCE, 100.0),
        _result("hf-static", 300.0),
        _result("hf-continuous", 400.0),
        _result("sluice-static", 500.0, forward_share=0.8, kv_efficiency=0.9),
        _result("sluice-dynamic", 600.0, forward_share=0.8, kv_efficiency=0.9),
        _result("sluice-continuous", speed, outputs, forward_share_max_batch=0.93, kv_efficiency=0.97),
    ]
    return {r.name: r for r in results}


def _check(results: dict[str, MethodResult]) -> GreedyCheck:
    return check_greedy(results, _logits(), THRESHOLD)


def test_a_request_is_equal_a_near_tie_or_differing() -> None:
    logits = _logits()[0]
    assert compare_request([5, 6, 7], REF[0], logits, THRESHOLD) == ("equal", 3)
    assert compare_request([5, TIED, 0], REF[0], logits, THRESHOLD) == ("near-tie", 2)
    assert compare_request([5, 6, 0], REF[0], logits, THRESHOLD) == ("differs", 3)
    assert compare_request([5, 6], REF[0], logits, THRESHOLD) == ("differs", 3)  # a missing token
    assert compare_request([5, 6, 7, 1], REF[0], logits, THRESHOLD) == ("differs", 4)  # an extra one


def test_a_clearly_lower_token_differs_even_where_the_top_two_are_close() -> None:
    # Position 1 of request 0 is a near-tie between 6 and TIED; LOW there is a real difference.
    assert compare_request([5, LOW, 7], REF[0], _logits()[0], THRESHOLD) == ("differs", 2)


def test_the_check_counts_requests_and_the_tokens_it_compared() -> None:
    results = _all(1000.0, [[5, TIED, 2], [8, 0]])
    check = _check(results)
    assert check.min_margin == pytest.approx(1e-6, rel=0.05)  # 1 - 1e-6 rounded to float32
    ref, head = check.methods[REFERENCE], check.methods["sluice-continuous"]
    assert (check.reference_tokens, check.close_calls) == (5, 1)
    assert (ref.differing, ref.near_ties, ref.tokens_compared) == (0, 0, 5)
    assert (head.differing, head.near_ties, head.tokens_compared) == (1, 1, 4)
    assert not head.equal
    line = format_greedy_check(check, build_rows(results, check))
    assert f"({THRESHOLD:.2g})" in line and "at 1 of 5 positions" in line
    assert f"smallest {check.min_margin:.3g}" in line and "sluice-continuous 4/5" in line


def test_headline_ratios_are_over_each_transformers_method() -> None:
    ratios = headline_ratios(_all(1000.0), "tiny, 2 requests")
    assert [r.value for r in ratios] == pytest.approx([2.5, 1000 / 300, 10.0])
    assert ratios[0].name == "[tiny, 2 requests] sluice-continuous tokens/s ÷ hf-continuous"
    assert ratios[0].line() == "  [tiny, 2 requests] sluice-continuous tokens/s ÷ hf-continuous: 2.5"


def test_a_near_tie_is_reported_and_is_not_a_difference() -> None:
    results = _all(1000.0, [[5, TIED, 0], [8, 9]])
    check = _check(results)
    rows = build_rows(results, check)
    assert sum(g.differing for g in check.methods.values()) == 0
    assert "yes (1 near-tie)" in format_methods(rows, {}, 2)
    doc = engine_json(rows, {}, {}, check)
    head = doc["methods"]["sluice-continuous"]
    assert head["greedy_equals_hf-sequential"] is True
    assert (head["mismatching_requests"], head["near_tie_requests"], head["tokens_compared"]) == (0, 1, 4)
    assert doc["greedy_check"]["near_tie_threshold"] == THRESHOLD


def test_a_slower_headline_and_a_differing_request_are_reported_with_their_values() -> None:
    results = _all(700.0, [[5, 6, 7], [8, 1]])
    check = _check(results)
    rows = build_rows(results, check)
    assert headline_ratios(results)[0].value == pytest.approx(1.75)
    assert check.methods["sluice-continuous"].differing == 1
    table = format_methods(rows, {}, 2)
    assert "no (1)" in table and "1.75" in table


def test_without_the_reference_nothing_is_compared() -> None:
    results = _all(1000.0)
    del results[REFERENCE]
    rows = build_rows(results, None)
    assert headline_ratios(results)[2].value is None
    assert engine_json(rows, {}, {}, None)["methods"]["hf-static"]["mismatching_requests"] is None


def test_a_failed_sluice_method_is_shown_as_failed() -> None:
    results = _all(1000.0)
    del results["sluice-static"]
    errors = {"sluice-static": "RuntimeError: boom"}
    rows = build_rows(results, _check(results))
    assert "FAILED" in format_methods(rows, errors, 2)


def test_table_shows_cuda_graphs_and_methods_skipped_on_cpu() -> None:
    results = _all(1000.0)
    results["sluice-continuous"].cuda_graphs = "on"
    results["sluice-dynamic"].cuda_graphs = NOT_ON_CPU
    rows = build_rows(results, None)
    table = format_methods(rows, {}, 2, {"sluice-continuous-eager": NOT_ON_CPU})
    column = table.splitlines()[0].index("graphs")
    line = {ln.split()[0]: ln for ln in table.splitlines()[2:]}
    assert line["sluice-continuous"][column:].split()[0] == "on"
    assert line["hf-continuous"][column:].split()[0] == "-"
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
    assert doc["runs"][1]["methods"]["sluice-continuous"]["ratio_to_hf-continuous"] == pytest.approx(1.75)
    assert doc["runs"][0]["methods"]["sluice-continuous-eager"] == {"skipped": NOT_ON_CPU, "error": None}
    firsts = [r["name"].split("]")[0] for r in doc["ratios"][0:6:3]]
    assert firsts == ["[tiny, 64 requests", "[tiny, 256 requests"]
    assert len(doc["ratios"]) == 6 and "decode_steps" not in doc
