"""Mixture-of-experts models (Mixtral, Qwen3-MoE, GPT-OSS; sluice/model/moe.py) in the engine: greedy output
equals transformers' `generate` token for token under chunked prefill, preemption and prefix-cache hits,
with each experts kernel and on the Triton kernel (padded decode batches included); the experts kernel
chosen at start-up; the tokens each step routes to each expert, counted on the step (padding rows left
out) and exported in the engine's metrics."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from services.common.metrics import EngineMetrics, render
from services.engine.core.engine import LLMEngine
from services.engine.executor.moe import ExpertLoad
from services.engine.observability import EngineObserver, max_load_ratio
from services.engine.settings import EngineSettings
from sluice.model.moe import make_moe_model
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_model import Workload, reference, run_engine, small_engine, workload
from tests.engine.test_runner import JOIN_AND_LEAVE, engine_with
from tests.observability.processes import parse_metrics

if TEST_DEVICE == "cpu":  # the kernel runs under Triton's interpreter on CPU (tests/conftest.py sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss"]

MoeDir = Callable[[str], Path]


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> MoeDir:
    """`moe_dir(arch) -> Path`: the small `arch` model of sluice/model/moe.py, made once per session."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_moe_model(tmp_path_factory.mktemp(arch) / "model", arch, seed=0)
        return made[arch]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate(family: str, moe_dir: MoeDir) -> None:
    model_dir = moe_dir(family)
    items = workload(seed=11)
    engine = small_engine(model_dir)
    assert engine.runner.moe_experts == "grouped_mm"
    assert run_engine(engine, items) == reference(model_dir, items)
    st = engine.stats()
    assert st.num_preemptions > 0, "the pool is too small for all: preemption must happen"
    assert st.prefix_hit_rate > 0, "shared prompts must hit the prefix cache"
    assert any(len(p) > 64 for _, p, _ in items), "some prompts are chunked"


def test_the_experts_change_the_output(moe_dir: MoeDir) -> None:
    """The greedy comparisons can fail: with expert 0 of every layer switched off, the outputs differ."""
    model_dir = moe_dir("mixtral")
    items = workload(seed=11, n=12)
    engine = small_engine(model_dir, num_kv_blocks=64)
    for module in engine.runner.model.modules():
        if hasattr(module, "has_gate"):
            module.down_proj.data[0].zero_()
    assert run_engine(engine, items) != reference(model_dir, items)


@pytest.mark.parametrize("experts", ["eager", "batched_mm"])
def test_every_experts_kernel_matches_generate(experts: str, moe_dir: MoeDir) -> None:
    model_dir = moe_dir("qwen3_moe")
    items = workload(seed=4, n=10)
    engine = small_engine(model_dir, moe_experts=experts)
    assert engine.runner.moe_experts == experts
    assert run_engine(engine, items) == reference(model_dir, items)


def test_the_experts_setting_is_checked(moe_dir: MoeDir) -> None:
    with pytest.raises(ValueError, match="moe_experts must be one of auto, grouped_mm, eager, batched_mm"):
        EngineSettings(model=str(moe_dir("mixtral")), moe_experts="loop").validate()


def test_a_dense_model_has_no_experts(llama_dir: Path) -> None:
    engine = small_engine(llama_dir)
    assert engine.runner.moe_experts == "" and engine.runner.expert_load is None


