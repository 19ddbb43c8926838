"""Workloads of `sluice bench serve`: seeded, within their bounds, and files read with clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.bench.serve_data import (
    WORDS,
    jsonl_requests,
    shared_prefix_requests,
    synthetic_requests,
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
