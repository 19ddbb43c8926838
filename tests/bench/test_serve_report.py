"""Figures of `sluice bench serve` from hand-made records: summary math, SLO goodput, table, JSON."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sluice.bench.report import format_summary, write_result
from sluice.bench.serve import RequestRecord, ServeConfig, ServeResult


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(True, "", 10, 5, start=0.0, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1]),
        RequestRecord(True, "", 20, 3, start=0.5, ttft_s=0.2, e2e_s=0.6, itl_s=[0.2, 0.2]),
        RequestRecord(True, "", 30, 1, start=1.0, ttft_s=0.3, e2e_s=0.3, itl_s=[]),
        RequestRecord(False, "boom", start=1.0, e2e_s=0.1),
        RequestRecord(False, "boom", start=1.2, e2e_s=0.1),
        RequestRecord(False, "other"),
    ]


def _result(**config: object) -> ServeResult:
    return ServeResult(ServeConfig("openai", "http://x/v1", **config), _records(), 2.0, 1e9)  # type: ignore[arg-type]


def test_summary_counts_tokens_and_rates_over_successful_requests() -> None:
    s = _result().summary()
    assert (s["completed"], s["failed"]) == (3, 3)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 9)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["mean_concurrency"] == pytest.approx((0.5 + 0.6 + 0.3) / 2.0)
    assert s["errors"] == [{"message": "boom", "count": 2}, {"message": "other", "count": 1}]
    assert s["goodput"] is None


def test_latency_percentiles_in_milliseconds() -> None:
    s = _result().summary()
    approx = pytest.approx
    assert s["ttft_ms"] == approx({"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0})
    # TPOT = (e2e - ttft) / (tokens - 1): 100 ms and 200 ms; the one-token request has none.
    assert s["tpot_ms"] == approx({"mean": 150.0, "p50": 150.0, "p90": 190.0, "p99": 199.0})
    assert s["itl_ms"] == approx({"mean": 800.0 / 6, "p50": 100.0, "p90": 200.0, "p99": 200.0})
    assert s["e2el_ms"] == approx({"mean": 1400.0 / 3, "p50": 500.0, "p90": 580.0, "p99": 598.0})


def test_goodput_counts_requests_within_every_slo() -> None:
    # ttft ≤ 250 and tpot ≤ 150 ms: only the first request (the third misses TTFT, the second TPOT).
    assert _result(slo_ttft_ms=250.0, slo_tpot_ms=150.0).summary()["goodput"] == pytest.approx(0.5)
    # TPOT alone: the first and the one-token request (which has no TPOT).
    assert _result(slo_tpot_ms=150.0).summary()["goodput"] == pytest.approx(1.0)
    assert _result(slo_ttft_ms=1000.0).summary()["goodput"] == pytest.approx(1.5)


def test_no_successful_request_gives_empty_latencies() -> None:
    result = ServeResult(ServeConfig("openai-chat", "http://x/v1"), [RequestRecord(error="down")], 0.0, 0.0)
    s = result.summary()
    assert s["completed"] == 0 and s["failed"] == 1
    assert s["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert math.isnan(s["request_throughput"])
    assert "down" in format_summary(result)


def test_table_shows_the_figures() -> None:
    table = format_summary(_result(slo_ttft_ms=250.0))
    assert "Successful requests:" in table and "Failed requests:" in table
    assert re.search(r"^P99 TTFT \(ms\): +298\.00$", table, re.M)
    assert re.search(r"^Output token throughput \(tok/s\): +4\.50$", table, re.M)
    assert "goodput" in table and "ttft <= 250 ms" in table
    assert "2 × boom" in table


def test_json_carries_meta_config_summary_and_records(tmp_path: Path) -> None:
    path = tmp_path / "out" / "serve.json"
    write_result(path, _result(), {"command": "sluice bench serve"})
    doc = json.loads(path.read_text())
    assert doc["meta"] == {"command": "sluice bench serve"}
    assert doc["config"]["request_rate"] == "inf"  # JSON has no infinity
    assert doc["summary"]["completed"] == 3
    assert len(doc["records"]) == 6
    assert doc["records"][0]["itl_s"] == [0.1, 0.1, 0.1, 0.1]
