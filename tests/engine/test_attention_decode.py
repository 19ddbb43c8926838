"""The CPU decode paths. Backend "torch" (whole blocks gathered into a reused scratch buffer, masked by
length, SDPA or the explicit scores) against attention computed row by row in float64 from each row's
own slots: several DecodeGroups of rows of different lengths, GQA, sliding windows, soft-cap, sinks, fp32
/ bf16 / float8 pools, one scratch reused across steps whose gathers grow and shrink; slots outside a
row's context hold large finite values, so reading one unmasked shows. Backend "cpu" (the C++ paged
kernel) against the Triton kernel's reference, and how the backend is chosen without the kernel.

Tolerances: fp32 1e-5; bf16 2e-2 (bf16 inputs, fp32 accumulation, one rounding of the output); float8
pools against the same float8 values converted back (the reference reads them too), at fp32's tolerance.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.engine.executor.attention import (
    DecodeGroup,
    DecodeScratch,
    StepMeta,
    paged_attention,
    write_kv,
)
from services.engine.executor.kernels import cpu_kernels
from services.engine.executor.kernels.paged_attention import paged_decode_attention_reference
from services.engine.executor.model_runner import resolve_backend
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_paged_kernel import lens_for, make_case

DEV = torch.device(TEST_DEVICE)
ROOT = Path(__file__).resolve().parents[2]
H, HKV, D, BS = 8, 2, 16, 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
OUTSIDE = 1e4  # every slot outside a row's context


def make_step(
    groups: list[list[int]], dtype: torch.dtype, seed: int, scratch: DecodeScratch, fp8: bool = False
) -> tuple[StepMeta, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """One decode step: a DecodeGroup per list of context lengths (the new token included), each row's
    blocks scattered over the pool; the packed query and the step's new K/V, and each row's slots."""
    gen = torch.Generator().manual_seed(seed)
    lens = [n for g in groups for n in g]
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding entries
    row_blocks = []
    for n in need:
        row_blocks.append(order[:n])
        order = order[n:]
    k = torch.full((num_blocks * BS, HKV, D), OUTSIDE)
    v = torch.full((num_blocks * BS, HKV, D), -OUTSIDE)
    row_slots = [[b[p // BS] * BS + p % BS for p in range(n)] for b, n in zip(row_blocks, lens, strict=True)]
    for slots in row_slots:
        k[slots] = torch.randn(len(slots), HKV, D, generator=gen)
        v[slots] = torch.randn(len(slots), HKV, D, generator=gen)
    pool_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_pool = torch.zeros(k.shape, dtype=pool_dtype, device=DEV)
    v_pool = torch.zeros(v.shape, dtype=pool_dtype, device=DEV)
    everything = torch.arange(k.shape[0], device=DEV)
    write_kv(k_pool, everything, k.to(DEV, dtype))
    write_kv(v_pool, everything, v.to(DEV, dtype))
    decode_groups = []
    row = 0
    for g in groups:
        table = torch.zeros(len(g), max(need[row : row + len(g)]), dtype=torch.long)
        for i in range(len(g)):
            table[i, : need[row + i]] = torch.tensor(row_blocks[row + i])
        decode_groups.append(DecodeGroup(row, table.to(DEV), torch.tensor(g, device=DEV), BS))
        row += len(g)
    last = torch.tensor([s[-1] for s in row_slots], device=DEV)
    meta = StepMeta([(k_pool, v_pool)], last, decode_groups, [], block_size=BS, scratch=scratch)
    query = torch.randn(1, H, len(lens), D, generator=gen).to(DEV, dtype)
    # The step's own K/V are those already in the pool: writing them again changes nothing.
    key = k_pool.index_select(0, last).to(dtype).transpose(0, 1)[None]
    value = v_pool.index_select(0, last).to(dtype).transpose(0, 1)[None]
    return meta, query, key, value, row_slots


def reference(
    meta: StepMeta,
    query: torch.Tensor,
    row_slots: list[list[int]],
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """(rows, H, D) float64: each row's scores over its own slots (the window's last keys), scaled,
    soft-capped, softmax with exp(sink) in the denominator, times V."""
    k_pool, v_pool = (p.double() for p in meta.kv[0])
    q = query[0].double().transpose(0, 1)  # (rows, H, D)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for r, slots in enumerate(row_slots):
        seen = slots[-window:] if window else slots
        k = k_pool[seen].repeat_interleave(H // HKV, dim=1)  # (n, H, D)
        v = v_pool[seen].repeat_interleave(H // HKV, dim=1)
        s = torch.einsum("hd,nhd->hn", q[r], k) * D**-0.5
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None].to(s.device)], dim=1)
        p = torch.softmax(s, dim=1)[:, : len(seen)]
        out[r] = torch.einsum("hn,nhd->hd", p, v)
    return out


def attend(
    meta: StepMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object
) -> torch.Tensor:
    out, _ = paged_attention(
        SimpleNamespace(layer_idx=0), q, k, v, None, scaling=D**-0.5, sluice_step=meta, **kwargs
    )
    return out[0]


GROUPS = [[23, 21, 17], [9, 8], [1]]  # mid-block, a block edge, one token; three groups
SINKS = torch.linspace(-1.0, 2.0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(0, 0.0, None), (6, 0.0, None), (0, 0.5, None), (0, 0.0, SINKS), (6, 0.5, SINKS)],
    ids=["plain", "window", "softcap", "sinks", "window-softcap-sinks"],
)
def test_decode_equals_attention_over_each_rows_slots(
    dtype: torch.dtype, window: int, softcap: float, sinks: torch.Tensor | None
) -> None:
    meta, q, k, v, row_slots = make_step(GROUPS, dtype, 1, DecodeScratch())
    s_aux = None if sinks is None else sinks.to(DEV)
    got = attend(meta, q, k, v, sliding_window=window, softcap=softcap, s_aux=s_aux)
    assert got.dtype == dtype
    want = reference(meta, q, row_slots, window, softcap, sinks)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("window", [0, 6])
def test_decode_over_a_float8_pool_reads_its_values_back(window: int) -> None:
    meta, q, k, v, row_slots = make_step(GROUPS, torch.float32, 2, DecodeScratch(), fp8=True)
    assert meta.kv[0][0].dtype == torch.float8_e4m3fn
    got = attend(meta, q, k, v, sliding_window=window)
    torch.testing.assert_close(
        got.double(), reference(meta, q, row_slots, window, 0.0, None), atol=1e-5, rtol=1e-5
    )


def test_one_scratch_serves_steps_whose_gathers_grow_and_shrink() -> None:
    scratch = DecodeScratch()
    for seed, groups in enumerate([[[5, 3]], [[40, 38, 30], [12]], [[7]], [[33], [2, 1]]]):
        meta, q, k, v, row_slots = make_step(groups, torch.float32, 10 + seed, scratch)
        got = attend(meta, q, k, v)
        torch.testing.assert_close(
            got.double(), reference(meta, q, row_slots, 0, 0.0, None), atol=1e-5, rtol=1e-5
        )


# The CPU paged kernel (backend "cpu") against the Triton kernel's torch reference, on the Triton tests'
# cases: slots outside every row's context hold NaN and a padding row's table is out of range, so any
# read outside a row's context shows. Head sizes 64 and 128 with 2, 4 or 8 query heads per KV head run
# the kernel's loop by KV head, the others its loop by slot.
CPU_SHAPES = [
    pytest.param(8, 8, 16, 16, 0, id="g1-d16"),
    pytest.param(8, 4, 24, 16, 5, id="g2-d24-window5"),
    pytest.param(16, 4, 64, 16, 0, id="g4-d64"),
    pytest.param(16, 4, 64, 16, 11, id="g4-d64-window11"),
    pytest.param(8, 2, 128, 8, 0, id="g4-d128-bs8"),
    pytest.param(8, 4, 64, 16, 7, id="g2-d64-window7"),
    pytest.param(16, 2, 64, 16, 0, id="g8-d64"),
    pytest.param(8, 8, 64, 16, 0, id="g1-d64"),
]


def _cpu_kernel() -> None:
    if DEV.type != "cpu" or cpu_kernels.load() is None:
        pytest.skip(f"the CPU paged kernel does not run here: {cpu_kernels.status()[1] or DEV}")


@pytest.mark.parametrize(("h", "hkv", "d", "bs", "window"), CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("softcap", "sinks_on"), [(0.0, False), (0.6, True)], ids=["plain", "softcap-sinks"])
def test_cpu_kernel_matches_reference(
    h: int, hkv: int, d: int, bs: int, window: int, dtype: torch.dtype, softcap: float, sinks_on: bool
) -> None:
    _cpu_kernel()
    c = make_case(h, hkv, d, bs, lens_for(bs), dtype)
    sinks = torch.linspace(-1.0, 2.0, h) if sinks_on else None
    got = torch.full_like(c.query, float("nan"))
    cpu_kernels.paged_decode(*c.args(), c.scale, window, got, softcap=softcap, sinks=sinks)
    want = paged_decode_attention_reference(*c.args(), c.scale, window, softcap=softcap, sinks=sinks)
    assert torch.isfinite(got).all(), "the kernel read a slot outside a row's context"
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    assert (got[c.seq_lens == 0] == 0).all()


def test_cpu_kernel_reads_a_float8_pool_back() -> None:
    _cpu_kernel()
    c = make_case(16, 4, 64, 16, [40, 17, 1], torch.float32, nan_free=True)
    pools = []
    for pool in (c.k_pool, c.v_pool):
        fp8 = torch.zeros(pool.shape, dtype=torch.float8_e4m3fn)
        write_kv(fp8, torch.arange(pool.shape[0]), pool)
        pools.append(fp8)
    got = torch.empty_like(c.query)
    cpu_kernels.paged_decode(c.query, *pools, c.block_tables, c.seq_lens, c.block_size, c.scale, 0, got)
    want = paged_decode_attention_reference(
        c.query, *(p.float() for p in pools), c.block_tables, c.seq_lens, c.block_size, c.scale
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_loading_the_kernel_leaves_denormals_alone() -> None:
    """Built with -ffast-math for its own loops only: loading it must not flush denormals process-wide."""
    _cpu_kernel()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def test_without_the_kernel_auto_is_torch_and_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    cpu_kernels.status.cache_clear()
    try:
        assert resolve_backend("auto", torch.device("cpu")) == "torch"
        with pytest.raises(ValueError, match="attention_backend cpu cannot run"):
            resolve_backend("cpu", torch.device("cpu"))
    finally:
        cpu_kernels.status.cache_clear()
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_the_kernel_builds_where_a_compiler_is() -> None:
    """The skips above are for machines without a C++ compiler only: where one is (this project's
    development and CI machines), the kernel must build."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine: the torch backend serves")
    assert cpu_kernels.load() is not None, cpu_kernels.status()[1]


def test_a_lock_left_by_a_build_killed_midway_does_not_block_the_next_one() -> None:
    """torch's extension loader waits forever on a `lock` file a killed builder left; the kernel's
    own flock (released when its holder dies) lets a later process clear it and load."""
    if cpu_kernels.load() is None:
        pytest.skip(f"the CPU paged kernel does not build here: {cpu_kernels.status()[1]}")
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension.get_default_build_root()) / cpu_kernels._build_name()
    (build_dir / "lock").touch()
    code = "from services.engine.executor.kernels import cpu_kernels; assert cpu_kernels.load() is not None"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (build_dir / "lock").exists()


def test_the_kernels_command_fails_only_when_required_and_not_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m ...cpu_kernels [--require]`: the image's build uses --require to fail without the kernel."""
    monkeypatch.setattr(cpu_kernels, "status", lambda: (None, "no C++ compiler"))
    assert cpu_kernels.main([]) == 0
    assert cpu_kernels.main(["--require"]) == 1
    assert "did not build: no C++ compiler" in capsys.readouterr().out
    monkeypatch.setattr(cpu_kernels, "status", lambda: (SimpleNamespace(), ""))
    assert cpu_kernels.main(["--require"]) == 0