def expected_counts(model_dir: Path, items: Workload, got: dict[str, list[int]]) -> np.ndarray:
    """(layers, experts) tokens routed by transformers' own forward over every token the engine computes
    once: each prompt and its output but the last token (which is never fed back)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(TEST_DEVICE).eval()
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    counts = np.zeros((config.num_hidden_layers, experts), dtype=np.int64)
    with torch.inference_mode():
        for i, (_, prompt, _) in enumerate(items):
            ids = torch.tensor([[*prompt, *got[str(i)][:-1]]], device=TEST_DEVICE)
            routers = model(input_ids=ids, output_router_logits=True).router_logits  # per layer (T, E)
            for layer, logits in enumerate(routers):
                top = logits.topk(config.num_experts_per_tok, dim=-1).indices.reshape(-1).cpu()
                counts[layer] += np.bincount(top.numpy(), minlength=experts)
    return counts


def distinct_prompts(seed: int, n: int, vocab: int = 384) -> Workload:
    """Prompts sharing no block (no prefix-cache hit: every token is computed once)."""
    rng = random.Random(seed)
    return [(i % 3, [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))], 6) for i in range(n)]


def taken_sum(load: ExpertLoad, steps: list[np.ndarray]) -> np.ndarray:
    steps.extend(load.take())
    return np.sum(steps, axis=0)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_expert_load_counts_every_routed_token(family: str, moe_dir: MoeDir) -> None:
    """Per step, the tokens routed to each expert; over the run, exactly the routing of transformers'
    forward over the same tokens (chunked prefill and decode steps; no preemption: nothing recomputed)."""
    model_dir = moe_dir(family)
    items = distinct_prompts(seed=1, n=9)
    engine = small_engine(model_dir, num_kv_blocks=64, max_num_batched_tokens=24)
    load = engine.runner.expert_load
    assert load is not None and load.layers == [0, 1] and load.num_experts == 8
    load.counts.fill_(7.0)  # what a forward that failed before its end would leave: not counted
    got = run_engine(engine, items)
    assert engine.stats().num_preemptions == 0
    steps = load.take()
    assert len(steps) == engine.stats().steps
    assert all(s.shape == (2, 8) for s in steps)
    assert (taken_sum(load, steps) == expected_counts(model_dir, items, got)).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_rows_of_a_padded_decode_batch_count_nothing(family: str, moe_dir: MoeDir) -> None:
    """Decode batches padded to 1, 2, 4, 5 rows (the triton kernel, static buffers, eagerly on CPU): greedy
    equals generate and only the real rows are counted."""
    model_dir = moe_dir(family)
    engine = engine_with(model_dir, async_scheduling="off", attention_backend="triton", static_decode=True)
    load = engine.runner.expert_load
    assert load is not None
    got = run_engine(engine, JOIN_AND_LEAVE)
    assert got == reference(model_dir, JOIN_AND_LEAVE)
    assert (taken_sum(load, []) == expected_counts(model_dir, JOIN_AND_LEAVE, got)).all()


def test_max_load_ratio() -> None:
    assert max_load_ratio(np.array([[2, 2, 2, 2], [4, 0, 0, 0]])) == pytest.approx(4.0)
    assert max_load_ratio(np.array([[3, 1, 0, 0], [0, 0, 0, 0]])) == pytest.approx(3.0)  # layer 2 idle
    assert max_load_ratio(np.zeros((2, 4), dtype=np.int64)) is None


def test_expert_load_is_in_the_engine_metrics(moe_dir: MoeDir) -> None:
    engine = small_engine(moe_dir("mixtral"), num_kv_blocks=64)
    metrics = EngineMetrics()
    load = engine.runner.expert_load
    assert load is not None
    taken: list[np.ndarray] = []
    take = load.take

    def spy() -> list[np.ndarray]:
        steps = take()
        taken.extend(steps)
        return steps

    load.take = spy  # type: ignore[method-assign]
    engine.observer = EngineObserver(metrics, stats=engine.recorder, model_name="moe", expert_load=load)
    items = distinct_prompts(seed=2, n=4)
    got = run_engine(engine, items)
    samples = parse_metrics(render(metrics.registry)[0].decode())
    expected = expected_counts(moe_dir("mixtral"), items, got)
    for layer in (0, 1):
        for expert in range(8):
            labels = f'expert="{expert}",layer="{layer}"'
            assert samples[f"sluice_moe_expert_tokens_total{{{labels}}}"] == expected[layer, expert]
    assert len(taken) == engine.stats().steps == samples["sluice_moe_expert_load_ratio_count"]
    ratios = [r for r in map(max_load_ratio, taken) if r is not None]
    assert len(ratios) == len(taken)  # every step routed tokens
    assert samples["sluice_moe_expert_load_ratio_sum"] == pytest.approx(sum(ratios))
    assert all(1.0 <= r <= 8 / 2 for r in ratios)  # balanced .. every token on the same 2 of 8


def test_a_dense_engine_exports_no_expert_samples() -> None:
    text = render(EngineMetrics().registry)[0].decode()
    assert "# TYPE sluice_moe_expert_tokens" in text
    assert "sluice_moe_expert_tokens_total{" not in text


def test_load_ignores_forwards_before_the_first_step(moe_dir: MoeDir) -> None:
    """The warm-up and capture forwards of start-up are not a request's routing."""
    engine = small_engine(moe_dir("mixtral"))
    load = engine.runner.expert_load
    assert load is not None
    assert load.take() == []
    assert not load.counts.any()


def test_an_engine_built_for_moe_serves_with_its_load(moe_dir: MoeDir) -> None:
    """The service wires the runner's expert load into its observer."""
    from services.engine.server import _observed_engine

    settings = EngineSettings(
        model=str(moe_dir("mixtral")), device=TEST_DEVICE, num_kv_blocks=16, max_model_len=128
    )
    core: LLMEngine = _observed_engine(settings, EngineMetrics())
    assert isinstance(core.observer, EngineObserver)
    assert core.observer.expert_load is core.runner.expert_load  # type: ignore[attr-defined]
