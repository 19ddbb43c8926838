"""The compiled step (executor/compiled.py): its buckets, the custom op's fake implementation against
the real one, greedy outputs under --compile on against transformers' generate with the graphs compiled
at start-up only, the fallback to eager when a model does not compile, and the setting on `sluice up`.
Compiles the smallest model with two buckets, so that the whole file stays well under a minute."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from services.engine.core.engine import LLMEngine
from services.engine.executor import attention, compiled
from services.engine.executor.attention import PrefillSeq, StepMeta
from services.engine.settings import EngineSettings
from sluice.launcher import parse_args, plan_children
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_model import reference, run_engine

H, HKV, D = 4, 2, 16


def test_buckets_double_to_the_batch_then_grow_fourfold_to_the_token_budget() -> None:
    assert compiled.buckets(8, 100) == [1, 2, 4, 8, 32, 100]
    assert compiled.buckets(5, 5) == [1, 2, 4, 5]
    assert compiled.bucket_for([1, 2, 4, 5], 3) == 4
    assert compiled.bucket_for([1, 2, 4, 5], 6) is None


def _prefill_step(t: int, slots: int = 64) -> tuple[StepMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One prefill chunk of `t` tokens without context, and its query, key and value."""
    gen = torch.Generator().manual_seed(0)
    pool = [(torch.zeros(slots, HKV, D), torch.zeros(slots, HKV, D))]
    meta = StepMeta(pool, torch.arange(t), [], [PrefillSeq(0, t, 0, None)])
    q, k, v = (torch.randn(1, h, t, D, generator=gen) for h in (H, HKV, HKV))
    return meta, q, k, v


def test_custom_op_fake_matches_the_real_shape_and_pads_with_zeros() -> None:
    meta, q, k, v = _prefill_step(5)
    padded = [torch.cat([x, torch.ones(1, x.shape[1], 3, D)], dim=2) for x in (q, k, v)]
    with compiled.current_step(meta):
        real = compiled.paged_attention_op(*padded, 0, D**-0.5, 0, 0.0, None)
    with FakeTensorMode() as mode:
        fake = compiled.paged_attention_op(*(mode.from_tensor(x) for x in padded), 0, D**-0.5, 0, 0.0, None)
    assert fake.shape == real.shape == (1, 8, H, D) and fake.dtype == real.dtype
    meta2, *_ = _prefill_step(5)
    eager, _ = attention.paged_attention(
        compiled._Layer(0), q, k, v, None, D**-0.5, **{attention.META_KWARG: meta2}
    )
    torch.testing.assert_close(real[:, :5], eager)
    assert not real[:, 5:].any(), "padding rows are zeros"
    torch.testing.assert_close(meta.kv[0][0], meta2.kv[0][0])  # the real rows' K written as eagerly


def test_the_op_needs_a_current_step() -> None:
    _, q, k, v = _prefill_step(2)
    with pytest.raises(RuntimeError, match="current_step"):
        compiled.paged_attention_op(q, k, v, 0, 1.0, 0, 0.0, None)


def _engine(model_dir: Path, **kw: object) -> LLMEngine:
    settings = dict(model=str(model_dir), device=TEST_DEVICE, dtype="float32", num_kv_blocks=32,
                    max_num_seqs=1, max_num_batched_tokens=4, max_model_len=128)  # fmt: skip
    settings.update(kw)
    return LLMEngine(EngineSettings(**settings))  # type: ignore[arg-type]


def test_compiled_greedy_matches_generate_with_every_graph_compiled_at_start_up(llama_dir: Path) -> None:
    before = counters["stats"]["unique_graphs"]
    engine = _engine(llama_dir, compile="on")
    step = engine.runner._compiled
    assert step is not None and step.sizes == [1, 4]  # decode batches of 1, prefill chunks of up to 4
    if engine.runner.device.type == "cpu" and torch.backends.mkldnn.is_available():
        assert engine.runner.packed_linears > 0  # oneDNN's layers inside the graphs (sluice::packed_linear)
    compiled_at_start = counters["stats"]["unique_graphs"] - before
    assert compiled_at_start == len(step.sizes)
    runs = []
    run = compiled.CompiledStep.run

    def spy(self: compiled.CompiledStep, ids: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        runs.append(ids.shape[1])
        return run(self, ids, *args, **kw)  # type: ignore[arg-type]

    items = [(0, [5, 9, 13, 17, 21, 40, 41], 6), (0, [7, 3, 99], 4)]  # prompts of 2 chunks and of 1
    compiled.CompiledStep.run = spy  # type: ignore[method-assign]
    try:
        assert run_engine(engine, items) == reference(llama_dir, items)
    finally:
        compiled.CompiledStep.run = run  # type: ignore[method-assign]
    assert {1, 3, 4} <= set(runs), f"step sizes run: {sorted(set(runs))}"
    assert counters["stats"]["unique_graphs"] - before == compiled_at_start, "a step recompiled"


def test_a_model_that_does_not_compile_runs_eagerly_saying_why(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(self: compiled.CompiledStep, meta: StepMeta) -> float:
        raise RuntimeError("an operator inductor cannot lower")

    monkeypatch.setattr(compiled.CompiledStep, "warm_up", fail)
    with caplog.at_level(logging.WARNING):
        engine = _engine(llama_dir, compile="on")
    assert engine.runner._compiled is None
    assert "compile: failed, every step runs eagerly: RuntimeError: an operator inductor" in caplog.text


def test_auto_is_off_on_a_cpu_and_the_setting_is_checked(llama_dir: Path) -> None:
    if TEST_DEVICE == "cpu":
        assert _engine(llama_dir, compile="auto").runner._compiled is None
    with pytest.raises(ValueError, match="compile"):
        EngineSettings(compile="fast").validate()


def test_sluice_up_passes_compile_to_the_engines() -> None:
    children = plan_children(parse_args(["--compile", "on"]), "/models/m")
    engine = next(c for c in children if c.service == "engine")
    flags = list(engine.flags)
    assert flags[flags.index("--compile") + 1] == "on"
    others = plan_children(parse_args([]), "/models/m")
    assert all("--compile" not in c.flags for c in others)
