"""`sluice bench latency`'s figures on synthetic numbers: ratios against off, the targets' verdicts, the
tables and JSON; the copy / lookup fractions and the percentile it reports."""

from __future__ import annotations

import math

import pytest

from sluice.bench import latency_report as rep
from sluice.bench.latency import faster
from sluice.bench.latency_run import RunFigures, percentile
from sluice.bench.latency_workload import NON_REPETITIVE, REPETITIVE, copy_fraction, lookup_fraction
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


def _report(ngram_b1: float, ngram_rep: float, ngram_non: float) -> rep.Report:
    cells = [
        _cell("off", REPETITIVE, 100.0, 1000.0),
        _cell("off", NON_REPETITIVE, 100.0, 2000.0),
        _cell("ngram", REPETITIVE, ngram_b1, ngram_rep),
        _cell("ngram", NON_REPETITIVE, 100.0, ngram_non),
    ]
    return rep.Report("m", 64, cells)


def test_ratios_are_taken_against_off_on_the_same_workload() -> None:
    report = _report(ngram_b1=160.0, ngram_rep=960.0, ngram_non=1800.0)
    assert rep.batch1_ratio(report, "ngram", REPETITIVE) == pytest.approx(1.6)
    assert rep.concurrent_ratio(report, "ngram", REPETITIVE) == pytest.approx(0.96)
    assert rep.concurrent_ratio(report, "ngram", NON_REPETITIVE) == pytest.approx(0.9)
    assert rep.batch1_ratio(report, "int8", REPETITIVE) is None  # not run


def test_targets_met_not_met_and_not_measured() -> None:
    met = {t.name: t.met for t in rep.targets(_report(ngram_b1=160.0, ngram_rep=960.0, ngram_non=1800.0))}
    assert met["ngram batch-1 decode tok/s on repetitive / off"] is True  # 1.6 >= 1.5
    assert met["ngram at 64 concurrent tok/s on repetitive / off"] is True  # 0.96 >= 0.95
    assert met["ngram at 64 concurrent tok/s on non-repetitive / off"] is False  # 0.90 < 0.95
    not_run = [name for name, m in met.items() if m is None]
    assert len(not_run) == 4 and all(("int8" in n or "fp8" in n) for n in not_run)
    below = {t.name: t.met for t in rep.targets(_report(ngram_b1=149.0, ngram_rep=940.0, ngram_non=1900.0))}
    assert below["ngram batch-1 decode tok/s on repetitive / off"] is False
    assert below["ngram at 64 concurrent tok/s on repetitive / off"] is False
    assert below["ngram at 64 concurrent tok/s on non-repetitive / off"] is True  # exactly 0.95


def test_shape_quality_and_kv_targets() -> None:
    report = _report(100.0, 1000.0, 2000.0)
    report.shape = rep.ShapeRun("qwen2-0.5b", "float32", {"off": _run(1, 4.0), "int8": _run(1, 6.4)})
    report.quality = [
        QualityResult("none", "none", "auto", 100.0, 1000),
        QualityResult("int8", "int8", "auto", 102.5, 1000),
    ]
    report.kv = rep.KvBlocks(1.0, {"auto": 1000, "fp8": 2000})
    met = {t.name.split(" (")[0]: (t.value, t.met) for t in rep.targets(report)}
    assert met["int8 batch-1 decode tok/s on qwen2-0.5b / off"] == (pytest.approx(1.6), True)
    assert met["int8 perplexity / unquantized"] == (pytest.approx(1.025), False)  # more than 2% worse
    assert met["fp8 batch-1 decode tok/s on qwen2-0.5b / off"] == (None, None)
    assert met["fp8 KV blocks / model-dtype KV blocks at one budget"] == (2.0, True)
    report.quality[1] = QualityResult("int8", "int8", "auto", 101.9, 1000)
    assert {t.name.split(" (")[0]: t.met for t in rep.targets(report)}[
        "int8 perplexity / unquantized"
    ] is True


def test_tables_and_json_carry_the_figures() -> None:
    report = _report(ngram_b1=250.0, ngram_rep=1000.0, ngram_non=2000.0)
    report.cells[2].batch1 = _run(1, 250.0, {"spec_acceptance_rate": 0.8, "spec_mean_accepted_length": 3.5})
    report.errors["fp8"] = "skipped: CUDA only"
    table = rep.format_main(report)
    assert "2.50x" in table and "80% / 3.50" in table and "fp8: no figures (skipped: CUDA only)" in table
    doc = rep.to_json(report, {"command": "x"})
    assert doc["bench"] == "latency" and doc["command"] == "x"
    ngram = next(c for c in doc["cells"] if c["variant"] == "ngram" and c["workload"] == REPETITIVE)
    assert ngram["batch1_ratio_to_off"] == pytest.approx(2.5)
    assert ngram["batch1"]["spec"]["spec_acceptance_rate"] == 0.8
    assert ngram["concurrent"]["ttft_p99_s"] == pytest.approx(
        percentile([0.01 * (i + 1) for i in range(64)], 0.99)
    )
    assert [t["met"] for t in doc["targets"]][:3] == [True, True, True]


def test_copy_and_lookup_fractions() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    assert copy_fraction(prompt, [3, 4, 5, 6]) == 1.0
    assert copy_fraction(prompt, [9, 9, 9, 9]) == 0.0
    assert copy_fraction(prompt, [2, 3, 4, 5, 7, 8, 9, 10]) == 0.5
    assert copy_fraction(prompt, [2, 3, 4]) == 0.0  # shorter than an n-gram
    # An output that repeats itself is found by lookup (prompt + earlier output), not by copy.
    loop = [7, 8, 7, 8, 7, 8, 7, 8]
    assert copy_fraction(prompt, loop) == 0.0
    assert lookup_fraction(prompt, loop) == pytest.approx(6 / 8)  # spans from the third token on
    assert lookup_fraction(prompt, [3, 4, 5, 6]) == 1.0


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert math.isnan(percentile([], 0.5))


def test_repeats_keep_the_fastest_run_and_list_every_figure() -> None:
    kept = None
    for tok_s in (50.0, 80.0, 60.0):
        kept = faster(kept, _run(1, tok_s), "decode_tok_s")
    assert kept is not None and kept.decode_tok_s == pytest.approx(80.0)
    assert kept.repeats == pytest.approx([50.0, 80.0, 60.0])
