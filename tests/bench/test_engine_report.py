"""Figures, greedy check and targets of the engine benchmark, from hand-made results and logits (no model)."""

from __future__ import annotations

import pytest
import torch

from sluice.bench.engine_methods import MethodResult
from sluice.bench.engine_report import (
    REFERENCE,
    GreedyCheck,
    build_rows,
    check_greedy,
    compare_request,
    evaluate_targets,
    format_greedy_check,
    format_table,
    to_json,
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


def test_targets_met_when_every_figure_clears_its_bar() -> None:
    results = _all(1000.0)
    targets = evaluate_targets(results, build_rows(results, _check(results)), {})
    assert [t.value for t in targets[:3]] == pytest.approx([2.5, 1000 / 300, 10.0])
    assert [t.met for t in targets] == [True, True, True, True, True, True]


def test_a_near_tie_is_reported_and_does_not_fail_the_equality_target() -> None:
    results = _all(1000.0, [[5, TIED, 0], [8, 9]])
    check = _check(results)
    rows = build_rows(results, check)
    targets = evaluate_targets(results, rows, {})
    assert targets[5].value == 0 and targets[5].met is True
    assert "yes (1 near-tie)" in format_table(rows, {}, 2)
    doc = to_json(rows, {}, targets, {}, check)
    head = doc["methods"]["sluice-continuous"]
    assert head["greedy_equals_hf-sequential"] is True
    assert (head["mismatching_requests"], head["near_tie_requests"], head["tokens_compared"]) == (0, 1, 4)
    assert doc["greedy_check"]["near_tie_threshold"] == THRESHOLD


def test_targets_not_met_are_reported_with_their_values() -> None:
    results = _all(700.0, [[5, 6, 7], [8, 1]])
    rows = build_rows(results, _check(results))
    targets = evaluate_targets(results, rows, {})
    assert [t.met for t in targets] == [False, True, True, True, True, False]
    assert targets[0].value == pytest.approx(1.75)
    assert targets[5].value == 1
    table = format_table(rows, {}, 2)
    assert "no (1)" in table and "1.75" in table


def test_without_the_reference_nothing_is_compared() -> None:
    results = _all(1000.0)
    del results[REFERENCE]
    rows = build_rows(results, None)
    targets = evaluate_targets(results, rows, {})
    assert targets[5].met is None and targets[5].value is None
    assert to_json(rows, {}, targets, {}, None)["methods"]["hf-static"]["mismatching_requests"] is None


def test_a_failed_sluice_method_leaves_equality_unmeasured() -> None:
    results = _all(1000.0)
    del results["sluice-static"]
    errors = {"sluice-static": "RuntimeError: boom"}
    rows = build_rows(results, _check(results))
    targets = evaluate_targets(results, rows, errors)
    assert targets[5].met is None
    assert "FAILED" in format_table(rows, errors, 2)
