"""`sluice bench engine` on a reduced workload: every method's figures, the greedy comparison, JSON; its
options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.bench import engine as bench
from sluice.bench.engine_driver import Progress
from sluice.bench.engine_methods import (
    ALL_METHODS,
    DEFAULT_METHODS,
    HF_METHODS,
    BenchContext,
    MethodResult,
    Workload,
    make_workload,
)
from sluice.model.presets import BOS_ID, EOS_ID, FIRST_PLAIN_ID, PAD_ID

# One torch thread: the figures don't matter here, and it keeps the run short on a busy machine.
QUICK = ["--quick", "--device", "cpu", "--no-progress", "--threads", "1", "--output-len", "6,14"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    rc = bench.main([*QUICK, "--json", str(out / "b.json")])
    return rc, json.loads((out / "b.json").read_text())


def test_every_method_runs_and_reports_its_figures(quick_run: tuple[int, dict[str, Any]]) -> None:
    rc, doc = quick_run
    assert rc == 0, {name: m.get("error") for name, m in doc["methods"].items()}
    assert list(doc["methods"]) == list(DEFAULT_METHODS)  # on a CPU, no eager engine: the same one there
    assert [run["concurrency"] for run in doc["runs"]] == [4] and doc["runs"][0]["methods"] == doc["methods"]
    expected_tokens = doc["workload"]["output_tokens"]
    for name, fig in doc["methods"].items():
        assert fig["error"] is None, name
        assert fig["output_tokens"] == expected_tokens, name
        assert fig["wall_s"] > 0 and fig["tokens_per_s"] > 0, name
        assert fig["ratio_to_hf-static"] == pytest.approx(
            fig["tokens_per_s"] / doc["methods"]["hf-static"]["tokens_per_s"]
        )
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["torch"]
    assert doc["partial"] is False


def test_the_json_holds_each_finished_concurrency_before_the_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "b.json"
    seen: list[dict[str, Any]] = []
    report_of = bench._report

    def report_reads_the_json(*args: Any) -> int:
        seen.append(json.loads(out.read_text()))
        return report_of(*args)

    monkeypatch.setattr(bench, "_report", report_reads_the_json)
    argv = [*QUICK, "--concurrency", "2,3", "--methods", "sluice-continuous", "--json", str(out)]
    assert bench.main(argv) == 0
    (partial,) = seen
    assert partial["partial"] is True and [r["concurrency"] for r in partial["runs"]] == [2, 3]
    assert json.loads(out.read_text())["partial"] is False


def test_greedy_outputs_agree_with_sequential_generate(quick_run: tuple[int, dict[str, Any]]) -> None:
    _, doc = quick_run
    assert doc["reference"] == "hf-sequential"
    for name, fig in doc["methods"].items():
        assert fig["mismatching_requests"] == 0, name
        assert fig["tokens_compared"] == doc["workload"]["output_tokens"], name
        assert fig["greedy_equals_hf-sequential"] is True, name


def test_a_changed_token_is_reported_as_differing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """hf-sequential and the sluice methods, sluice-continuous with token 2 of request 0 replaced: that
    request differs, compared up to the changed token."""
    real = bench.run_sluice

    def altered(ctx: BenchContext, work: Workload, batching: str, progress: Progress) -> MethodResult:
        result = real(ctx, work, batching, progress)
        if batching == "continuous":
            result.outputs[0][2] = FIRST_PLAIN_ID + (result.outputs[0][2] + 1 - FIRST_PLAIN_ID) % 100
        return result

    monkeypatch.setattr(bench, "run_sluice", altered)
    out = tmp_path / "b.json"
    methods = "hf-sequential,sluice-static,sluice-dynamic,sluice-continuous"
    assert bench.main([*QUICK, "--concurrency", "2", "--methods", methods, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    head = doc["methods"]["sluice-continuous"]
    assert head["mismatching_requests"] == 1 and head["greedy_equals_hf-sequential"] is False
    assert sum(m["mismatching_requests"] for m in doc["methods"].values()) == 1
    first_output = make_workload(2, 0, 8192, (16, 48), (6, 14)).max_new_tokens[0]
    assert head["tokens_compared"] == doc["workload"]["output_tokens"] - first_output + 3
    assert "no (1)" in capsys.readouterr().out


def test_engine_figures_are_fractions(quick_run: tuple[int, dict[str, Any]]) -> None:
    _, doc = quick_run
    engine_keys = ("forward_share", "forward_share_max_batch", "kv_efficiency", "max_batch", "preemptions")
    for name, fig in doc["methods"].items():
        if name in HF_METHODS:
            assert all(fig[key] is None for key in engine_keys), name
        else:
            assert 0.0 < fig["forward_share"] <= 1.0, name
            assert 0.0 < fig["forward_share_max_batch"] <= 1.0, name
            assert 0.0 < fig["kv_efficiency"] <= 1.0, name
            assert 1 <= fig["max_batch"] <= 4 and fig["preemptions"] == 0, name


def test_ratios_are_measured_figures_without_verdicts(quick_run: tuple[int, dict[str, Any]]) -> None:
    _, doc = quick_run
    methods = doc["methods"]
    speed = doc["ratios"]
    assert [r["name"].split("÷ ")[1] for r in speed] == ["hf-static", "hf-sequential"]
    for r in speed:
        other = r["name"].split("÷ ")[1]
        assert r["value"] == pytest.approx(
            methods["sluice-continuous"]["tokens_per_s"] / methods[other]["tokens_per_s"]
        )
    assert all(set(r) == {"name", "value"} for r in doc["ratios"]) and "targets" not in doc


def test_concurrency_blocks_and_eager_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    argv = [
        *QUICK,
        "--concurrency",
        "2,3",
        "--methods",
        "sluice-continuous,sluice-continuous-eager",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [(r["concurrency"], r["workload"]["num_requests"]) for r in doc["runs"]] == [(2, 2), (3, 3)]
    for run in doc["runs"]:
        assert run["methods"]["sluice-continuous-eager"] == {"skipped": "n/a (CPU)", "error": None}
        assert run["methods"]["sluice-continuous"]["cuda_graphs"] == "n/a (CPU)"
    printed = capsys.readouterr().out
    assert "-- tiny, 2 requests at once" in printed and "-- tiny, 3 requests at once" in printed
    assert "[tiny, 3 requests] sluice-continuous" in printed


def _resolved(argv: list[str]) -> Any:
    args = bench.build_parser().parse_args(argv)
    bench._resolve(args)
    return args


def test_concurrency_parsing() -> None:
    assert _resolved(["--device", "cpu", "--concurrency", "64,256"]).concurrency == (64, 256)
    cpu = _resolved(["--device", "cpu", "--preset", "qwen2-0.5b"])
    assert (cpu.concurrency, cpu.dtype, cpu.methods) == ((64,), "float32", DEFAULT_METHODS)  # CPU defaults


def test_on_cuda_a_real_model_defaults_to_bf16_at_64_and_256(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = _resolved(["--preset", "qwen2-0.5b"])
    assert (gpu.device, gpu.dtype, gpu.concurrency) == ("cuda", "bfloat16", (64, 256))
    assert gpu.methods == ALL_METHODS
    tiny = _resolved(["--device", "cuda"])
    assert (tiny.dtype, tiny.concurrency) == ("float32", (64,))


def test_a_failing_method_is_reported_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setitem(bench.HF_RUNNERS, "hf-static", broken)
    out = tmp_path / "b.json"
    argv = [*QUICK, "--methods", "hf-sequential,hf-static", "--repeat", "2", "--json", str(out)]
    rc = bench.main(argv)
    doc = json.loads(out.read_text())
    assert rc == 1
    assert doc["methods"]["hf-static"] == {"error": "RuntimeError: boom"}
    sequential = doc["methods"]["hf-sequential"]
    assert sequential["mismatching_requests"] == 0
    assert len(sequential["runs_tokens_per_s"]) == 2
    assert sequential["tokens_per_s"] == max(sequential["runs_tokens_per_s"])
    assert all(r["value"] is None for r in doc["ratios"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--methods", "nope"],
        ["--prompt-len", "9,3"],
        ["--repeat", "0"],
        ["--concurrency", "0"],
        ["--concurrency", "8,x"],
        ["--preset", "gpt-9"],
        ["--preset", "llama-1b", "--model", "."],
        ["--model", "/nonexistent"],
        ["--decode-batch", "8"],  # decode-only steps: scripts/decode_roofline.py
    ],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", *argv])
    assert exc.value.code == 2


def test_workload_is_seeded_in_range_and_free_of_special_ids() -> None:
    a = make_workload(64, seed=3, vocab_size=8192)
    assert a == make_workload(64, seed=3, vocab_size=8192)
    assert a != make_workload(64, seed=4, vocab_size=8192)
    assert all(16 <= len(p) <= 256 for p in a.prompts)
    assert all(8 <= n <= 256 for n in a.max_new_tokens)
    ids = {t for p in a.prompts for t in p}
    assert min(ids) >= FIRST_PLAIN_ID and max(ids) < 8192
    assert not ids & {PAD_ID, BOS_ID, EOS_ID}
