"""`sluice bench latency`'s figures on synthetic numbers: ratios against off and unquantized, the
tables and JSON; the copy fraction and the TTFT percentiles it reports."""

from __future__ import annotations

import math

import pytest

from sluice.bench import report as rep
from sluice.bench.latency import (
    NON_REPETITIVE,
    REPETITIVE,
    RunFigures,
    copy_fraction,
    faster,
)
from sluice.bench.perplexity import QualityResult


def _run(concurrency: int, tok_s: float, spec: dict[str, float] | None = None) -> RunFigures:
    """A run of 100 tokens whose decode and output rates are both `tok_s`."""
    return RunFigures(
        concurrency=concurrency,
        requests=concurrency,
        output_tokens=100,
        wall_s=100 / tok_s,
        decode_tokens=100,
        decode_s=100 / tok_s,
        ttft_s=[0.01 * (i + 1) for i in range(concurrency)],
        outputs=[],
        spec=spec or {},
    )


def _cell(variant: str, workload: str, b1: float, many: float) -> rep.Cell:
    return rep.Cell(variant, workload, _run(1, b1), _run(64, many))


def _report(ngram_b1: float, ngram_rep: float, ngram_non: float) -> rep.LatencyReport:
    cells = [
        _cell("off", REPETITIVE, 100.0, 1000.0),
        _cell("off", NON_REPETITIVE, 100.0, 2000.0),
        _cell("ngram", REPETITIVE, ngram_b1, ngram_rep),
        _cell("ngram", NON_REPETITIVE, 100.0, ngram_non),
    ]
    return rep.LatencyReport("m", 64, cells)


def test_ratios_are_taken_against_off_on_the_same_workload() -> None:
    report = _report(ngram_b1=160.0, ngram_rep=960.0, ngram_non=1800.0)
    cells = {(c.variant, c.workload): c for c in report.cells}
    assert rep.ratio_to_off(report, cells["ngram", REPETITIVE], "batch1") == pytest.approx(1.6)
    assert rep.ratio_to_off(report, cells["ngram", REPETITIVE], "concurrent") == pytest.approx(0.96)
    assert rep.ratio_to_off(report, cells["ngram", NON_REPETITIVE], "concurrent") == pytest.approx(0.9)
    assert rep.ratio_to_off(report, rep.Cell("int8", REPETITIVE), "batch1") is None  # not run


def test_quality_ratios() -> None:
    report = _report(100.0, 1000.0, 2000.0)
    report.quality = [
        QualityResult("none", "none", "auto", 100.0, 1000),
        QualityResult("int8", "int8", "auto", 102.5, 1000),
    ]
    assert rep.quality_ratio(report.quality, "int8") == pytest.approx(1.025)
    assert "1.0250" in rep.format_quality(report)
    doc = rep.latency_json(report, {})
    assert doc["quality"][1]["ratio_to_none"] == pytest.approx(1.025) and "targets" not in doc


def test_tables_and_json_carry_the_figures() -> None:
    report = _report(ngram_b1=250.0, ngram_rep=1000.0, ngram_non=2000.0)
    report.cells[2].batch1 = _run(1, 250.0, {"spec_acceptance_rate": 0.8, "spec_mean_accepted_length": 3.5})
    report.errors["fp8"] = "skipped: CUDA only"
    table = rep.format_latency(report)
    assert "2.50x" in table and "80% / 3.50" in table and "fp8: no figures (skipped: CUDA only)" in table
    doc = rep.latency_json(report, {"command": "x"})
    assert doc["bench"] == "latency" and doc["command"] == "x"
    ngram = next(c for c in doc["cells"] if c["variant"] == "ngram" and c["workload"] == REPETITIVE)
    assert ngram["batch1_ratio_to_off"] == pytest.approx(2.5)
    assert ngram["batch1"]["spec"]["spec_acceptance_rate"] == 0.8
    assert ngram["concurrent"]["ttft_p99_s"] == pytest.approx(0.63 + 0.37 * 0.01)  # rank 0.99 × 63 = 62.37
    assert [c["concurrent_ratio_to_off"] for c in doc["cells"]][2:] == pytest.approx([1.0, 1.0])


def test_copy_fraction() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    assert copy_fraction(prompt, [3, 4, 5, 6]) == 1.0
    assert copy_fraction(prompt, [9, 9, 9, 9]) == 0.0
    assert copy_fraction(prompt, [2, 3, 4, 5, 7, 8, 9, 10]) == 0.5
    assert copy_fraction(prompt, [2, 3, 4]) == 0.0  # shorter than an n-gram
    assert copy_fraction(prompt, [7, 8, 7, 8, 7, 8, 7, 8]) == 0.0  # repeating itself is not copying


def test_ttft_percentiles_interpolate_between_ranks() -> None:
    def ttfts(values: list[float]) -> RunFigures:
        return RunFigures(1, 1, 0, 1.0, 0, 1.0, values, [])

    assert ttfts([3.0, 1.0, 2.0]).ttft(0.5) == 2.0
    assert ttfts([1.0, 2.0]).ttft(0.99) == pytest.approx(1.99)
    assert math.isnan(ttfts([]).ttft(0.5))


def test_repeats_keep_the_fastest_run_and_list_every_figure() -> None:
    kept = None
    for tok_s in (50.0, 80.0, 60.0):
        kept = faster(kept, _run(1, tok_s), "decode_tok_s")
    assert kept is not None and kept.decode_tok_s == pytest.approx(80.0)
    assert kept.repeats == pytest.approx([50.0, 80.0, 60.0])
