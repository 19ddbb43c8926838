"""What a GPU the kernel or graph capture fails on gets: a start-up check of the Triton kernel (auto falls
back to the torch backend with a warning, an explicit triton refuses to start) and eager steps when CUDA
graph capture fails. Run on CPU with the kernel under Triton's interpreter and the failures injected."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import services.engine.executor.kernels.paged_attention as paged
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.executor.cuda_graphs import StaticDecode
from services.engine.executor.kernels.paged_attention import self_check
from services.engine.executor.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE

DEVICE = torch.device(TEST_DEVICE)


def test_the_kernel_passes_its_start_up_check() -> None:
    assert self_check(DEVICE, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16) is None
    assert self_check(DEVICE, torch.bfloat16, num_heads=8, num_kv_heads=8, head_dim=24) is None


def test_a_kernel_that_computes_wrong_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged, "paged_decode_attention", lambda query, *a, **k: torch.zeros_like(query))
    why = self_check(DEVICE, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    assert why is not None and "away from the reference" in why


def test_a_kernel_that_cannot_compile_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no kernel image for this architecture")

    monkeypatch.setattr(paged, "paged_decode_attention", broken)
    why = self_check(DEVICE, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    assert why == "RuntimeError: no kernel image for this architecture"


def runner(model_dir: Path) -> ModelRunner:
    settings = EngineSettings(
        model=str(model_dir), device=TEST_DEVICE, dtype="float32", num_kv_blocks=8, attention_backend="triton"
    )
    return ModelRunner(settings)


def test_a_failing_check_means_torch_under_auto_and_no_start_under_triton(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    r = runner(llama_dir)
    monkeypatch.setattr(paged, "self_check", lambda *a, **kw: "RuntimeError: no kernel image")
    with caplog.at_level(logging.WARNING):
        assert r._checked_kernel("auto") == "torch"
    assert "fails its start-up check: RuntimeError: no kernel image" in caplog.text
    with pytest.raises(ValueError, match="triton: the kernel fails its start-up check: RuntimeError"):
        r._checked_kernel("triton")
    monkeypatch.setattr(paged, "self_check", lambda *a, **kw: None)
    assert r._checked_kernel("auto") == "triton"


def test_a_failing_graph_capture_leaves_every_step_eager(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture that raises (injected, so on any device): the runner must go on eagerly."""

    def refuse(self: StaticDecode, forward: object) -> None:
        raise RuntimeError("capture refused for the test")

    monkeypatch.setattr(ModelRunner, "_graphs_wanted", lambda self: (True, ""))
    monkeypatch.setattr(StaticDecode, "capture", refuse)
    r = runner(llama_dir)
    with caplog.at_level(logging.WARNING):
        r.prepare(max_model_len=128, max_num_seqs=4)
    assert "CUDA graphs: capture failed, every step runs eagerly" in caplog.text
    assert r._static is None
    req = Request("a", [5, 6, 7, 8], SamplingParams(), StoppingParams(max_new_tokens=2))
    req.block_ids = [0]
    logits, reqs = r.execute([(req, 4)])
    assert reqs == [req] and logits.shape == (1, r.vocab_size) and torch.isfinite(logits).all()
    req.token_ids.append(int(logits[0].argmax()))
    req.num_computed_tokens = 4
    logits, _ = r.execute([(req, 1)])  # a decode-only step, eager
    assert logits.shape == (1, r.vocab_size)
