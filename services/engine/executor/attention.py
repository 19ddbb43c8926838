"""Paged attention for transformers' model code ("sluice_paged", registered through
`transformers.AttentionInterface`). `paged_attention` takes one packed step (decode rows first, one token
each, then each prefill chunk), writes the step's K/V into the layer's pool slots (float8 pools: clamped to
±448, scale 1.0; every read converts back), then attends per sequence, never across sequences: decode rows
through a paged kernel reading K/V in place (backend "triton": CUDA; "cpu": C++) or per DecodeGroup as
whole blocks gathered into a reused scratch buffer + SDPA (backend "torch"); each prefill chunk causally,
aligned bottom-right to its cached context. A layer's own `scaling`, `sliding_window`, `softcap` and
`s_aux` (sinks) are honoured as given; with a soft-cap or sinks the torch path computes the scores
explicitly in fp32. A hybrid model's layers read their KV group's metadata (`StepMeta.for_layer`).
Narrative and measurements: docs/architecture.md ("Engine internals", "Where the cycles go: one decode
step").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from services.engine.executor.kernels import cpu_kernels
from services.engine.executor.kernels.paged_attention import paged_decode_attention

ATTN_NAME = "sluice_paged"
META_KWARG = "sluice_step"
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def write_kv(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """pool[slots] = values (T, Hkv, D), converted to the pool's dtype; into a float8 pool clamped to
    its finite range first, and written through a uint8 view (CPU float8 tensors have no index_copy)."""
    if pool.dtype in FP8_KV_DTYPES:
        limit = torch.finfo(pool.dtype).max
        fp8 = values.clamp(-limit, limit).to(pool.dtype)
        pool.view(torch.uint8).index_copy_(0, slots, fp8.view(torch.uint8))
    else:
        pool.index_copy_(0, slots, values)


def read_kv(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool[slots] in `dtype` (a float8 pool's values converted back, scale 1.0)."""
    return pool.index_select(0, slots).to(dtype)


class DecodeScratch:
    """Buffers the torch decode path gathers K/V into, kept and reused across layers and steps on a CPU
    (a fresh multi-megabyte tensor per layer there costs its page faults on every use); elsewhere each
    `take` is a plain allocation (the device's caching allocator already reuses memory)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def take(
        self, which: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor of `shape`, valid until the next `take` of the same `which` and dtype."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        n = math.prod(shape)
        key = (which, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n + n // 4, dtype=dtype, device=device)  # headroom for longer contexts
            self._buffers[key] = buf
        return buf[:n].view(shape)


def gather_blocks(
    pool: torch.Tensor,  # (num_slots, Hkv, D)
    blocks: torch.Tensor,  # (rows, nb) block ids
    block_size: int,
    dtype: torch.dtype,
    scratch: DecodeScratch,
    which: int,
) -> torch.Tensor:
    """(rows, Hkv, nb * block_size, D) in `dtype`: each row's blocks in order, copied whole (one
    index_select over block ids) into `scratch`'s buffer `which` and viewed head-major (not copied
    again); a float8 pool's values converted back, scale 1.0."""
    rows, nb = blocks.shape
    hkv, d = pool.shape[1], pool.shape[2]
    shape = (rows * nb, block_size, hkv, d)
    src = pool.view(-1, block_size, hkv, d)
    flat = blocks.reshape(-1)
    if pool.dtype == dtype:
        got = torch.index_select(src, 0, flat, out=scratch.take(which, shape, dtype, pool.device))
    else:
        raw = torch.index_select(src, 0, flat, out=scratch.take(which, shape, pool.dtype, pool.device))
        got = scratch.take(which, shape, dtype, pool.device).copy_(raw)
    return got.view(rows, nb * block_size, hkv, d).transpose(1, 2)


# Scores the explicit path holds at once ((rows, H, q, ctx) floats), bounding a long prefill's memory.
_EXPLICIT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class LayerExtras:
    """A layer's keywords beyond the window: soft-cap (0 = none) and sinks ((H,) logits, or None)."""

    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def explicit(self) -> bool:
        return bool(self.softcap) or self.sinks is not None


class AttentionProbe:
    """Step metadata for the start-up probe (capabilities.probe): each attention call hands `record`
    its module, query, key, value and keywords, and returns zeros; no pool is touched."""

    def __init__(self, record: Callable[..., None]) -> None:
        self.record = record


@dataclass
class PrefillSeq:
    q_start: int  # first row in the packed batch
    q_len: int  # tokens of this chunk
    ctx_start: int  # tokens already in the cache before this chunk
    ctx_slots: torch.Tensor | None  # (ctx_start + q_len,) pool slots of the context; None if ctx_start == 0

    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int, device: torch.device) -> torch.Tensor:
        """(q_len, ctx_len) bool, True where attention is allowed; window 0 = none."""
        m = self.masks.get(window)
        if m is None:
            ctx_len = self.ctx_start + self.q_len
            q_pos = torch.arange(self.ctx_start, ctx_len, device=device)[:, None]
            k_pos = torch.arange(ctx_len, device=device)[None, :]
            m = k_pos <= q_pos
            if window:
                m &= k_pos > q_pos - window
            self.masks[window] = m
        return m


