"""Paged decode attention on CUDA (Triton): one new query token per row against that row's cached K/V,
read in place from the KV pool through the row's block table (slot = `block_tables[row, pos //
block_size] * block_size + pos % block_size`), no gather. One program per (row, KV head) over the G query
heads sharing it, an online softmax in fp32 with the scale, soft-cap (softcap * tanh(s / softcap)) and
sinks (exp(sink) in the denominator, nothing in the output); small batches also split each context over
programs whose partial results a second kernel combines. Grid, tiles, split counts and loop bounds depend
only on shapes and device-side values: a call never reads the device from the host and can be captured
in a CUDA graph. `paged_decode_attention_reference` computes the same in plain torch (tests, and the
fallback where Triton cannot run). Narrative: docs/architecture.md ("Engine internals", Attention).
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional on CPU-only installs; `triton_usable` reports whether it can run.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

# Upper bound on the elements of the (G, tile, D) product a program holds at once (registers on a GPU).
_TILE_ELEMENTS = 8192


def triton_usable(device: torch.device) -> bool:
    """True when the kernel can run on tensors of `device`: CUDA with Triton importable, or any device
    under Triton's interpreter (TRITON_INTERPRET=1, read when this module was imported)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        lens_ptr,
        out_ptr,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_btb,
        stride_btn,
        stride_ob,
        stride_oh,
        stride_od,
        part_ml_ptr,
        part_acc_ptr,
        scale,
        block_size,
        sliding_window,
        softcap,
        sinks_ptr,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        DIM_PAD: tl.constexpr,
        TILE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + row)
        start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
        # This program's share of the visible positions [start, seq_len): [lo, hi), whole tiles each.
        chunk = tl.cdiv(tl.cdiv(seq_len - start, NUM_SPLITS), TILE) * TILE
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, seq_len)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, TILE)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        q = q * scale

        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        if SINKS and NUM_SPLITS == 1:  # split partials leave the sink to the combining kernel
            m_i = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
            l_i = tl.full((GROUP_PAD,), 1.0, tl.float32)  # exp(sink - m_i)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
        # Every tile in [lo, hi) starts at a visible position, so the running max stays finite once a
        # tile ran; a padding row (seq_len 0) runs no tile and reads nothing, not even its block table.
        for tile_start in range(lo, hi, TILE):
            pos = tile_start + t
            seen = pos < hi
            block = tl.load(bt_ptr + row * stride_btb + (pos // block_size) * stride_btn, mask=seen, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
            kv_mask = seen[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (GROUP_PAD, TILE)
            if SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (the interpreter has no tanh)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(
                v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
                out.to(out_ptr.dtype.element_ty),
                mask=g_ok[:, None] & d_ok[None, :],
            )
        else:
            # Partial results, unnormalised, for _combine_splits_kernel: (B, H, splits, 2) max and sum,
            # (B, H, splits, DIM_PAD) weighted values.
            part = (row * NUM_HEADS + heads) * NUM_SPLITS + split  # (GROUP_PAD,)
            tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
            tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _combine_splits_kernel(
        part_ml_ptr,
        part_acc_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        stride_od,
        sinks_ptr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM_PAD)
        sp_ok = sp < NUM_SPLITS
        part = (row * NUM_HEADS + head) * NUM_SPLITS + sp
        m = tl.load(part_ml_ptr + part * 2, mask=sp_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=sp_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        if SINKS:  # the sink: one more term of the denominator, nothing in the numerator
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            m_max = tl.maximum(m_max, sink)
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # a padding row: every split empty
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # an empty split weighs 0
        num = tl.sum(w[:, None] * acc, axis=0)
        den = tl.sum(w * l_s, axis=0)
        if SINKS:
            den += tl.exp(sink - m_max)
        out = num / tl.where(den > 0, den, 1.0)
        tl.store(
            out_ptr + row * stride_ob + head * stride_oh + d * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_shapes(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int, int]:
    """(B, H, Hkv, D) after checking that the arguments agree; raises ValueError otherwise."""
    if query.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"query must be (B, H, D) and the pools (slots, Hkv, D): {tuple(query.shape)}, "
            f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    b, h, d = query.shape
    hkv = k_pool.shape[1]
    if k_pool.shape[2] != d or h % hkv:
        raise ValueError(f"query heads {h} x dim {d} do not fit KV heads {hkv} x dim {k_pool.shape[2]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or tuple(seq_lens.shape) != (b,):
        raise ValueError(
            f"block_tables must be (B, max_blocks) and seq_lens (B,) for B={b}: "
            f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}"
        )
    return b, h, hkv, d


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """How many programs share one row's context (flash-decoding style): 1 when the (row, KV head)
    programs already fill the GPU's multiprocessors, else enough to fill them, at most 16 and with at
    least 256 positions of the block table's capacity each. From shapes only, so a captured graph
    keeps its split."""
    if device.type != "cuda":
        return 1
    programs = batch * kv_heads
    sms = _sm_count(device)
    if programs >= sms:
        return 1
    return max(1, min(16, -(-sms // programs), max_len // 256))


def paged_decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per row over its cached context, read through the block table.

    query (B, H, D) after RoPE; k_pool / v_pool (num_slots, Hkv, D) with slot = block * block_size +
    offset, in the query's dtype or float8 e4m3 (loaded and converted to fp32, scale 1.0);
    block_tables (B, max_blocks) int32 (entries past a row's blocks are ignored); seq_lens (B,)
    int32, the context length including the new token, whose K/V must already be in the pool (0 = a
    padding row: its output is zeros and nothing of it is read); sliding_window 0 = none, else a row
    sees the keys at positions > pos - window; softcap 0 = none, else scores (after scaling) become
    softcap * tanh(scores / softcap); sinks None = none, else (H,) logits, one per query head, each adding
    exp(sink) to its softmax's denominator (a padding row's output stays zeros). Query head h uses KV
    head h // (H / Hkv). Returns (B, H,
    D) in the query's dtype, written into `out` when given. Accumulates in fp32. Never synchronises
    with the device, so it can be captured in a CUDA graph.

    Each row's visible context is split over `num_splits` programs per (row, KV head), whose partial
    softmax results a second kernel combines (1: one kernel, no partials; None: `default_num_splits`).
    The result does not depend on `num_splits` beyond rounding.
    """
    if num_splits is None:
        num_splits = default_num_splits(
            query.shape[0], k_pool.shape[1], block_tables.shape[1] * block_size, query.device
        )
    b, h, hkv, d = _check_shapes(query, k_pool, v_pool, block_tables, seq_lens)
    if out is None:
        out = torch.empty((b, h, d), dtype=query.dtype, device=query.device)
    elif tuple(out.shape) != (b, h, d):
        raise ValueError(f"out must be {(b, h, d)}, got {tuple(out.shape)}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if b == 0:
        return out
    if not triton_usable(query.device):
        out.copy_(
            paged_decode_attention_reference(
                query,
                k_pool,
                v_pool,
                block_tables,
                seq_lens,
                block_size,
                scale,
                sliding_window,
                softcap=softcap,
                sinks=sinks,
            )
        )
        return out
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must be ({h},), one per query head, got {tuple(sinks.shape)}")
    group = h // hkv
    group_pad = _next_pow2(group)
    dim_pad = max(16, _next_pow2(d))
    tile = 64
    while tile > 16 and group_pad * dim_pad * tile > _TILE_ELEMENTS:
        tile //= 2
    if num_splits > 1:
        part_ml = torch.empty((b, h, num_splits, 2), dtype=torch.float32, device=query.device)
        part_acc = torch.empty((b, h, num_splits, dim_pad), dtype=torch.float32, device=query.device)
    else:
        part_ml = part_acc = out  # unused
    _paged_decode_kernel[(b, hkv, num_splits)](
        query,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        out,
        *query.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *block_tables.stride(),
        *out.stride(),
        part_ml,
        part_acc,
        float(scale),
        int(block_size),
        int(sliding_window),
        float(softcap or 1.0),
        sinks if sinks is not None else out,  # unused without sinks
        NUM_HEADS=h,
        GROUP=group,
        HEAD_DIM=d,
        GROUP_PAD=group_pad,
        DIM_PAD=dim_pad,
        TILE=tile,
        NUM_SPLITS=num_splits,
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        num_warps=4,
    )
    if num_splits > 1:
        _combine_splits_kernel[(b, h)](
            part_ml,
            part_acc,
            out,
            *out.stride(),
            sinks if sinks is not None else out,
            NUM_HEADS=h,
            HEAD_DIM=d,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=_next_pow2(num_splits),
            SINKS=sinks is not None,
            num_warps=4,
        )
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` in plain torch (fp32 math, same arguments and result). It gathers every
    row's whole block table (clamped into the pool) and masks, so it is for tests, not for speed."""
    b, h, hkv, d = _check_shapes(query, k_pool, v_pool, block_tables, seq_lens)
    num_slots = k_pool.shape[0]
    max_len = block_tables.shape[1] * block_size
    pos = torch.arange(max_len, device=query.device)
    lens = seq_lens.to(torch.long)[:, None]
    seen = pos[None, :] < lens  # (B, L)
    if sliding_window:
        seen &= pos[None, :] >= lens - sliding_window
    blocks = block_tables.to(torch.long)[:, pos // block_size]  # (B, L)
    slots = (blocks * block_size + pos % block_size).clamp(0, num_slots - 1)
    k = k_pool.index_select(0, slots.reshape(-1)).view(b, max_len, hkv, d).float()
    v = v_pool.index_select(0, slots.reshape(-1)).view(b, max_len, hkv, d).float()
    group = h // hkv
    hidden = ~seen[:, :, None, None]  # a slot outside the context may hold anything, NaN included
    k = k.masked_fill(hidden, 0.0)
    v = v.masked_fill(hidden, 0.0)
    # Query head j uses KV head j // group: each KV head repeated `group` times, (B, H, L, D).
    k = k[:, :, :, None].expand(b, max_len, hkv, group, d).reshape(b, max_len, h, d).permute(0, 2, 1, 3)
    v = v[:, :, :, None].expand(b, max_len, hkv, group, d).reshape(b, max_len, h, d).permute(0, 2, 1, 3)
    scores = torch.einsum("bhd,bhld->bhl", query.float() * scale, k)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    if sinks is not None:  # one more logit per head in the softmax, dropped after it
        scores = torch.cat([scores, sinks.float()[None, :, None].expand(b, h, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a padding row sees nothing: zeros
    if sinks is not None:
        probs = probs[..., :-1]
    result = torch.einsum("bhl,bhld->bhd", probs, v).to(query.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def self_check(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype | None = None,
    softcap: float = 0.0,
    sinks: bool = False,
    sliding_window: int = 0,
) -> str | None:
    """Runs the kernel once on small random inputs of the model's head layout and dtype (the pools in
    `kv_dtype`, default `dtype`), with the model's soft-cap, sinks and window when it has them, and
    compares it with the reference. None when it agrees; else why not
    (a compile or launch error, or a mismatch), so that a GPU or Triton build the kernel does not work on
    is found at start-up, not at the first decode.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    block_size, blocks = 16, 6
    slots = blocks * block_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    query = rand(3, num_heads, head_dim)
    k_pool, v_pool = rand(slots, num_kv_heads, head_dim), rand(slots, num_kv_heads, head_dim)
    if kv_dtype is not None:
        k_pool, v_pool = k_pool.to(kv_dtype), v_pool.to(kv_dtype)
    tables = torch.tensor([[4, 1, 0], [2, 5, 3], [0, 0, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([40, 17, 0], dtype=torch.int32, device=device)  # the last row pads
    scale = head_dim**-0.5
    extras = dict(softcap=softcap, sinks=rand(num_heads) if sinks else None)
    window = min(sliding_window, 24)
    try:
        got = paged_decode_attention(query, k_pool, v_pool, tables, lens, block_size, scale, window, **extras)
        want = paged_decode_attention_reference(
            query, k_pool, v_pool, tables, lens, block_size, scale, window, **extras
        )
        error = (got.float() - want.float()).abs().max().item()
    except Exception as exc:  # a compile or launch failure of this device's Triton build
        return f"{type(exc).__name__}: {exc}"
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        return f"its output is {error:.3g} away from the reference (tolerance {tolerance})"
    return None
