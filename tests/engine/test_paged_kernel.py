"""The paged decode attention kernel against its torch reference, and the reference against the engine's
torch decode path (gather per DecodeGroup + SDPA). On CPU the kernel runs under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); scripts/gpu_check.sh runs the same tests compiled on CUDA.

Tolerances: fp32 within 1e-5 (both accumulate in fp32); bf16 within 2e-2 absolute and relative (the same
fp32 math on bf16 inputs, rounded once to bf16 at the end: about one bf16 ulp apart at most).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from services.engine.executor.attention import DecodeGroup, PrefillSeq, StepMeta, paged_attention
from services.engine.executor.kernels.paged_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    triton_usable,
)
from tests.engine.conftest import TEST_DEVICE

DEV = torch.device(TEST_DEVICE)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PAD_BLOCK = 2**30  # a block id far outside the pool: reading it would fault or produce garbage


@dataclass
class Case:
    query: torch.Tensor  # (B, H, D)
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32
    seq_lens: torch.Tensor  # (B,) int32
    block_size: int
    blocks: list[list[int]]  # each row's blocks, in order

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def args(self) -> tuple[object, ...]:
        return (self.query, self.k_pool, self.v_pool, self.block_tables, self.seq_lens, self.block_size)


def make_case(
    h: int, hkv: int, d: int, block_size: int, lens: list[int], dtype: torch.dtype, nan_free: bool = False
) -> Case:
    """Rows of `lens` tokens whose blocks are scattered over the pool in shuffled order. Slots outside
    every row's context hold NaN (unless `nan_free`), table entries past a row's blocks are out of range,
    and a padding row's (length 0) whole table is PAD_BLOCK: reading any of them shows in the output."""
    gen = torch.Generator().manual_seed(len(lens) * 1000 + h * 100 + d + block_size)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) + 1
    table = torch.full((len(lens), max_blocks), num_blocks + 7, dtype=torch.int32)
    blocks: list[list[int]] = []
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, n in enumerate(lens):
        mine, order = order[: need[i]], order[need[i] :]
        blocks.append(mine)
        if n == 0:
            table[i] = PAD_BLOCK
        for j, b in enumerate(mine):
            table[i, j] = b
            count = min(block_size, n - j * block_size)
            used[b * block_size : b * block_size + count] = True
    k = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    v = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    if not nan_free:
        k[~used] = float("nan")
        v[~used] = float("nan")
    q = torch.randn(len(lens), h, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return Case(
        q.to(DEV, dtype),
        k.to(DEV, dtype),
        v.to(DEV, dtype),
        table.to(DEV),
        seq_lens.to(DEV),
        block_size,
        blocks,
    )


def lens_for(block_size: int) -> list[int]:
    """Mid-block, exactly on a block edge, one token, a padding row, and one spanning several tiles."""
    return [2 * block_size + 3, block_size, 1, 0, 70]


# (H, Hkv, D, block_size, sliding_window): GQA groups 1, 2 and 4; head_dim 16, 24 and 80.
SHAPES = [
    pytest.param(8, 8, 16, 16, 0, id="g1-d16-bs16"),
    pytest.param(8, 4, 24, 16, 5, id="g2-d24-bs16-window5"),
    pytest.param(8, 2, 80, 8, 0, id="g4-d80-bs8"),
    pytest.param(8, 2, 80, 8, 11, id="g4-d80-bs8-window11"),
]


def test_the_kernel_itself_runs_here() -> None:
    # Without this the kernel falls back to the reference and the comparisons below prove nothing.
    assert triton_usable(DEV)


@pytest.mark.parametrize(("h", "hkv", "d", "bs", "window"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(h: int, hkv: int, d: int, bs: int, window: int, dtype: torch.dtype) -> None:
    c = make_case(h, hkv, d, bs, lens_for(bs), dtype)
    got = paged_decode_attention(*c.args(), c.scale, window)
    want = paged_decode_attention_reference(*c.args(), c.scale, window)
    assert got.dtype == dtype and got.shape == c.query.shape
    assert torch.isfinite(got).all(), "the kernel read a slot outside a row's context"
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    pad = c.seq_lens == 0
    assert (got[pad] == 0).all()


@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs", "window", "splits"), [(8, 4, 24, 16, 0, 3), (8, 2, 80, 8, 11, 4)]
)
def test_split_context_matches_reference(h: int, hkv: int, d: int, bs: int, window: int, splits: int) -> None:
    """Flash-decoding split (several programs per row, combined by a second kernel), as used for small
    batches on a GPU: rows shorter than the split count, a padding row and windows included."""
    c = make_case(h, hkv, d, bs, [*lens_for(bs), 2], torch.float32)
    got = paged_decode_attention(*c.args(), c.scale, window, num_splits=splits)
    want = paged_decode_attention_reference(*c.args(), c.scale, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_count_depends_on_shapes_only() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(1, 2, 4096, cpu) == 1
    if DEV.type == "cuda":
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        assert default_num_splits(sms, 1, 4096, DEV) == 1  # enough programs already
        assert default_num_splits(1, 2, 4096, DEV) == min(16, -(-sms // 2))
        assert default_num_splits(1, 2, 512, DEV) == min(2, -(-sms // 2))  # at least 256 positions each


def torch_decode_meta(c: Case) -> StepMeta:
    """The step metadata of the engine's torch decode path over `c`'s rows (none of length 0): one
    DecodeGroup whose table is padded with block 0, and the last slot of each row as the step's slots."""
    bs = c.block_size
    lens = c.seq_lens.tolist()
    table = torch.zeros(len(lens), max(len(b) for b in c.blocks), dtype=torch.long)
    for i, blocks in enumerate(c.blocks):
        table[i, : len(blocks)] = torch.tensor(blocks)
    last = torch.tensor([c.blocks[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)])
    group = DecodeGroup(0, table.to(DEV), c.seq_lens.to(DEV, torch.long), bs)
    return StepMeta([(c.k_pool, c.v_pool)], last.to(DEV), [group], [])


def torch_decode_path(c: Case, window: int) -> torch.Tensor:
    """The engine's torch decode path (one DecodeGroup, gather + SDPA) through `paged_attention`, for
    rows of non-zero length; the step's own K/V are those already in the pool (the write is a no-op)."""
    meta = torch_decode_meta(c)
    last = meta.slot_mapping
    query = c.query.transpose(0, 1)[None]  # (1, H, B, D)
    key = c.k_pool[last].transpose(0, 1)[None]
    value = c.v_pool[last].transpose(0, 1)[None]
    layer = SimpleNamespace(layer_idx=0)
    out, _ = paged_attention(
        layer, query, key, value, None, scaling=c.scale, sliding_window=window, sluice_step=meta
    )
    return out[0]  # (B, H, D)


@pytest.mark.parametrize(("h", "hkv", "d", "bs", "window"), SHAPES)
def test_reference_matches_the_torch_decode_path(h: int, hkv: int, d: int, bs: int, window: int) -> None:
    lens = [n for n in lens_for(bs) if n]  # the torch path has no padding rows
    c = make_case(h, hkv, d, bs, lens, torch.float32, nan_free=True)
    want = torch_decode_path(c, window)
    got = paged_decode_attention_reference(*c.args(), c.scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_matches_the_torch_decode_path_bf16() -> None:
    c = make_case(8, 2, 80, 8, [19, 8, 1, 70], torch.bfloat16, nan_free=True)
    torch.testing.assert_close(
        paged_decode_attention_reference(*c.args(), c.scale, 11),
        torch_decode_path(c, 11),
        atol=3e-2,
        rtol=3e-2,
    )


def test_a_wrong_block_table_changes_only_that_row() -> None:
    c = make_case(8, 2, 24, 16, [40, 33], torch.float32, nan_free=True)
    right = paged_decode_attention(*c.args(), c.scale)
    # Blocks 0 and 2 swapped: the partly filled last block now stands for a full one (a mere permutation
    # of full blocks would attend to the same set of keys).
    c.block_tables[0, [0, 2]] = c.block_tables[0, [2, 0]].clone()
    wrong = paged_decode_attention(*c.args(), c.scale)
    assert (wrong[0] - right[0]).abs().max() > 1e-2
    torch.testing.assert_close(wrong[1], right[1], atol=0, rtol=0)


def test_writes_into_out_from_a_strided_query() -> None:
    """As attention.py calls it: the query rows are a view of the packed (H, T, D) query, and the result
    goes straight into the head rows of the packed output."""
    c = make_case(8, 2, 24, 16, [35, 0, 16], torch.float32)
    packed = torch.randn(8, 5, 24, device=DEV)  # (H, T, D): three decode rows, then two prefill rows
    packed[:, :3] = c.query.transpose(0, 1)
    packed_out = torch.full((5, 8, 24), 7.0, device=DEV)
    q = packed[:, :3].transpose(0, 1)
    assert not q.is_contiguous()
    got = paged_decode_attention(q, *c.args()[1:], c.scale, out=packed_out[:3])
    assert got.data_ptr() == packed_out.data_ptr()
    want = paged_decode_attention_reference(*c.args(), c.scale)
    torch.testing.assert_close(packed_out[:3], want, atol=1e-5, rtol=1e-5)
    assert (packed_out[3:] == 7.0).all()


@pytest.mark.parametrize(("q_len", "ctx"), [(5, 11), (1, 30), (16, 16)])
def test_lower_right_causal_bias_equals_the_materialised_mask(q_len: int, ctx: int) -> None:
    """A prefill chunk over a cached context: SDPA with causal_lower_right (no mask tensor, so flash and
    memory-efficient kernels can run on CUDA) equals the boolean mask the engine used to build."""
    gen = torch.Generator().manual_seed(q_len + ctx)
    kv_len = ctx + q_len
    q = torch.randn(1, 8, q_len, 32, generator=gen).to(DEV)
    k = torch.randn(1, 2, kv_len, 32, generator=gen).to(DEV)
    v = torch.randn(1, 2, kv_len, 32, generator=gen).to(DEV)
    mask = PrefillSeq(q_start=0, q_len=q_len, ctx_start=ctx, ctx_slots=None).mask(0, DEV)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q_len, kv_len), enable_gqa=True
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The other alignment is a different mask: the comparison can fail.
    other = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_upper_left(q_len, kv_len), enable_gqa=True
    )
    assert (other - want).abs().max() > 1e-3


def plain_attention(c: Case, window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """One row and head at a time, straight from the definitions: scores scaled, soft-capped, the
    window's keys only, and exp(sink) in the denominator."""
    bs = c.block_size
    b, h, d = c.query.shape
    hkv = c.k_pool.shape[1]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for row, n in enumerate(c.seq_lens.tolist()):
        if n == 0:
            continue
        pos = list(range(max(0, n - window) if window else 0, n))
        slots = [c.blocks[row][p // bs] * bs + p % bs for p in pos]
        for head in range(h):
            kvh = head // (h // hkv)
            k = c.k_pool[slots, kvh].double().cpu()
            v = c.v_pool[slots, kvh].double().cpu()
            s = k @ c.query[row, head].double().cpu() * c.scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            w = torch.exp(s - s.max())
            den = w.sum()
            if sinks is not None:
                den = den + torch.exp(sinks[head].double().cpu() - s.max())
            out[row, head] = (w[:, None] * v).sum(0) / den
    return out


# (window, softcap, sinks, splits): each feature alone, then together, in one program and split.
FEATURES = [
    pytest.param(0, 0.7, False, 1, id="softcap"),
    pytest.param(0, 0.0, True, 1, id="sinks"),
    pytest.param(5, 0.7, True, 1, id="window-softcap-sinks"),
    pytest.param(5, 0.7, True, 3, id="window-softcap-sinks-split3"),
    pytest.param(0, 0.0, True, 4, id="sinks-split4"),
]


def _sinks(h: int, on: bool) -> torch.Tensor | None:
    return torch.linspace(-2.0, 3.0, h).to(DEV) if on else None


@pytest.mark.parametrize(("window", "softcap", "sinks_on", "splits"), FEATURES)
def test_softcap_sinks_and_windows_match_plain_attention(
    window: int, softcap: float, sinks_on: bool, splits: int
) -> None:
    c = make_case(8, 2, 24, 8, [*lens_for(8), 2], torch.float32)
    sinks = _sinks(8, sinks_on)
    kw = dict(softcap=softcap, sinks=sinks)
    got = paged_decode_attention(*c.args(), c.scale, window, num_splits=splits, **kw)
    ref = paged_decode_attention_reference(*c.args(), c.scale, window, **kw)
    want = plain_attention(c, window, softcap, sinks)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(ref.double().cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    assert (got[c.seq_lens == 0] == 0).all()
    # The features change the result: the comparison can fail.
    plain = paged_decode_attention_reference(*c.args(), c.scale, window)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("window", "softcap", "sinks_on"), [(0, 0.7, False), (5, 0.7, True), (11, 0.0, True)]
)
def test_torch_decode_path_honours_softcap_and_sinks(window: int, softcap: float, sinks_on: bool) -> None:
    lens = [n for n in lens_for(8) if n]
    c = make_case(8, 2, 24, 8, lens, torch.float32, nan_free=True)
    sinks = _sinks(8, sinks_on)
    meta = torch_decode_meta(c)
    last = meta.slot_mapping
    layer = SimpleNamespace(layer_idx=0)
    out, _ = paged_attention(
        layer,
        c.query.transpose(0, 1)[None],
        c.k_pool[last].transpose(0, 1)[None],
        c.v_pool[last].transpose(0, 1)[None],
        None,
        scaling=c.scale,
        sliding_window=window,
        softcap=softcap,
        s_aux=sinks,
        sluice_step=meta,
    )
    torch.testing.assert_close(
        out[0].double().cpu(), plain_attention(c, window, softcap, sinks), atol=1e-5, rtol=1e-5
    )
