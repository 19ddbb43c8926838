"""The float8 KV pool (kv_cache_dtype fp8): its dtype and size, the blocks it fits, the clamped writes,
the attention read back from it (torch path and the Triton kernel, under TRITON_INTERPRET=1 on CPU) and
an engine that runs on it.

Accuracy: e4m3 keeps 3 bits of mantissa, so each stored K/V element is within 2^-4 of its value (relative)
and attention over K/V of unit scale comes out within a few hundredths of the full-precision pool's:
measured on CPU, max |fp8 - fp32| = 0.034 over outputs whose largest |value| is about 1.5. Bound: 0.1 ×
the largest |output| of the row set, which a pool that lost its sign bits or scale (a uint8 copy of the
values, a scale of 2) exceeds by far.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.engine.core.engine import LLMEngine
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.executor import kv_sizing
from services.engine.executor.attention import paged_attention, write_kv
from services.engine.executor.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    triton_usable,
)
from services.engine.executor.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE, VOCAB
from tests.engine.test_paged_kernel import Case, make_case, torch_decode_meta

DEV = torch.device(TEST_DEVICE)
FP8 = torch.float8_e4m3fn
MiB = 1 << 20
REL_BOUND = 0.1  # see the module docstring


def runner(model_dir: Path, **kw: object) -> ModelRunner:
    settings = EngineSettings(model=str(model_dir), device=TEST_DEVICE, attention_backend="torch", **kw)  # type: ignore[arg-type]
    return ModelRunner(settings)


def test_the_pool_is_float8_of_one_byte_per_element(llama_dir: Path) -> None:
    r = runner(llama_dir, dtype="float32", num_kv_blocks=8, kv_cache_dtype="fp8")
    assert r.kv_dtype == FP8 and r.dtype == torch.float32
    assert len(r.kv) == r.num_layers
    slots = (8 + 1) * r.block_size  # the scratch block too
    for k, v in r.kv:
        assert k.dtype == FP8 and v.dtype == FP8
        assert tuple(k.shape) == (slots, r.num_kv_heads, r.head_dim)
    pool_bytes = sum(t.numel() * t.element_size() for kv in r.kv for t in kv)
    assert pool_bytes == 9 * kv_sizing.block_bytes(r.num_layers, r.block_size, r.num_kv_heads, r.head_dim, 1)


def test_fp8_fits_twice_the_blocks_of_bf16_and_four_times_fp32(llama_dir: Path) -> None:
    budget_gb = 3 * MiB / (1 << 30)
    blocks = {
        (dtype, kv): runner(llama_dir, dtype=dtype, kv_cache_gb=budget_gb, kv_cache_dtype=kv).num_blocks
        for dtype, kv in [("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto"), ("float32", "fp8")]
    }
    assert blocks[("bfloat16", "fp8")] == 2 * blocks[("bfloat16", "auto")]
    assert blocks[("float32", "fp8")] == 4 * blocks[("float32", "auto")]
    assert blocks[("float32", "fp8")] == blocks[("bfloat16", "fp8")]


def test_sizing_from_free_memory_counts_one_byte_per_element(llama_dir: Path) -> None:
    """Free memory after the warm-up, plus the provisional pool of 4 blocks it releases, over the bytes of
    a block: one byte per element with fp8, two with bf16."""
    settings = EngineSettings(model=str(llama_dir), max_num_seqs=64, max_num_batched_tokens=32)
    for kv, element in (("auto", 2), ("fp8", 1)):
        r = runner(llama_dir, dtype="bfloat16", num_kv_blocks=4, kv_cache_dtype=kv)
        per_block = kv_sizing.block_bytes(r.num_layers, r.block_size, r.num_kv_heads, r.head_dim, element)
        want = int((2 * MiB + 4 * per_block) * settings.gpu_memory_utilization) // per_block
        got = kv_sizing.fit_kv_pool(r, settings, mem_get_info=lambda _d: (2 * MiB, 8 * MiB))
        assert got == r.num_blocks == want
        assert r.kv[0][0].dtype == r.kv_dtype


def test_writes_clamp_to_the_format_range_instead_of_nan() -> None:
    """CUDA's float8 conversion gives NaN out of range (the CPU's saturates): a K of 1e4 must be 448."""
    pool = torch.zeros((8, 1, 4), dtype=FP8, device=DEV)
    values = torch.tensor([[[1e4, -1e4, 3.0, 0.5]], [[500.0, -449.0, -2.0, float("inf")]]], device=DEV)
    write_kv(pool, torch.tensor([2, 5], device=DEV), values)
    got = pool.float().cpu()
    assert not got.isnan().any()
    assert got[2, 0].tolist() == [448.0, -448.0, 3.0, 0.5]
    assert got[5, 0].tolist() == [448.0, -448.0, -2.0, 448.0]
    assert (got[[0, 1, 3, 4, 6, 7]] == 0).all(), "only the given slots are written"


def fp8_case(c: Case) -> Case:
    """`c` with its pools written into float8 pools through the engine's write."""
    pools = []
    for pool in (c.k_pool, c.v_pool):
        fp8 = torch.zeros(pool.shape, dtype=FP8, device=DEV)
        write_kv(fp8, torch.arange(pool.shape[0], device=DEV), pool)
        pools.append(fp8)
    return dataclasses.replace(c, k_pool=pools[0], v_pool=pools[1])