@dataclass
class DecodeGroup:
    """Decode rows [row_start, row_start + rows) of similar context length, attended together over the
    group's longest context rounded up to whole blocks."""

    row_start: int
    blocks: torch.Tensor  # (rows, nb) block ids of each row's context, padded with block 0
    lens: torch.Tensor  # (rows,) context length of each row, the new token included
    block_size: int
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int, dtype: torch.dtype) -> torch.Tensor:
        """(rows, 1, 1, nb * block_size) additive mask: 0 for the keys a row sees, -inf elsewhere; window
        0 = none."""
        m = self.masks.get(window)
        if m is None:
            pos = torch.arange(self.blocks.shape[1] * self.block_size, device=self.blocks.device)[None, :]
            lens = self.lens[:, None]
            seen = pos < lens
            if window:
                seen &= pos >= lens - window
            m = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
            m = m[:, None, None, :]
            self.masks[window] = m
        return m


@dataclass
class StepMeta:
    """Per-step attention metadata, built once and shared by every layer."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V pools, each (num_slots, Hkv, D)
    slot_mapping: torch.Tensor  # (T,) pool slot of each packed token
    decode_groups: list[DecodeGroup]  # the decode rows come first in the packed batch, one token each
    prefills: list[PrefillSeq]
    # How the decode rows attend: "torch" (gather per group + SDPA, `decode_groups`), "triton" or "cpu" (a
    # paged kernel over the whole decode batch, reading `block_tables` and `seq_lens`).
    backend: str = "torch"
    num_decodes: int = 0  # decode rows at the head of the packed batch (padding rows of a graph included)
    block_tables: torch.Tensor | None = None  # (num_decodes, max_blocks) int32 block ids of each decode row
    seq_lens: torch.Tensor | None = None  # (num_decodes,) int32 context length incl. the new token; 0 = pad
    block_size: int = 16
    # A hybrid model's KV groups (block_manager.KVGroupSpec): the metadata of each group (this one is
    # the first), built over that group's block tables and pool slots, and each layer's group. Empty for
    # a model with one group.
    group_metas: list[StepMeta] = field(default_factory=list)
    layer_group: Sequence[int] = ()
    # Where the torch decode path gathers K/V: the runner passes one kept for its lifetime.
    scratch: DecodeScratch = field(default_factory=DecodeScratch)

    def for_layer(self, layer: int) -> StepMeta:
        """The metadata of `layer`'s KV group."""
        return self.group_metas[self.layer_group[layer]] if self.group_metas else self


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, Hkv, T, D)
    value: torch.Tensor,  # (1, Hkv, T, D)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    meta = kwargs.get(META_KWARG)
    if isinstance(meta, AttentionProbe):
        meta.record(module, query, key, value, {k: v for k, v in kwargs.items() if k != META_KWARG})
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    if not isinstance(meta, StepMeta):
        raise RuntimeError(f"attention '{ATTN_NAME}' needs the engine's step metadata in `{META_KWARG}`")
    meta = meta.for_layer(module.layer_idx)
    window = int(kwargs.get("sliding_window") or 0)  # type: ignore[call-overload]
    sinks = kwargs.get("s_aux")
    extras = LayerExtras(
        float(kwargs.get("softcap") or 0.0), sinks if isinstance(sinks, torch.Tensor) else None
    )  # type: ignore[arg-type]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    k_pool, v_pool = meta.kv[module.layer_idx]
    h, t, d = query.shape[1], query.shape[2], query.shape[3]
    k_new = key[0].transpose(0, 1)  # (T, Hkv, D)
    v_new = value[0].transpose(0, 1)
    write_kv(k_pool, meta.slot_mapping, k_new)
    write_kv(v_pool, meta.slot_mapping, v_new)
    out = query.new_empty((t, h, d))
    q = query[0]  # (H, T, D)
    _decode(meta, q, k_pool, v_pool, out, scaling, window, extras)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        out[rows] = _prefill(
            p, q[None, :, rows], key[:, :, rows], value[:, :, rows], k_pool, v_pool, scaling, window, extras
        )
    return out[None], None


