"""`paged_attention` on one packed step (decode rows, a padding row, a fresh prefill and a prefill over a
cached context): the "triton" and "cpu" backends (a paged kernel over the decode rows, from block tables
and sequence lengths only) equal the "torch" backend (DecodeGroup gather + SDPA), with and without a
sliding window, and both write the step's K/V into the pool first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine.executor.attention import DecodeGroup, PrefillSeq, StepMeta, paged_attention
from services.engine.executor.kernels import cpu_kernels
from tests.engine.conftest import TEST_DEVICE

DEV = torch.device(TEST_DEVICE)
H, HKV, D, BS = 8, 2, 24, 8
DECODE_LENS = [21, 16, 3]  # context length incl. the new token: mid-block, on a block edge, short
PREFILLS = [(0, 6), (13, 4)]  # (cached tokens, new tokens)
NUM_BLOCKS = 24


def slots_of(blocks: list[int], positions: range) -> list[int]:
    return [blocks[p // BS] * BS + p % BS for p in positions]


def make_step(backend: str) -> tuple[StepMeta, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The metadata of one step, its packed (1, H, T, D) query and (1, Hkv, T, D) key/value, and the
    number of decode rows (the last one a padding row). The same data for either backend."""
    gen = torch.Generator().manual_seed(7)
    order = torch.randperm(NUM_BLOCKS - 1, generator=gen).add(1).tolist()  # block 0: the padding row's slot
    decode_blocks = []
    for n in DECODE_LENS:
        need = -(-n // BS)
        decode_blocks.append(order[:need])
        order = order[need:]
    prefill_blocks = []
    for ctx, n in PREFILLS:
        need = -(-(ctx + n) // BS)
        prefill_blocks.append(order[:need])
        order = order[need:]
    slot_mapping = [slots_of(b, range(n - 1, n))[0] for b, n in zip(decode_blocks, DECODE_LENS, strict=True)]
    slot_mapping.append(0)  # the padding row writes to a scratch slot
    num_decodes = len(DECODE_LENS) + 1
    prefills = []
    row = num_decodes
    for blocks, (ctx, n) in zip(prefill_blocks, PREFILLS, strict=True):
        slot_mapping += slots_of(blocks, range(ctx, ctx + n))
        ctx_slots = torch.tensor(slots_of(blocks, range(ctx + n)), device=DEV) if ctx else None
        prefills.append(PrefillSeq(q_start=row, q_len=n, ctx_start=ctx, ctx_slots=ctx_slots))
        row += n
    t = row
    k_pool = torch.randn(NUM_BLOCKS * BS, HKV, D, generator=gen).to(DEV)
    v_pool = torch.randn(NUM_BLOCKS * BS, HKV, D, generator=gen).to(DEV)
    query = torch.randn(1, H, t, D, generator=gen).to(DEV)
    key = torch.randn(1, HKV, t, D, generator=gen).to(DEV)
    value = torch.randn(1, HKV, t, D, generator=gen).to(DEV)
    mapping = torch.tensor(slot_mapping, device=DEV)
    if backend == "torch":
        table = torch.zeros(len(decode_blocks), max(len(b) for b in decode_blocks), dtype=torch.long)
        for i, blocks in enumerate(decode_blocks):
            table[i, : len(blocks)] = torch.tensor(blocks)
        groups = [DecodeGroup(0, table.to(DEV), torch.tensor(DECODE_LENS, device=DEV), BS)]
        meta = StepMeta([(k_pool, v_pool)], mapping, groups, prefills)
    else:
        max_blocks = max(len(b) for b in decode_blocks) + 1
        table = torch.zeros(num_decodes, max_blocks, dtype=torch.int32)
        for i, blocks in enumerate(decode_blocks):
            table[i, : len(blocks)] = torch.tensor(blocks)
        seq_lens = torch.tensor([*DECODE_LENS, 0], dtype=torch.int32)
        meta = StepMeta(
            [(k_pool, v_pool)],
            mapping,
            [],  # the kernel needs no gather groups
            prefills,
            backend=backend,
            num_decodes=num_decodes,
            block_tables=table.to(DEV),
            seq_lens=seq_lens.to(DEV),
            block_size=BS,
        )
    return meta, query, key, value, num_decodes


SINKS = torch.linspace(-1.0, 2.0, H)


@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(0, 0.0, None), (7, 0.0, None), (7, 0.5, None), (0, 0.0, SINKS), (7, 0.5, SINKS)],
    ids=["plain", "window", "window-softcap", "sinks", "window-softcap-sinks"],
)
@pytest.mark.parametrize("kernel", ["triton", "cpu"])
def test_paged_kernel_backends_equal_torch_backend(
    kernel: str, window: int, softcap: float, sinks: torch.Tensor | None
) -> None:
    if kernel == "cpu" and (DEV.type != "cpu" or cpu_kernels.load() is None):
        pytest.skip(f"the CPU paged kernel does not run here: {cpu_kernels.status()[1] or DEV}")
    layer = SimpleNamespace(layer_idx=0)
    outs = {}
    pools = {}
    s_aux = None if sinks is None else sinks.to(DEV)
    for backend in ("torch", kernel):
        meta, q, k, v, nd = make_step(backend)
        out, _ = paged_attention(
            layer,
            q,
            k,
            v,
            None,
            scaling=D**-0.5,
            sliding_window=window,
            softcap=softcap,
            s_aux=s_aux,
            sluice_step=meta,
        )
        assert out.shape == (1, q.shape[2], H, D)
        outs[backend] = out[0]
        pools[backend] = meta.kv[0]
    real = [*range(nd - 1), *range(nd, outs["torch"].shape[0])]  # every row but the padding row
    torch.testing.assert_close(outs[kernel][real], outs["torch"][real], atol=1e-5, rtol=1e-5)
    assert (outs[kernel][nd - 1] == 0).all()
    for a, b in zip(pools["torch"], pools[kernel], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_prefill_honours_softcap_and_sinks() -> None:
    """A fresh prefill chunk through the explicit path equals the definition computed in float64:
    scaled scores, soft-capped, causal within the window, exp(sink) in each head's denominator."""
    gen = torch.Generator().manual_seed(3)
    n, window, softcap, scale = 11, 4, 0.6, 0.3
    q = torch.randn(1, H, n, D, generator=gen)
    k = torch.randn(1, HKV, n, D, generator=gen)
    v = torch.randn(1, HKV, n, D, generator=gen)
    pool = torch.zeros(n, HKV, D)
    meta = StepMeta([(pool, pool.clone())], torch.arange(n), [], [PrefillSeq(0, n, 0, None)])
    layer = SimpleNamespace(layer_idx=0)
    out, _ = paged_attention(
        layer,
        q,
        k,
        v,
        None,
        scaling=scale,
        sliding_window=window,
        softcap=softcap,
        s_aux=SINKS,
        sluice_step=meta,
    )
    want = torch.zeros(n, H, D, dtype=torch.float64)
    for i in range(n):
        for h in range(H):
            keys = range(max(0, i - window + 1), i + 1)
            s = torch.stack([q[0, h, i].double() @ k[0, h // (H // HKV), j].double() * scale for j in keys])
            s = softcap * torch.tanh(s / softcap)
            w = torch.exp(s)
            den = w.sum() + torch.exp(SINKS[h].double())
            want[i, h] = sum(w[m] * v[0, h // (H // HKV), j].double() for m, j in enumerate(keys)) / den
    torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)
