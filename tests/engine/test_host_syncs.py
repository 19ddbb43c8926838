"""A decode step reads nothing of the device's data on the host: the property CUDA graphs and async
scheduling rest on, checked on any device.

A CUDA graph cannot capture an operation whose result the host must see (`.item()`, `nonzero`, a boolean
test of a tensor, an output whose shape depends on the data), and every such read in a step stalls the
host until the device catches up. A `TorchDispatchMode` sees every aten operation the step runs and
records those that read device data on the host. The paged kernel is a Triton launch (no aten operation),
so it is stood in for by its plain-torch reference, whose shapes come from the inputs' shapes only; what is
checked is everything around it: transformers' model code, the step metadata, the KV writes, the static
decode buffers and the sampler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import services.engine.executor.attention as attention
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.executor.kernels.paged_attention import paged_decode_attention_reference
from services.engine.executor.model_runner import ModelRunner
from services.engine.executor.sampler import Sampler
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE

aten = torch.ops.aten
# Operations whose result the host must read from the device (a sync, and a failure under capture).
HOST_READS = {
    aten._local_scalar_dense,  # .item(), int(t), float(t), bool(t)
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
    aten.nonzero,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique2,
    aten.repeat_interleave,
}
NUM_BLOCKS = 12
BLOCK_SIZE = 16


class HostReads(TorchDispatchMode):
    """Records every operation in HOST_READS run inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def runner(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    monkeypatch.setattr(attention, "paged_decode_attention", paged_decode_attention_reference)
    settings = EngineSettings(
        model=str(llama_dir),
        device=TEST_DEVICE,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        attention_backend="triton",
        cuda_graphs="off",
    )
    r = ModelRunner(settings, static_decode=True)
    r.prepare(max_model_len=128, max_num_seqs=8)
    return r


def decoding(lengths: list[int], prev: bool) -> list[tuple[Request, int]]:
    """Requests with `lengths[i]` tokens cached, each decoding one token; with `prev`, every other one
    takes its input token from the previous step's ids on the device (async scheduling)."""
    scheduled = []
    free = list(range(NUM_BLOCKS))
    for i, n in enumerate(lengths):
        prompt = [(5 * i + 3 * j) % 300 + 3 for j in range(n + 1)]
        req = Request(f"r{i}", prompt, SamplingParams(), StoppingParams(max_new_tokens=4))
        req.num_computed_tokens = n
        req.block_ids = [free.pop() for _ in range(n // BLOCK_SIZE + 1)]
        if prev and i % 2:
            req.prev_row = i
        scheduled.append((req, 1))
    return scheduled


@pytest.mark.parametrize("prev", [False, True], ids=["host-ids", "device-ids"])
def test_a_decode_step_reads_nothing_on_the_host(runner: ModelRunner, prev: bool) -> None:
    scheduled = decoding([20, 5, 33], prev)  # 3 rows, padded to 4 in the static buffers
    prev_tokens = torch.arange(3, 7, device=TEST_DEVICE) if prev else None
    sampler = Sampler(runner.device)
    reads = HostReads()
    with reads:
        logits, reqs = runner.execute(scheduled, prev_tokens)
        handle = sampler.launch(logits, reqs)
    assert reads.seen == [], f"host reads in a decode step: {reads.seen}"
    assert len(handle.result().token_ids) == 3


def test_the_probe_sees_a_host_read(runner: ModelRunner) -> None:
    """The check can fail: an `.item()` inside the step is recorded."""
    scheduled = decoding([20, 5], prev=False)
    reads = HostReads()
    with reads:
        logits, _ = runner.execute(scheduled)
        logits.max().item()
    assert reads.seen and "_local_scalar_dense" in reads.seen[0]


def test_a_mixed_step_reads_nothing_on_the_host(runner: ModelRunner) -> None:
    """An eager step: decode rows (one of them fed from the device) and a fresh prefill. (A chunk over a
    cached context attends through SDPA's `causal_lower_right` bias, a tensor subclass that a dispatch
    mode cannot wrap, so it is left out here.)"""
    scheduled = decoding([20, 5], prev=True)
    fresh = Request("fresh", list(range(3, 20)), SamplingParams(), StoppingParams(max_new_tokens=4))
    fresh.block_ids = [8, 9]
    scheduled.append((fresh, 17))
    reads = HostReads()
    with reads:
        logits, reqs = runner.execute(scheduled, torch.arange(3, 7, device=TEST_DEVICE))
        Sampler(runner.device).launch(logits, reqs)
    assert reads.seen == [], f"host reads in a step with a prefill: {reads.seen}"
    assert len(reqs) == 3