def attend_explicit(
    q: torch.Tensor,  # (B, H, Lq, D)
    k: torch.Tensor,  # (B, Hkv, Lk, D)
    v: torch.Tensor,  # (B, Hkv, Lk, D)
    seen: torch.Tensor,  # bool, True where a query sees a key: (Lq, Lk) or (B, 1, 1, Lk)
    scale: float,
    extras: LayerExtras,
) -> torch.Tensor:
    """Attention with the scores computed in fp32: scaled, soft-capped (softcap * tanh(s / softcap)),
    masked, then a softmax whose denominator also holds exp(sink) of each query head when there are
    sinks. Query head j uses KV head j // (H / Hkv). (B, H, Lq, D) in the query's dtype."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    mask = seen if seen.dim() == 2 else seen.reshape(b, 1, 1, 1, lk)  # → (B, Hkv, G, Lq, Lk)
    kf, vf = k.float(), v.float()
    out = torch.empty((b, h, lq, d), dtype=q.dtype, device=q.device)
    step = max(1, _EXPLICIT_ELEMENTS // max(1, b * h * lk))
    for a in range(0, lq, step):
        z = min(lq, a + step)
        qf = q[:, :, a:z].float().reshape(b, hkv, g, z - a, d)
        s = torch.einsum("bkgqd,bkld->bkgql", qf, kf) * scale
        if extras.softcap:
            s = torch.tanh(s / extras.softcap) * extras.softcap
        s = s.masked_fill(~(mask[a:z] if mask.dim() == 2 else mask), float("-inf"))
        if extras.sinks is not None:
            sink = extras.sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, z - a, 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        if extras.sinks is not None:
            p = p[..., :-1]
        o = torch.einsum("bkgql,bkld->bkgqd", p, vf)
        out[:, :, a:z] = o.reshape(b, h, z - a, d).to(q.dtype)
    return out


def _decode(
    meta: StepMeta,
    q: torch.Tensor,  # (H, T, D)
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,  # (T, H, D)
    scaling: float,
    window: int,
    extras: LayerExtras,
) -> None:
    """The decode rows, written into `out` in place: backend "triton" (CUDA) or "cpu" (C++), the first
    `meta.num_decodes` rows through one paged-kernel call; "torch", each DecodeGroup's rows with their
    K/V gathered from the pool in whole blocks, one SDPA call per group (the explicit scores with a
    soft-cap or sinks)."""
    if meta.backend in ("triton", "cpu"):
        nd = meta.num_decodes
        if nd == 0:
            return
        if meta.block_tables is None or meta.seq_lens is None:
            raise RuntimeError(
                f"the {meta.backend} attention backend needs block_tables and seq_lens in the step metadata"
            )
        kernel = cpu_kernels.paged_decode if meta.backend == "cpu" else paged_decode_attention
        kernel(
            q[:, :nd].transpose(0, 1),
            k_pool,
            v_pool,
            meta.block_tables,
            meta.seq_lens,
            meta.block_size,
            scaling,
            window,
            out=out[:nd],
            softcap=extras.softcap,
            sinks=extras.sinks,
        )
        return
    h, d = q.shape[0], q.shape[2]
    hkv = k_pool.shape[1]
    group = h // hkv
    for g in meta.decode_groups:
        rows = g.blocks.shape[0]
        kd = gather_blocks(k_pool, g.blocks, g.block_size, q.dtype, meta.scratch, 0)  # (rows, Hkv, L, D)
        vd = gather_blocks(v_pool, g.blocks, g.block_size, q.dtype, meta.scratch, 1)
        mask = g.mask(window, q.dtype)  # (rows, 1, 1, L)
        if extras.explicit:
            qe = q[:, g.row_start : g.row_start + rows].transpose(0, 1)[:, :, None]  # (rows, H, 1, D)
            od = attend_explicit(qe, kd, vd, mask == 0, scaling, extras)
            out[g.row_start : g.row_start + rows] = od[:, :, 0]
            continue
        # (H, rows, D) → (rows, Hkv, G, D): the G query heads of a KV head act as G query rows.
        qd = q[:, g.row_start : g.row_start + rows].reshape(hkv, group, rows, d).permute(2, 0, 1, 3)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scaling)
        out[g.row_start : g.row_start + rows] = od.reshape(rows, h, d)


def _prefill(
    p: PrefillSeq,
    qp: torch.Tensor,  # (1, H, n, D)
    k_new: torch.Tensor,  # (1, Hkv, n, D)
    v_new: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float,
    window: int,
    extras: LayerExtras,
) -> torch.Tensor:
    """One prefill chunk's attention, (n, H, D): plain causal without context, the lower-right causal
    bias over a cached context, a materialised mask only for a sliding window, a soft-cap or sinks."""
    if p.ctx_slots is None:
        kp, vp = k_new, v_new
    else:
        kp = read_kv(k_pool, p.ctx_slots, qp.dtype).transpose(0, 1)[None]  # (1, Hkv, ctx, D)
        vp = read_kv(v_pool, p.ctx_slots, qp.dtype).transpose(0, 1)[None]
    if extras.explicit:
        op = attend_explicit(qp, kp, vp, p.mask(window, qp.device), scaling, extras)
    elif window:
        mask = p.mask(window, qp.device)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=True)
    elif p.ctx_slots is None:
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        bias = causal_lower_right(p.q_len, kp.shape[2])
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=bias, scale=scaling, enable_gqa=True)
    return op[0].transpose(0, 1)
