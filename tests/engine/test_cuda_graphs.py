"""Decode-only steps through the padded static buffers (executor/cuda_graphs.py): the captured sizes,
padding rows that touch nothing but the scratch block, logits equal to the eager triton step, and on CUDA
a replayed graph equal to the eager step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.executor.cuda_graphs import capture_sizes, padded_size
from services.engine.executor.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE

if TEST_DEVICE == "cpu":  # the kernel runs under Triton's interpreter on CPU (tests/conftest.py sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

NUM_BLOCKS = 12
BLOCK_SIZE = 16


def test_capture_sizes_are_powers_of_two_then_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    sizes = capture_sizes(100)
    assert [padded_size(sizes, b) for b in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    with pytest.raises(ValueError, match="exceed the largest captured batch 100"):
        padded_size(sizes, 101)


def decode_requests(lengths: list[int], prev_row: bool = False) -> list[tuple[Request, int]]:
    """Requests whose context of `lengths[i]` tokens is cached (blocks handed out in reverse order) and
    whose next step decodes one token."""
    scheduled = []
    free = list(range(NUM_BLOCKS - 1, -1, -1))
    for i, n in enumerate(lengths):
        prompt = [(7 * i + 3 * j) % 300 + 3 for j in range(n + 1)]
        req = Request(f"r{i}", prompt, SamplingParams(), StoppingParams(max_new_tokens=4))
        req.num_computed_tokens = n
        req.block_ids = [free.pop() for _ in range(n // BLOCK_SIZE + 1)]
        scheduled.append((req, 1))
    return scheduled


def static_runner(model_dir: Path, **kw: object) -> ModelRunner:
    static_decode = bool(kw.pop("static_decode", False))
    settings = EngineSettings(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        attention_backend="triton",
        **kw,  # type: ignore[arg-type]
    )
    runner = ModelRunner(settings, static_decode=static_decode)
    runner.prepare(max_model_len=128, max_num_seqs=8)
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv:  # a filled pool: every cached context has real keys and values
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return runner


def test_padding_rows_write_only_the_scratch_block(llama_dir: Path) -> None:
    runner = static_runner(llama_dir, static_decode=True)
    scheduled = decode_requests([20, 5, 33])  # 3 rows padded to 4
    before = [(k.clone(), v.clone()) for k, v in runner.kv]
    logits, reqs = runner.execute(scheduled)
    assert [r.request_id for r in reqs] == ["r2", "r0", "r1"] and logits.shape == (3, runner.vocab_size)
    written = torch.zeros(runner.kv[0][0].shape[0], dtype=torch.bool)
    for r, _ in scheduled:
        p = r.num_computed_tokens
        written[r.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = True
    scratch = torch.zeros_like(written)
    scratch[runner.scratch_slots[0] :] = True
    assert runner.scratch_slots == [NUM_BLOCKS * BLOCK_SIZE]
    for (k0, v0), (k1, v1) in zip(before, runner.kv, strict=True):
        untouched = ~written & ~scratch
        assert torch.equal(k0[untouched.to(k0.device)], k1[untouched.to(k1.device)])
        assert torch.equal(v0[untouched.to(v0.device)], v1[untouched.to(v1.device)])
        changed = (k0 != k1).flatten(1).any(1).cpu()
        assert changed[written].all(), "every real row wrote its slot"
        assert changed[scratch].any(), "the padding row wrote the scratch block"


def test_padded_step_equals_the_eager_step(llama_dir: Path) -> None:
    runner = static_runner(llama_dir, static_decode=True)
    pool = [(k.clone(), v.clone()) for k, v in runner.kv]
    scheduled = decode_requests([40, 17, 3, 16, 9])  # 5 rows padded to 8
    padded, _ = runner.execute(scheduled)
    for (k, v), (k0, v0) in zip(runner.kv, pool, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    runner._static = None  # the eager triton path, no padding
    eager, _ = runner.execute(scheduled)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)


def test_padded_step_reads_pending_tokens_from_the_device(llama_dir: Path) -> None:
    """Async scheduling: a row's input id comes from the previous step's ids on the device."""
    runner = static_runner(llama_dir, static_decode=True)
    pool = [(k.clone(), v.clone()) for k, v in runner.kv]
    scheduled = decode_requests([12, 30, 7])
    known, _ = runner.execute(scheduled)
    for (k, v), (k0, v0) in zip(runner.kv, pool, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    prev = torch.tensor([0, 0, 0, 0], dtype=torch.long, device=TEST_DEVICE)
    for row, (r, _) in zip((3, 1), (scheduled[0], scheduled[2]), strict=True):
        prev[row] = r.token_ids[r.num_computed_tokens]
        r.prev_row = row
    pending, _ = runner.execute(scheduled, prev)
    torch.testing.assert_close(pending, known, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    TEST_DEVICE != "cuda", reason="CUDA graphs are captured on CUDA only (scripts/gpu_check.sh)"
)
def test_replayed_graph_equals_the_eager_step(llama_dir: Path) -> None:
    graphs = static_runner(llama_dir, cuda_graphs="on")
    eager = static_runner(llama_dir, cuda_graphs="off")
    assert graphs._static is not None and sorted(graphs._static.graphs) == [1, 2, 4, 8]
    assert eager._static is None
    for lengths in ([20], [20, 5, 33], [40, 17, 3, 16, 9, 1, 2]):
        a, _ = graphs.execute(decode_requests(lengths))
        b, _ = eager.execute(decode_requests(lengths))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert graphs.last_forward_s > 0
