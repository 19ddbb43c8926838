"""`sluice bench pipeline` on a small workload: both runs produce every token, and the report says
where the time and CPU went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench import pipeline
from sluice.bench.pipeline import Comparison, EndToEndRun, InProcessRun
from sluice.bench.report import format_pipeline
from sluice.bench.serve_data import uniform_requests


def test_uniform_requests_are_seeded_and_within_bounds() -> None:
    a = uniform_requests(50, 3, prompt_words=(5, 9), output_len=(2, 4))
    assert a == uniform_requests(50, 3, prompt_words=(5, 9), output_len=(2, 4))
    assert a != uniform_requests(50, 4, prompt_words=(5, 9), output_len=(2, 4))
    assert all(5 <= len(r.prompt.split()) == r.prompt_len <= 9 for r in a)
    assert {r.output_len for r in a} == {2, 3, 4}
    with pytest.raises(ValueError):
        uniform_requests(1, 0, prompt_words=(3, 2))


def _e2e(tokens_per_s: float, wall_s: float, generator_cpu_s: float) -> EndToEndRun:
    summary = {
        "output_throughput": tokens_per_s,
        "total_output_tokens": int(tokens_per_s * wall_s),
        "failed": 0,
    }
    return EndToEndRun(summary, wall_s, {"engine": 1.0, "load generator": generator_cpu_s})


def test_scaled_ratio_credits_the_generators_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: 2)
    inp = InProcessRun(output_tokens=1000, wall_s=1.0, cpu_s=2.0, steps=10, step_s=0.9, forward_s=0.8)
    cmp = Comparison(inp, _e2e(800.0, wall_s=2.0, generator_cpu_s=0.8))  # the generator took 20%
    assert cmp.raw_ratio == pytest.approx(0.8)
    assert cmp.end_to_end.generator_share == pytest.approx(0.2)
    assert cmp.scaled_ratio == pytest.approx(1.0)
    assert cmp.to_json()["scaled_ratio"] == pytest.approx(1.0)
    slow = Comparison(inp, _e2e(500.0, wall_s=2.0, generator_cpu_s=0.0))
    assert slow.scaled_ratio == pytest.approx(0.5)
    assert "target_met" not in slow.to_json()
    assert any(line.startswith("ratio, scaled     : 0.500") for line in format_pipeline(slow).splitlines())


@pytest.mark.e2e
def test_pipeline_bench_runs_both_ways(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `sluice up`'s default threads are decided once, and both runs get them.
    decided: list[int] = []
    monkeypatch.setattr(pipeline, "default_engine_threads", lambda: decided.append(1) or 1)
    stacks: list[tuple[str, ...]] = []
    opened = pipeline.sw.stack_endpoint

    def stack_endpoint(*args: object, up_flags: tuple[str, ...] = (), **kw: object) -> object:
        stacks.append(up_flags)
        return opened(*args, up_flags=up_flags, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline.sw, "stack_endpoint", stack_endpoint)
    in_process_threads: list[int] = []
    run_in_process = pipeline.run_in_process

    def spy(*args: object) -> pipeline.InProcessRun:
        in_process_threads.append(args[-1])  # type: ignore[arg-type]
        return run_in_process(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "run_in_process", spy)
    out = tmp_path / "pipeline.json"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--num-requests",
        "5",
        "--prompt-words",
        "4,20",
        "--output-len",
        "3,9",
        "--json",
        str(out),
        "--no-progress",
    ]
    assert pipeline.main(argv) == 0
    report = json.loads(out.read_text())
    workload = uniform_requests(5, 0, prompt_words=(4, 20), output_len=(3, 9))
    expected = sum(r.output_len for r in workload)
    best = report["best"]
    assert best["in_process"]["output_tokens"] == expected
    e2e = best["end_to_end"]
    assert e2e["summary"]["completed"] == 5 and e2e["summary"]["failed"] == 0
    assert e2e["summary"]["total_output_tokens"] == expected
    assert set(e2e["cpu_s"]) == {"tokenizer", "engine", "detokenizer", "gateway", "load generator"}
    assert e2e["cpu_s"]["engine"] > 0
    counts = {name: count for name, (count, _) in e2e["stages"].items()}
    assert counts["gateway: tokenize"] == 5  # the warm-up came before the measured window
    assert counts["engine step"] >= max(r.output_len for r in workload)
    assert best["raw_ratio"] > 0 and best["scaled_ratio"] >= best["raw_ratio"]
    assert report["meta"]["command"].startswith("sluice bench pipeline --model")
    printed = capsys.readouterr().out
    assert "ratio, scaled" in printed and "engine step" in printed
    assert decided == [1] and in_process_threads == [1] and stacks == [("--engine-threads", "1")]
