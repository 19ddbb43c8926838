"""scripts/gpu_check.sh without a GPU: its stages and time limits (--dry-run), and the CPU version of the
whole run ending in one summary table (GPU_CHECK_DEVICE=cpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_summary_script() -> object:
    """scripts/gpu_summary.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "scripts" / "gpu_summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_summary"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


_summary = _load_summary_script()
Stage, format_summary = _summary.Stage, _summary.format_summary  # type: ignore[attr-defined]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BUDGET_S = 9 * 60
STARTUP_S = 20  # versions, the summary, and what the stages' limits do not cover


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


def _stages(text: str) -> dict[str, tuple[int, str]]:
    """`== NAME (timeout Ns): command` lines → NAME: (N, command)."""
    return {m[1]: (int(m[2]), m[3]) for m in re.finditer(r"^== (\S+) \(timeout (\d+)s\): (.*)$", text, re.M)}


def test_default_stages_fit_the_nine_minutes() -> None:
    done = _run("--dry-run", GPU_CHECK_DEVICE="cuda", BENCH_PRESETS="")
    assert done.returncode == 0, done.stderr
    stages = _stages(done.stdout)
    assert list(stages) == ["tests", "tiny", "qwen2-0.5b", "latency"]  # llama-8b only when asked for
    assert sum(limit for limit, _ in stages.values()) + STARTUP_S <= BUDGET_S
    assert "SLUICE_TEST_DEVICE=cuda" in stages["tests"][1] and "tests/engine " in stages["tests"][1]
    # Each benchmark stage runs two commands within its one limit: the benchmark, then its GPU extras.
    tiny, tiny_decode = stages["tiny"][1].split("; ")
    qwen, qwen_decode = stages["qwen2-0.5b"][1].split("; ")
    assert "--concurrency 256" in tiny and "sluice-continuous-eager" in tiny
    assert "scripts/decode_roofline.py" in tiny_decode and "--batch 64" in tiny_decode
    assert "--concurrency 64,256" in qwen and "--dtype bfloat16" in qwen
    assert "--device cuda" in qwen and "--methods hf-static,sluice-continuous " in qwen
    assert "--preset qwen2-0.5b --dtype bfloat16 --batch 64" in qwen_decode
    lat, extras = stages["latency"][1].split("; ")
    assert "bench latency" in lat and "--variants off,ngram,int8,fp8" in lat and "--concurrency 64" in lat
    assert "--device cuda" in lat and "--if-no-embedded tiny" in lat
    assert "scripts/gpu_latency_extras.py" in extras
    assert "--preset qwen2-0.5b --variants off,int8,fp8" in extras


def test_bench_presets_adds_stages() -> None:
    done = _run("--dry-run", GPU_CHECK_DEVICE="cuda", BENCH_PRESETS="llama-1b llama-8b")
    assert list(_stages(done.stdout)) == ["tests", "tiny", "qwen2-0.5b", "llama-1b", "llama-8b", "latency"]
    assert "--preset llama-8b" in _stages(done.stdout)["llama-8b"][1]