def decode_through_torch_path(c: Case, key_source: Case, window: int) -> torch.Tensor:
    """The engine's torch decode path (gather + SDPA) through `paged_attention`; the step's own K/V (the
    last token of each row, taken from `key_source`'s full-precision pool) are written into `c`'s pool."""
    meta = torch_decode_meta(c)
    last = meta.slot_mapping
    key = key_source.k_pool.index_select(0, last).transpose(0, 1)[None]
    value = key_source.v_pool.index_select(0, last).transpose(0, 1)[None]
    query = c.query.transpose(0, 1)[None]
    out, _ = paged_attention(
        SimpleNamespace(layer_idx=0), query, key, value, None, scaling=c.scale, sliding_window=window,
        sluice_step=meta,
    )  # fmt: skip
    return out[0]


@pytest.mark.parametrize("window", [0, 11])
def test_attention_over_an_fp8_pool_is_close_to_the_full_precision_pools(window: int) -> None:
    full = make_case(8, 2, 80, 8, [19, 8, 1, 70], torch.float32, nan_free=True)
    quant = fp8_case(full)
    want = decode_through_torch_path(full, full, window)
    got = decode_through_torch_path(quant, full, window)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    error = (got - want).abs().max().item()
    assert error < REL_BOUND * want.abs().max().item(), error
    assert error > 0, "the pool must hold float8 values, not the full-precision ones"
    # The reference on the same fp8 pool reads the same values: equal up to summation order.
    same = paged_decode_attention_reference(*quant.args(), quant.scale, window)
    torch.testing.assert_close(got, same, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not triton_usable(DEV), reason="the triton kernel does not run on this device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_triton_kernel_reads_an_fp8_pool(dtype: torch.dtype) -> None:
    full = make_case(8, 2, 24, 16, [35, 16, 1, 0, 70], dtype, nan_free=True)
    quant = fp8_case(full)
    got = paged_decode_attention(*quant.args(), quant.scale, 5)
    want = paged_decode_attention_reference(*quant.args(), quant.scale, 5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    exact = paged_decode_attention_reference(*full.args(), full.scale, 5).float()
    assert (got.float() - exact).abs().max().item() < REL_BOUND * exact.abs().max().item()
    assert (got[full.seq_lens == 0] == 0).all()


def test_an_engine_on_an_fp8_pool_runs_greedy_end_to_end(llama_dir: Path) -> None:
    """Chunked prefills, prefix hits and decodes read the fp8 pool. The first token of each request comes
    from a prefill without cached context (its own K/V at full precision), so it equals the fp32
    pool's; later tokens may differ where the untrained model's logits nearly tie."""
    prompts = {f"r{i}": [3 + (11 * i + 5 * j) % (VOCAB - 3) for j in range(4 + 23 * i)] for i in range(5)}
    prompts["shared"] = [*prompts["r4"][:40], 7, 8, 9]  # a prefix hit on r4's blocks
    outputs = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(
            EngineSettings(
                model=str(llama_dir),
                device=TEST_DEVICE,
                dtype="float32",
                kv_cache_dtype=kv,
                attention_backend="torch",
                num_kv_blocks=32,
                max_num_seqs=8,
                max_num_batched_tokens=32,
                max_model_len=256,
            )
        )
        assert engine.runner.kv[0][0].dtype == (FP8 if kv == "fp8" else torch.float32)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        for rid, prompt in prompts.items():
            stop = StoppingParams(max_new_tokens=8, ignore_eos=True)
            engine.add_request(rid, prompt, SamplingParams(), stop)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        assert all(len(t) == 8 for t in tokens.values())
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        outputs[kv] = tokens
    fresh = [rid for rid in prompts if rid != "shared"]
    assert [outputs["fp8"][r][0] for r in fresh] == [outputs["auto"][r][0] for r in fresh]
