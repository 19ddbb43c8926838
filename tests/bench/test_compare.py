"""`sluice bench compare`: the capacity figures from given points, and a small real sweep."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from sluice.bench import compare
from sluice.bench.compare import Point, capacity_ratio, highest_rate_under
from sluice.bench.serve_data import synthetic_requests
from sluice.bench.sweep import SystemRun

INF = math.inf


def _summary(completed: int, tokens_per_s: float, ttft_p99: float, output_tokens: int = 40) -> dict[str, Any]:
    stats = {"mean": ttft_p99 / 2, "p50": ttft_p99 / 2, "p90": ttft_p99, "p99": ttft_p99}
    if not completed:
        stats = dict.fromkeys(stats)
    return {
        "completed": completed,
        "failed": 4 - completed,
        "duration_s": 1.0,
        "ttft_ms": stats,
        "tpot_ms": stats,
        "total_output_tokens": output_tokens,
        "output_throughput": tokens_per_s,
        "errors": [] if completed else [{"message": "HTTP 500: boom", "count": 4}],
    }


def _run(
    name: str,
    ttfts: list[tuple[float, float]],
    tokens_per_s: float = 100.0,
    output_tokens: int = 40,
    completed: int = 4,
) -> SystemRun:
    points = [
        Point(name, rate, _summary(completed, tokens_per_s, p99, output_tokens), asked_tokens=40)
        for rate, p99 in ttfts
    ]
    return SystemRun(name, points)


def test_highest_rate_stops_at_the_first_rate_over_the_bound() -> None:
    run = _run("static", [(2, 300), (4, 900), (8, 1500), (16, 800)])
    assert highest_rate_under(run, 1000, 4) == 4  # 16 is under again, but 8 was not
    assert highest_rate_under(run, 200, 4) is None
    assert highest_rate_under(_run("continuous", [(2, 10), (INF, 20)]), 1000, 4) == INF
    assert highest_rate_under(_run("static", [(2, 10)], completed=3), 1000, 4) is None  # a request failed


def test_capacity_ratio_says_when_it_is_a_lower_bound() -> None:
    rates = (2, 4, 8, 16, INF)
    assert capacity_ratio(16, 4, rates) == (4.0, "")
    value, note = capacity_ratio(INF, 4, rates)
    assert value == 4.0 and note.startswith("at least") and "inf" in note
    value, note = capacity_ratio(8, None, rates)
    assert value == 4.0 and "no rate" in note
    assert capacity_ratio(None, 2, rates)[0] is None
    assert capacity_ratio(INF, INF, rates)[0] is None


def test_ratios_from_points() -> None:
    rates = (2.0, 8.0, INF)
    runs = {
        "static": _run("static", [(2, 500), (8, 1500), (INF, 3000)]),
        "continuous": _run("continuous", [(2, 50), (8, 100), (INF, 1200)], tokens_per_s=300.0),
    }
    capacities = {name: highest_rate_under(run, 1000, 4) for name, run in runs.items()}
    assert capacities == {"static": 2.0, "continuous": 8.0}
    assert capacity_ratio(capacities["continuous"], capacities["static"], rates) == (4.0, "")


def test_a_lower_bound_is_reported_as_one() -> None:
    rates = (2.0, 4.0, INF)
    runs = {"static": _run("static", [(2, 5), (4, 5), (INF, 5000)]),
            "continuous": _run("continuous", [(2, 5), (4, 5), (INF, 5)])}  # fmt: skip
    caps = {name: highest_rate_under(run, 1000, 4) for name, run in runs.items()}
    value, note = capacity_ratio(caps["continuous"], caps["static"], rates)
    assert value == 1.0 and note.startswith("at least")
    assert capacity_ratio(None, 2.0, rates)[0] is None


def test_a_policy_that_failed_to_start_is_reported_not_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = compare.build_parser().parse_args(
        ["--rates", "2,inf", "--num-requests", "4", "--json", str(tmp_path / "c.json")]
    )
    runs = {
        "continuous": _run("continuous", [(2, 50), (INF, 90)]),
        "static": SystemRun("static", error="engine exited with code 1 during start-up; boom"),
    }
    assert compare._report(args, runs, {"model": "/m"}) == 1
    printed = capsys.readouterr().out
    assert re.search(r"sluice-static +FAILED", printed) and "engine exited with code 1" in printed
    assert "continuous's highest rate ÷ static's: 1 (at least" in printed and "MET" not in printed
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["systems"]["static"]["error"].startswith("engine exited")
    assert doc["systems"]["continuous"]["points"][1]["rate"] == "inf"
    assert doc["capacity_ratio"]["value"] == 1.0 and "targets" not in doc


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "eager"],
        ["--rates", "0,2"],
        ["--rates", "x"],
        ["--num-requests", "0"],
        ["--ttft-bound-ms", "-1"],
    ],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        compare.main(argv)
    assert exc.value.code == 2


@pytest.mark.e2e
def test_two_policies_at_two_rates(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--policies",
        "static,continuous",
        "--rates",
        "4,inf",
        "--num-requests",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--json",
        str(out),
        "--no-progress",
    ]
    assert compare.main(argv) == 0
    doc = json.loads(out.read_text())
    asked = sum(r.output_len for r in synthetic_requests(4, 0, input_len=8, output_len=8))
    assert list(doc["systems"]) == ["static", "continuous"]
    for system in doc["systems"].values():
        assert system["error"] is None
        assert [p["rate"] for p in system["points"]] == [4.0, "inf"]
        for point in system["points"]:
            assert point["completed"] == 4 and point["failed"] == 0
            assert point["asked_tokens"] == asked
            assert 4 <= point["total_output_tokens"] <= asked  # at least one token each; EOS may end one
            assert point["output_throughput"] > 0 and point["ttft_ms"]["p99"] > 0
            assert point["cpu_s"]["engine"] > 0
    meta = doc["meta"]
    assert meta["command"].startswith("sluice bench compare --model") and meta["date"] and meta["machine"]
    assert "git_commit" in meta and meta["workload"]["asked_output_tokens"] == asked
    assert set(doc["highest_rate_under_ttft_bound"]) == {"static", "continuous"}
