"""Figures and targets of the engine benchmark, from hand-made results (no model)."""

from __future__ import annotations

import pytest

from sluice.bench.engine_methods import MethodResult
from sluice.bench.engine_report import build_rows, evaluate_targets, format_table, mismatching_requests

REF = [[5, 6, 7], [8, 9]]


def _result(name: str, speed: float, outputs: list[list[int]] = REF, **kw: float) -> MethodResult:
    tokens = sum(len(o) for o in outputs)
    return MethodResult(name, wall_s=tokens / speed, output_tokens=tokens, outputs=outputs, **kw)


def _all(speed: float, outputs: list[list[int]] = REF) -> dict[str, MethodResult]:
    results = [
        _result("hf-sequential", 100.0),
        _result("hf-static", 300.0),
        _result("hf-continuous", 400.0),
        _result("sluice-static", 500.0, forward_share=0.8, kv_efficiency=0.9),
        _result("sluice-dynamic", 600.0, forward_share=0.8, kv_efficiency=0.9),
        _result("sluice-continuous", speed, outputs, forward_share_max_batch=0.93, kv_efficiency=0.97),
    ]
    return {r.name: r for r in results}


def test_mismatches_count_requests_not_tokens() -> None:
    assert mismatching_requests(REF, REF) == 0
    assert mismatching_requests([[5, 6, 0], [8, 9]], REF) == 1
    assert mismatching_requests([[5, 6], [9, 8]], REF) == 2  # a short output is a mismatch too


def test_targets_met_when_every_figure_clears_its_bar() -> None:
    results = _all(1000.0)
    targets = evaluate_targets(results, build_rows(results), {})
    assert [t.value for t in targets[:3]] == pytest.approx([2.5, 1000 / 300, 10.0])
    assert [t.met for t in targets] == [True, True, True, True, True, True]


def test_targets_not_met_are_reported_with_their_values() -> None:
    results = _all(700.0, [[5, 6, 7], [8, 1]])
    rows = build_rows(results)
    targets = evaluate_targets(results, rows, {})
    assert [t.met for t in targets] == [False, True, True, True, True, False]
    assert targets[0].value == pytest.approx(1.75)
    assert targets[5].value == 1
    table = format_table(rows, {}, 2)
    assert "no (1)" in table and "1.75" in table


def test_a_failed_sluice_method_leaves_equality_unmeasured() -> None:
    results = _all(1000.0)
    del results["sluice-static"]
    errors = {"sluice-static": "RuntimeError: boom"}
    targets = evaluate_targets(results, build_rows(results), errors)
    assert targets[5].met is None
    assert "FAILED" in format_table(build_rows(results), errors, 2)
