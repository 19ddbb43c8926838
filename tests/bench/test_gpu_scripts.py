"""The GPU check's measurements under scripts/: decode-only steps against the memory roofline
(scripts/decode_roofline.py: arithmetic, bandwidths, report, a CPU run) and the weight formats on a larger
shape (scripts/gpu_latency_extras.py: ratios, tables, JSON, a CPU run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sluice.bench.engine_driver import kv_bytes_per_token
from sluice.bench.latency import RunFigures
from sluice.bench.report import NOT_ON_CPU
from sluice.model.presets import count_parameters, preset_config, preset_model_dir

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


roof = _script("decode_roofline")
extras = _script("gpu_latency_extras")
QUICK = ["--quick", "--device", "cpu", "--no-progress", "--threads", "1"]


def test_roofline_arithmetic() -> None:
    qwen = preset_config("qwen2-0.5b")  # tied: the embedding is read whole, as the output projection
    assert roof.weight_bytes_per_step(qwen, 2) == 2 * count_parameters(qwen)
    assert kv_bytes_per_token(qwen, 2) == 2 * 24 * 2 * 64 * 2
    llama8 = preset_config("llama-8b")  # untied: the input embedding is read at a few rows only
    assert roof.weight_bytes_per_step(llama8, 2) == 2 * (count_parameters(llama8) - 128256 * 4096)
    bound = roof.decode_roofline(qwen, 2, batch=64, context=200, gbps=4800)
    assert bound.kv_bytes == 64 * 200 * 12288
    assert bound.seconds == pytest.approx((2 * 494_032_768 + 64 * 200 * 12288) / 4.8e12)
    assert roof.decode_roofline(qwen, 2, 64, 200, None).seconds is None


@pytest.mark.parametrize(
    ("name", "gbps"),
    [
        ("NVIDIA H200", 4800),
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA L40S", 864),
        ("NVIDIA L4", 300),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_bandwidth_by_gpu_name(name: str, gbps: float | None) -> None:
    assert roof.hbm_gbps(name) == gbps


def test_a_cpu_has_a_bandwidth_only_when_given() -> None:
    assert roof.device_bandwidth("cpu", None)[0] is None
    assert roof.device_bandwidth("cpu", 100.0) == (100.0, "--hbm-gbps")


def _decode(graphs: str, step_s: float, gbps: float | None = 1000.0) -> Any:
    step = roof.DecodeStep(cuda_graphs=graphs, batch=64, mean_context=200.0, steps=32, step_s=step_s)
    roofline = roof.Roofline(weight_bytes=900_000_000, kv_bytes=100_000_000, gbps=gbps)
    return roof.DecodeFigure(step, roofline, "NVIDIA H200")


def test_decode_roofline_ratio_and_graphs_speedup() -> None:
    on, off = _decode("on", 0.002), _decode("off", 0.004)  # roofline: 1e9 bytes at 1000 GB/s = 1 ms
    assert on.roofline.seconds == pytest.approx(1e-3) and on.ratio == pytest.approx(2.0)
    graphs = roof.graphs_ratio([on, off], "qwen2-0.5b", 64)
    assert graphs.value == pytest.approx(2.0)
    assert "[qwen2-0.5b] decode tokens/s with CUDA graphs" in graphs.name
    slow = roof.graphs_ratio([_decode("on", 0.0035), _decode("off", 0.004)], "m", 64)
    assert _decode("on", 0.0035).ratio == pytest.approx(3.5) and slow.value == pytest.approx(0.004 / 0.0035)
    text = roof.format_decode([on, off], None)
    assert "2.00 ms a step" in text and "2.00× the roofline" in text and "CUDA graphs off" in text
    assert on.to_json()["ratio_to_roofline"] == pytest.approx(2.0)


def test_decode_ratios_unmeasured_on_cpu_or_without_a_run() -> None:
    cpu = _decode(NOT_ON_CPU, 0.01, gbps=None)
    assert cpu.ratio is None
    assert roof.graphs_ratio([cpu], "tiny", 64).value is None
    assert roof.graphs_ratio([], "tiny", 64).value is None
    assert "roofline n/a" in roof.format_decode([cpu], None)
    assert "FAILED: RuntimeError: x" in roof.format_decode([], "RuntimeError: x")


def test_decode_steps_on_a_cpu_with_a_given_bandwidth(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    argv = [*QUICK, "--batch", "2", "--steps", "2", "--hbm-gbps", "50", "--json", str(out)]
    assert roof.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "decode" and doc["decode_error"] is None and doc["model"] == "tiny"
    (step,) = doc["decode_steps"]  # one run on a CPU: graphs do not apply
    assert (step["cuda_graphs"], step["batch"], step["steps"]) == ("n/a (CPU)", 2, 2)
    assert step["step_s"] > 0 and step["tokens_per_s"] == pytest.approx(2 / step["step_s"])
    assert step["mean_context"] == pytest.approx(40, abs=2)  # --quick's context
    assert step["hbm_gbps"] == 50 and step["bandwidth_source"] == "--hbm-gbps"
    assert step["roofline_s"] == pytest.approx((step["weight_bytes"] + step["kv_bytes"]) / 50e9)
    assert step["ratio_to_roofline"] == pytest.approx(step["step_s"] / step["roofline_s"])
    assert [r["value"] for r in doc["ratios"]] == [None]  # no CUDA graphs on a CPU


def test_decode_steps_of_a_burst_whose_prefill_takes_several_steps(tmp_path: Path) -> None:
    # 32 prompts of ~400 tokens: the prefill takes 7 steps of 2048 tokens, and the requests whose prefill
    # ended first decode ahead of the others (by up to 6 tokens): none may finish while the steps are timed.
    model = preset_model_dir("tiny", "float32", 0, tmp_path)
    step = roof.measure_decode_step(model, "cpu", "float32", batch=32, context=410, steps=8)
    assert (step.batch, step.steps, step.cuda_graphs) == (32, 8, "n/a (CPU)")
    assert step.mean_context == pytest.approx(410, abs=4) and step.step_s > 0


def _run(tok_s: float) -> RunFigures:
    return RunFigures(1, 1, 10, 10 / tok_s, 10, 10 / tok_s, [0.01], [])


def test_shape_and_kv_ratios_tables_and_json() -> None:
    shape = extras.ShapeRun("qwen2-0.5b", "float32", {"off": _run(4.0), "int8": _run(6.4)})
    assert shape.ratio("int8") == pytest.approx(1.6) and shape.ratio("fp8") is None  # fp8 not run
    kv = extras.KvBlocks(1.0, {"auto": 1000, "fp8": 2000})
    assert kv.ratio == 2.0
    assert "1.60x" in extras.format_shape(shape) and "(2.00x)" in extras.format_kv(kv)
    assert "not measured (CUDA only)" in extras.format_kv(None)
    doc = extras.extras_json(shape, kv, {})
    assert doc["shape"]["ratios_to_off"]["int8"] == pytest.approx(1.6) and doc["kv_blocks"]["ratio"] == 2.0


def test_weight_formats_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    argv = [*QUICK, "--preset", "tiny", "--variants", "int8,fp8", "--json", str(out)]
    assert extras.main(argv) == 0  # fp8 on a CPU is skipped, not failed
    doc = json.loads(out.read_text())
    shape = doc["shape"]
    assert list(shape["runs"]) == ["off", "int8"] and shape["errors"] == {"fp8": "skipped: CUDA only"}
    assert shape["runs"]["int8"]["output_tokens"] == 6 and shape["ratios_to_off"]["int8"] > 0
    assert doc["kv_blocks"] is None  # CUDA only
