"""The KV pool's automatic size (executor/kv_sizing.py): the arithmetic with given numbers, and the
warm-up, measurement and pool replacement run on CPU with the device's free memory injected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.settings import load_settings
from services.engine.core.engine import LLMEngine
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.executor import kv_sizing
from services.engine.executor.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from tests.engine.fakes import FakeRunner

GiB = 1 << 30
MiB = 1 << 20


def test_block_bytes_of_a_llama_7b_block() -> None:
    # 32 layers, 32 KV heads of 128, bf16: 8 MiB per block of 16 tokens (512 KiB per token).
    assert kv_sizing.block_bytes(32, 16, 32, 128, 2) == 8 * MiB


def test_blocks_from_free_memory_takes_the_fraction_of_free_plus_released() -> None:
    # 10 GiB free after the warm-up, the 0.5 GiB provisional pool released: 0.8 × 10.5 GiB = 8601.6 MiB.
    assert kv_sizing.blocks_from_free_memory(10 * GiB, GiB // 2, 0.8, MiB) == 8601
    assert kv_sizing.blocks_from_free_memory(80 * GiB, 0, 0.9, 8 * MiB) == 9216
    assert kv_sizing.blocks_from_free_memory(MiB, 0, 1.0, MiB) == 1


def test_useful_blocks_is_every_request_at_the_full_context() -> None:
    assert kv_sizing.useful_blocks(256, 32768, 16) == 256 * 2048
    assert kv_sizing.useful_blocks(4, 500, 16) == 4 * 32  # a partial last block counts


@pytest.mark.parametrize(("free", "fraction"), [(MiB - 1, 1.0), (10 * GiB, 0.0), (10 * GiB, 1.5)])
def test_blocks_from_free_memory_refuses_too_little_or_a_bad_fraction(free: int, fraction: float) -> None:
    with pytest.raises(ValueError):
        kv_sizing.blocks_from_free_memory(free, 0, fraction, MiB)


def test_sizes_are_automatic_only_when_none_is_given() -> None:
    auto = EngineSettings()
    assert kv_sizing.sized_automatically(auto)
    assert kv_sizing.initial_kv_cache_gb(auto) == kv_sizing.DEFAULT_KV_CACHE_GB
    explicit = EngineSettings(kv_cache_gb=2.0)
    assert not kv_sizing.sized_automatically(explicit)
    assert kv_sizing.initial_kv_cache_gb(explicit) == 2.0
    assert not kv_sizing.sized_automatically(EngineSettings(num_kv_blocks=64))
    for bad in ({"kv_cache_gb": -1.0}, {"gpu_memory_utilization": 0.0}):
        with pytest.raises(ValueError):
            EngineSettings(**bad)


@pytest.fixture(scope="module")
def runner_factory(llama_dir: Path):
    def make(**kwargs: object) -> ModelRunner:
        return ModelRunner(EngineSettings(model=str(llama_dir), device="cpu", **kwargs))  # type: ignore[arg-type]

    return make


class FakeDevice:
    """Free memory as a device would report it; records that the warm-up forward ran first."""

    def __init__(self, runner: ModelRunner, free_bytes: int) -> None:
        self.runner = runner
        self.free_bytes = free_bytes
        self.forwards_before = -1
        self.calls = 0
        original = runner.execute

        def counting(scheduled):  # type: ignore[no-untyped-def]
            self.calls += 1
            return original(scheduled)

        runner.execute = counting  # type: ignore[method-assign]

    def __call__(self, device: torch.device) -> tuple[int, int]:
        self.forwards_before = self.calls
        return self.free_bytes, 2 * self.free_bytes


def _prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    request = Request("r", prompt, SamplingParams(), StoppingParams(max_new_tokens=1))
    request.block_ids = list(range(-(-len(prompt) // runner.block_size)))
    logits, _ = runner.execute([(request, len(prompt))])
    return logits


def test_fit_kv_pool_warms_up_then_sizes_the_pool_from_free_memory(runner_factory) -> None:
    # max_num_seqs high enough that the pool is bounded by memory, not by what requests can fill.
    settings = EngineSettings(max_num_batched_tokens=256, gpu_memory_utilization=0.5, max_num_seqs=4096)
    runner = runner_factory(kv_cache_gb=kv_sizing.initial_kv_cache_gb(settings))
    per_block = kv_sizing.block_bytes(
        runner.num_layers, runner.block_size, runner.num_kv_heads, runner.head_dim, 4
    )
    provisional = runner.num_blocks
    device = FakeDevice(runner, free_bytes=64 * MiB)
    blocks = kv_sizing.fit_kv_pool(runner, settings, mem_get_info=device)
    assert device.forwards_before == 1  # free memory read after one warm-up forward
    assert blocks == int((64 * MiB + provisional * per_block) * 0.5) // per_block == runner.num_blocks
    assert blocks != provisional
    for k, v in runner.kv:
        slots = (blocks + 1) * runner.block_size  # + the scratch block
        assert k.shape == v.shape == (slots, runner.num_kv_heads, runner.head_dim)
    # The new pool computes what a runner built with that many blocks computes.
    prompt = [5, 9, 13, 17, 21, 40, 41, 42, 7, 3, 99, 100, 101, 102, 103, 104, 105, 6]
    reference = runner_factory(num_kv_blocks=blocks)
    torch.testing.assert_close(_prefill_logits(runner, prompt), _prefill_logits(reference, prompt))


def test_the_warm_up_reserves_the_largest_prompt_logprobs_step(runner_factory, monkeypatch) -> None:
    """The step whose memory the free figure leaves room for includes prompt logprobs at the full step
    budget: a logits row per prompt position but the last, turned into fp32 log-probabilities."""
    settings = EngineSettings(max_num_batched_tokens=256, gpu_memory_utilization=0.5, max_num_seqs=4096)
    runner = runner_factory(kv_cache_gb=kv_sizing.initial_kv_cache_gb(settings))
    computed: list[tuple[int, int]] = []  # (rows, vocabulary) of each prompt-logprobs computation
    real = kv_sizing.Sampler.prompt_logprobs

    def spy(self, logits: torch.Tensor, targets, k: int):  # type: ignore[no-untyped-def]
        computed.append((logits.shape[0], logits.shape[1]))
        return real(self, logits, targets, k)

    monkeypatch.setattr(kv_sizing.Sampler, "prompt_logprobs", spy)
    device = FakeDevice(runner, free_bytes=64 * MiB)
    computed_before_read: list[int] = []

    def mem_get_info(dev: torch.device) -> tuple[int, int]:
        computed_before_read.append(len(computed))
        return device(dev)

    kv_sizing.fit_kv_pool(runner, settings, mem_get_info=mem_get_info)
    assert device.forwards_before == 1 and computed_before_read == [1]
    assert computed == [(255, runner.vocab_size)]
    assert runner.prompt_logits == []  # nothing of the warm-up is kept


def test_fit_kv_pool_takes_no_more_blocks_than_requests_can_fill(runner_factory) -> None:
    # The test model's context is 512 tokens: 4 requests fill at most 4 x 32 blocks of 16, however much
    # memory is free (a small model on a large GPU).
    settings = EngineSettings(max_num_batched_tokens=64, max_num_seqs=4)
    runner = runner_factory(kv_cache_gb=kv_sizing.initial_kv_cache_gb(settings))
    assert runner.max_position_embeddings == 512
    assert kv_sizing.fit_kv_pool(runner, settings, mem_get_info=FakeDevice(runner, 100 * GiB)) == 128
    assert runner.num_blocks == 128 and runner.kv[0][0].shape[0] == (128 + 1) * runner.block_size
    shorter = EngineSettings(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=100)
    runner = runner_factory(kv_cache_gb=kv_sizing.initial_kv_cache_gb(shorter))
    assert kv_sizing.fit_kv_pool(runner, shorter, mem_get_info=FakeDevice(runner, 100 * GiB)) == 4 * 7


def test_fit_kv_pool_keeps_an_explicit_size_and_the_cpu_default(runner_factory) -> None:
    explicit = EngineSettings(kv_cache_gb=0.01)
    runner = runner_factory(kv_cache_gb=0.01)
    device = FakeDevice(runner, free_bytes=64 * MiB)
    assert kv_sizing.fit_kv_pool(runner, explicit, mem_get_info=device) == runner.num_blocks
    assert device.calls == 0  # no warm-up either
    on_cpu = runner_factory(kv_cache_gb=kv_sizing.initial_kv_cache_gb(EngineSettings()))
    blocks = on_cpu.num_blocks
    assert kv_sizing.fit_kv_pool(on_cpu, EngineSettings()) == blocks  # CPU, nothing injected: as built


def test_engine_on_cpu_keeps_the_half_gib_pool_by_default(llama_dir: Path) -> None:
    engine = LLMEngine(EngineSettings(model=str(llama_dir), device="cpu"))
    runner = engine.runner
    per_block = kv_sizing.block_bytes(
        runner.num_layers, runner.block_size, runner.num_kv_heads, runner.head_dim, 4
    )
    assert runner.num_blocks == int(kv_sizing.DEFAULT_KV_CACHE_GB * GiB) // per_block


# ---- the context length against the pool (engine.context_length) ------------------------------------


def _fake_engine(num_blocks: int, model_len: int, **settings: object) -> LLMEngine:
    return LLMEngine(EngineSettings(**settings), runner=FakeRunner(num_blocks, max_len=model_len))  # type: ignore[arg-type]


def test_a_max_model_len_the_pool_cannot_hold_is_refused_with_the_numbers() -> None:
    # 4 blocks of 16 hold 64 tokens; the context length was cut to 64 silently before.
    with pytest.raises(ValueError) as caught:
        _fake_engine(4, 512, max_model_len=100)
    message = str(caught.value)
    assert "context length 100 (max_model_len)" in message
    assert "4 blocks of 16 tokens hold 64 tokens" in message
    assert "max_position_embeddings" not in message


def test_the_models_own_context_length_the_pool_cannot_hold_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError) as caught:
        _fake_engine(8, 512, block_size=8)
    message = str(caught.value)
    assert "context length 512 (the model's max_position_embeddings)" in message
    assert "8 blocks of 8 tokens hold 64 tokens" in message


def test_a_real_model_whose_context_the_pool_cannot_hold_does_not_start(llama_dir: Path) -> None:
    # The test model's context is 512 tokens; 8 blocks of 16 hold 128.
    with pytest.raises(ValueError, match=r"context length 512 \(the model's max_position_embeddings\)"):
        LLMEngine(EngineSettings(model=str(llama_dir), device="cpu", num_kv_blocks=8))


@pytest.mark.parametrize(
    ("num_blocks", "model_len", "max_model_len", "expected"),
    [
        (4, 512, 64, 64),  # max_model_len exactly the pool, shorter than the model's
        (4, 512, 50, 50),
        (32, 512, 0, 512),  # the model's own context, exactly the pool
        (40, 512, 0, 512),
        (4, 0, 0, 64),  # no context length of its own: what the pool holds
    ],
)
def test_a_context_length_that_fits_starts(
    num_blocks: int, model_len: int, max_model_len: int, expected: int
) -> None:
    engine = _fake_engine(num_blocks, model_len, max_model_len=max_model_len)
    assert engine.max_model_len == expected
    assert engine.scheduler.max_model_len == expected


def test_gpu_memory_utilization_defaults_to_0_9() -> None:
    assert EngineSettings().gpu_memory_utilization == 0.9
    assert load_settings(EngineSettings, [], environ={}).gpu_memory_utilization == 0.9


def test_a_hybrid_models_budget_buys_more_full_blocks(family_model_dir) -> None:
    """Gemma 2 (a sliding layer, window 8, beside a full one): a 1 MiB budget gives the sliding layer
    only `window_blocks` (4 requests × 3 + 32 / 8 = 16 blocks of 8 tokens) and the full layer the rest,
    each layer's tensors sized by its group, the whole within the budget and the largest that fits."""
    settings = EngineSettings(
        model=str(family_model_dir("gemma2")), device="cpu", dtype="float32", kv_cache_gb=1 / 1024,
        block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
    )  # fmt: skip
    runner = ModelRunner(settings)
    layout = runner.kv_layout
    layer_block = kv_sizing.block_bytes(1, 8, runner.num_kv_heads, runner.head_dim, 4)
    assert layout.layer_block_bytes == layer_block
    full, sliding = runner.kv_groups
    assert (full.window, full.layers, sliding.window, sliding.layers) == (0, (1,), 8, (0,))
    assert sliding.num_blocks == kv_sizing.window_blocks(8, 8, 4, 32) == 16
    assert full.num_blocks == runner.num_blocks == (MiB - 16 * layer_block) // layer_block
    assert layout.pool_bytes(runner.num_blocks) <= MiB < layout.pool_bytes(runner.num_blocks + 1)
    uniform = MiB // (2 * layer_block)  # what every layer at full size would have bought
    assert runner.num_blocks == 2 * uniform - 16  # nearly twice the full-attention blocks
    for layer, group in ((0, sliding), (1, full)):
        k, v = runner.kv[layer]
        assert k.shape == v.shape == ((group.num_blocks + 1) * 8, runner.num_kv_heads, runner.head_dim)
