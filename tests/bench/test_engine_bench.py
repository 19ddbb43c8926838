"""`sluice bench engine` on a reduced workload: every method's figures, greedy agreement, JSON and PNG."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.bench import engine as bench
from sluice.bench.engine_methods import ALL_METHODS, HF_METHODS
from sluice.bench.engine_workload import BOS_ID, EOS_ID, FIRST_PLAIN_ID, PAD_ID, make_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One torch thread: the figures don't matter here, and it keeps the run short on a busy machine.
QUICK = ["--quick", "--device", "cpu", "--no-progress", "--threads", "1", "--output-len", "6,14"]


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    rc = bench.main([*QUICK, "--json", str(out / "b.json"), "--plot", str(out / "b.png")])
    return rc, json.loads((out / "b.json").read_text()), out / "b.png"


def test_every_method_runs_and_reports_its_figures(quick_run: tuple[int, dict[str, Any], Path]) -> None:
    rc, doc, _ = quick_run
    assert rc == 0, {name: m.get("error") for name, m in doc["methods"].items()}
    assert list(doc["methods"]) == list(ALL_METHODS)
    expected_tokens = doc["workload"]["output_tokens"]
    for name, fig in doc["methods"].items():
        assert fig["error"] is None, name
        assert fig["output_tokens"] == expected_tokens, name
        assert fig["wall_s"] > 0 and fig["tokens_per_s"] > 0, name
        assert fig["ratio_to_hf-continuous"] == pytest.approx(
            fig["tokens_per_s"] / doc["methods"]["hf-continuous"]["tokens_per_s"]
        )
    assert doc["methods"]["hf-continuous"]["sweep"][0]["max_batch_tokens"] == 256
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["torch"]


def test_greedy_outputs_agree_with_sequential_generate(quick_run: tuple[int, dict[str, Any], Path]) -> None:
    _, doc, _ = quick_run
    for name, fig in doc["methods"].items():
        assert fig["mismatching_requests"] == 0, name
        assert fig["greedy_equals_hf-sequential"] is True, name


def test_engine_figures_are_fractions(quick_run: tuple[int, dict[str, Any], Path]) -> None:
    _, doc, _ = quick_run
    engine_keys = ("forward_share", "forward_share_max_batch", "kv_efficiency", "max_batch", "preemptions")
    for name, fig in doc["methods"].items():
        if name in HF_METHODS:
            assert all(fig[key] is None for key in engine_keys), name
        else:
            assert 0.0 < fig["forward_share"] <= 1.0, name
            assert 0.0 < fig["forward_share_max_batch"] <= 1.0, name
            assert 0.0 < fig["kv_efficiency"] <= 1.0, name
            assert 1 <= fig["max_batch"] <= 4 and fig["preemptions"] == 0, name


def test_targets_are_the_issues_and_evaluated(quick_run: tuple[int, dict[str, Any], Path]) -> None:
    _, doc, _ = quick_run
    thresholds = [t["threshold"] for t in doc["targets"]]
    assert thresholds == [2.5, 2.0, 5.0, 0.90, 0.95, 0]
    for target in doc["targets"]:
        assert target["value"] is not None and target["met"] is (
            target["value"] == 0 if target["threshold"] == 0 else target["value"] >= target["threshold"]
        )


def test_plot_is_a_png(quick_run: tuple[int, dict[str, Any], Path]) -> None:
    _, _, png = quick_run
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_a_failing_method_is_reported_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setitem(bench.HF_RUNNERS, "hf-static", broken)
    out = tmp_path / "b.json"
    rc = bench.main([*QUICK, "--methods", "hf-sequential,hf-static", "--repeat", "2", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 1
    assert doc["methods"]["hf-static"] == {"error": "RuntimeError: boom"}
    sequential = doc["methods"]["hf-sequential"]
    assert sequential["mismatching_requests"] == 0
    assert len(sequential["runs_tokens_per_s"]) == 2
    assert sequential["tokens_per_s"] == max(sequential["runs_tokens_per_s"])
    assert all(t["met"] is None for t in doc["targets"])


@pytest.mark.parametrize(
    "argv", [["--methods", "nope"], ["--prompt-len", "9,3"], ["--num-requests", "0"], ["--repeat", "0"]]
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