def test_cpu_run_ends_with_one_summary_table(tmp_path: Path) -> None:
    done = _run(OUT=str(tmp_path), GPU_CHECK_DEVICE="cpu", BENCH_PRESETS="", TEST_ARGS="", BENCH_ARGS="")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary in done.stdout
    lines = summary.splitlines()
    assert lines[0].split()[:3] == ["stage", "conc", "method"] and set(lines[1]) <= {"-", " "}
    assert re.search(r"^tests/engine \(cpu\) .* PASSED: [1-9]\d* passed, 0 failed", summary, re.M)
    rows = {(ln.split()[0], ln.split()[2]): ln for ln in lines[2:]}
    assert re.search(r"tiny +4 +hf-static +\d+ +1\.00", rows["tiny", "hf-static"])
    assert "n/a (CPU)" in rows["tiny", "sluice-continuous"]
    assert "skipped" in rows["tiny", "sluice-continuous-eager"]
    decode = r"^tiny +- +decode steps, batch 4 +[\d,]+ .* n/a \(CPU\) +n/a +[\d.]+ ms a step"
    assert re.search(decode, summary, re.M)
    assert "decode tokens/s with CUDA graphs" not in summary  # a ratio not measured (no graphs on a CPU)
    assert re.search(
        r"^tiny .* ratio .* \[tiny, 4 requests\] sluice-continuous tokens/s ÷ hf-static: ", summary, re.M
    )
    assert "ok (exit 0" in rows["tiny", "stage"]
    # The latency stage: every CPU variant on both workloads at batch 1 and 4 at once.
    for variant in ("off", "ngram", "int8"):
        for workload in ("repetitive", "non-repetitive"):
            assert re.search(
                rf"^latency +1 +{variant} {workload} \(decode\) +[\d,]+ .*x off; TTFT p50", summary, re.M
            )
            assert re.search(rf"^latency +4 +{variant} {workload} \(output\) +[\d,]+ .*x off", summary, re.M)
    # The weight formats on a larger shape (the tiny preset's on a CPU, where fp8 is not asked for).
    for variant in ("off", "int8"):
        assert re.search(rf"^latency +1 +{variant} tiny \(decode\) +[\d,]+ .*x off", summary, re.M)
    assert not re.search(r"\bMET\b|NOT MEASURED|target", summary)  # figures and ratios only
    assert "ok (exit 0" in rows["latency", "stage"]


def test_a_stage_past_its_limit_is_cut_and_reported(tmp_path: Path) -> None:
    done = _run(
        OUT=str(tmp_path),
        GPU_CHECK_DEVICE="cpu",
        BENCH_PRESETS="",
        TESTS_TIMEOUT_S="1",
        TINY_TIMEOUT_S="1",
        LATENCY_TIMEOUT_S="1",
    )
    assert done.returncode != 0
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"^tests/engine \(cpu\) .* NO RESULTS \(TIMED OUT after \d+ s", summary, re.M)
    assert re.search(r"^tiny .* NO RESULTS \(TIMED OUT after \d+ s\)", summary, re.M)
    assert re.search(r"^latency .* NO RESULTS \(TIMED OUT after \d+ s\)", summary, re.M)


def test_a_stage_stopped_midway_keeps_the_concurrencies_it_finished(tmp_path: Path) -> None:
    fig = {"tokens_per_s": 900.0, "ratio_to_hf-static": 2.0, "forward_share_max_batch": 0.95}
    doc = {
        "partial": True,
        "runs": [
            {"concurrency": 64, "methods": {"sluice-continuous": {**fig, "cuda_graphs": "on", "setting": ""}}}
        ],
        "ratios": [{"name": "[m, 64 requests] x", "value": 2.0}, {"name": "[m] y", "value": None}],
    }
    (tmp_path / "b.json").write_text(json.dumps(doc))
    stage = Stage("qwen2-0.5b", tmp_path / "b.json", 124, 190, (tmp_path / "decode.json",))  # never written
    table = format_summary(None, [stage])
    assert re.search(r"qwen2-0.5b +64 +sluice-continuous +900 +2\.00 +95\.0% +on", table)
    assert "decode steps" in table and "not reached" in table
    assert "[m, 64 requests] x: 2" in table and "[m] y" not in table  # a ratio not measured is left out
    assert "FAILED, figures of the concurrencies finished before it stopped (TIMED OUT after 190 s)" in table


def test_tests_cut_at_their_limit_are_counted_from_the_progress_lines(tmp_path: Path) -> None:
    (tmp_path / "gpu-tests.log").write_text("..F.s.....   [ 40%]\n.E..\nwarnings summary\n")
    table = format_summary(Stage("tests/engine (cuda)", tmp_path / "gpu-tests.xml", 124, 170), [])
    assert (
        "NO RESULTS (TIMED OUT after 170 s; before it stopped: 11 passed, 1 failed, 1 errors, 1 skipped)"
        in table
    )
