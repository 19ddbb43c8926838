"""`sluice bench routing`'s arithmetic: alternating rounds and the median of same-round ratios (the runs
themselves start whole stacks: `sluice bench routing --num-requests 8` exercises them)."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.bench.report import format_medians, format_rows
from sluice.bench.routing import median_ratios, parse_args, round_order


def row(policy: str, tok_s: float, ttft: float) -> dict[str, Any]:
    return {"policy": policy, "output_throughput": tok_s, "ttft_p90_ms": ttft, "prefix_hit_rate": 0.5,
            "prompt_token_share": {"engine-1": 0.5, "engine-2": 0.5}, "failed": 0}  # fmt: skip


def test_rounds_alternate_their_order() -> None:
    policies = ["round_robin", "least_load", "prefix_affinity"]
    assert round_order(policies, 0) == policies
    assert round_order(policies, 1) == policies[::-1]
    assert round_order(policies, 2) == policies


def test_medians_are_of_ratios_within_each_round() -> None:
    rounds = [
        [row("round_robin", 100, 1000), row("prefix_affinity", 150, 800)],  # 1.5, 0.8
        [row("round_robin", 200, 1000), row("prefix_affinity", 200, 500)],  # 1.0, 0.5
        [row("round_robin", 50, 2000), row("prefix_affinity", 100, 1800)],  # 2.0, 0.9
        [row("prefix_affinity", 999, 1)],  # no baseline in this round: left out
    ]
    medians = median_ratios(rounds)
    assert medians["round_robin"] == {"tok_s": 1.0, "ttft_p90": 1.0}
    assert medians["prefix_affinity"] == pytest.approx({"tok_s": 1.5, "ttft_p90": 0.8})
    text = format_medians(medians, 3)
    assert "median over 3 rounds" in text and "x tok/s 1.50" in text


def test_table_gives_ratios_to_round_robin() -> None:
    lines = format_rows([row("round_robin", 100, 1000), row("prefix_affinity", 160, 640)]).splitlines()
    assert lines[3].split()[:6] == ["prefix_affinity", "160.0", "640", "0.50", "1.60", "0.64"]


def test_repeat_must_be_positive() -> None:
    assert parse_args(["--repeat", "3"]).repeat == 3
    with pytest.raises(SystemExit):
        parse_args(["--repeat", "0"])
