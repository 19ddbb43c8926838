"""The engine's logits against transformers' own forward, step by step, in bfloat16 and in float32.

ModelRunner runs a fixed schedule over a small pool whose blocks are handed out out of order: a packed
step with two prefills of different lengths and the first chunk of a third, decodes of every request
(one of them crossing into a new block), the chunk that continues the third's cached context, and a
request whose first block is a prefix-cache hit on another's, and decodes whose input token the runner
reads from the previous step's ids on the device (async scheduling). Every logits row the runner returns is
compared with the row of `AutoModelForCausalLM` (SDPA, same dtype, no paging) over the whole sequence at
the same position. Tokens are teacher-forced (fixed ids, not sampled), so both sides see the same
sequences whatever the rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import PLACEHOLDER, Request
from services.engine.executor.kernels import cpu_kernels
from services.engine.executor.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE, VOCAB, make_model_dir

BLOCK_SIZE = 16
NUM_BLOCKS = 16


@dataclass(frozen=True)
class Tolerance:
    """How close the engine's logits must be to the reference's, relative to the row's scale (the largest
    |logit| of the reference row)."""

    max_rel: float  # max |engine - reference| / scale
    argmax_margin: float  # the argmax must agree where the reference's top-2 gap exceeds this × scale


# bfloat16 keeps 8 bits of mantissa: every rounding is up to 2^-9 ≈ 0.002 relative, and the two sides round
# at different places (the packed batch, the pool's gather, SDPA's blocking versus one contiguous forward),
# through two layers and the LM head's 64-term sums. Measured on CPU over the whole schedule: max |Δ| ≤
# 0.01 × scale for llama, qwen2 and mistral. 0.05 leaves room for CUDA's kernels and still fails on a
# negated key (test_a_corrupted_pool_slot_fails_the_comparison: 0.8 × scale). A clear argmax (top-2 gap
# above 0.1 × scale, about half the rows here) is far outside that noise and must agree.
BF16 = Tolerance(max_rel=0.05, argmax_margin=0.1)
# float32 on both sides: only the order of summation differs (measured ≤ 6e-7 × scale), so a layout or
# masking bug too small for the bfloat16 tolerance fails here (a slot holding its neighbour's key: 0.09).
FP32 = Tolerance(max_rel=1e-4, argmax_margin=0.0)
DTYPES = {"bfloat16": (torch.bfloat16, BF16), "float32": (torch.float32, FP32)}


def _triton_available() -> bool:
    """The kernel runs on TEST_DEVICE (on CPU only through Triton's interpreter: tests/conftest.py sets
    TRITON_INTERPRET=1 before triton is imported)."""
    try:
        from services.engine.executor.kernels.paged_attention import triton_usable
    except ImportError:
        return False
    return triton_usable(torch.device(TEST_DEVICE))


TRITON = pytest.mark.skipif(not _triton_available(), reason="triton backend not usable on this device")


MODELS = {
    "llama": {},
    # Layer 0 full attention, layer 1 a sliding window of 8: shorter than every context below.
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "mistral": {"sliding_window": 8},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_model_dir(tmp_path_factory.mktemp(f"bf16-{name}"), name, **overrides)  # type: ignore[arg-type]
        for name, overrides in MODELS.items()
    }


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


FED_STEP = 3  # in this step a's and c's input tokens come from the previous step's ids on the device


def _feed_from_device(scheduled: list[tuple[Request, int]]) -> torch.Tensor:
    """As async scheduling does: a's and c's last tokens become placeholders, their values held in a
    device tensor of "sampled ids" (c's in row 0, a's in row 2) that the runner reads."""
    prev = torch.zeros(3, dtype=torch.long)
    for req, _ in scheduled:
        row = {"c": 0, "a": 2}.get(req.request_id, -1)
        if row >= 0:
            prev[row], req.token_ids[-1], req.prev_row = req.token_ids[-1], PLACEHOLDER, row
    return prev.to(TEST_DEVICE)


def _request(name: str, prompt: list[int]) -> Request:
    return Request(name, prompt, SamplingParams(), StoppingParams(max_new_tokens=8))


@dataclass
class Observed:
    """The engine's logits rows: (request, position of the token they follow, row)."""

    rows: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)


StepHook = Callable[[ModelRunner, int], None]


def run_schedule(
    runner: ModelRunner, after_step: StepHook | None = None
) -> tuple[Observed, dict[str, list[int]]]:
    """Runs the fixed schedule; returns every sampled logits row and each request's final tokens."""
    a = _request("a", _tokens(1, 31))  # its decodes cross into a third block
    b = _request("b", _tokens(2, 7))
    c = _request("c", _tokens(3, 37))  # prefilled in two chunks
    # d's first block is a's first: a prefix-cache hit on a's first 16 tokens, computed from position 16.
    d = _request("d", a.token_ids[:16] + _tokens(4, 12))
    d.num_computed_tokens = 16
    # Each request's blocks, out of order; as the scheduler does, a request holds the blocks of the
    # tokens computed so far and of the step's chunk, no more.
    blocks = {"a": [9, 3, 12], "b": [5, 14], "c": [1, 11, 6], "d": [9, 0]}
    forced = {name: _tokens(10 + i, 8) for i, name in enumerate("abcd")}
    schedule: list[list[tuple[Request, int]]] = [
        [(a, 31), (b, 7), (c, 20)],  # two prefills of different lengths and a first chunk
        [(a, 1), (b, 1), (c, 17)],  # decodes and the chunk continuing c's cached context
        [(a, 1), (b, 1), (c, 1), (d, 12)],  # a's new token is the first of its third block
        [(c, 1), (a, 1), (d, 1), (b, 1)],  # a's and c's input tokens fed from the device
        [(d, 1), (a, 1), (b, 1)],  # three rows: a padded decode batch where the runner pads
    ]
    observed = Observed()
    for step, scheduled in enumerate(schedule):
        for req, n in scheduled:
            req.block_ids = blocks[req.request_id][: -(-(req.num_computed_tokens + n) // BLOCK_SIZE)]
            # A hybrid model's other KV groups (qwen2 here: a full and a sliding layer): the same ids.
            req.group_block_ids = [list(req.block_ids) for _ in runner.kv_groups[1:]]
        prev_tokens = _feed_from_device(scheduled) if step == FED_STEP else None
        logits, reqs = runner.execute(scheduled, prev_tokens)
        for req, _ in scheduled:
            if req.prev_row >= 0:  # the host reads the token the device held
                req.token_ids[-1], req.prev_row = int(prev_tokens[req.prev_row]), -1  # type: ignore[index]
        assert logits.shape == (len(reqs), runner.vocab_size)
        for row, req in zip(logits.float().cpu(), reqs, strict=True):
            observed.rows.append((req.request_id, req.num_tokens - 1, row))
        for req, n in scheduled:
            req.num_computed_tokens += n
        for req in reqs:
            req.token_ids.append(forced[req.request_id].pop(0))
        if after_step is not None:
            after_step(runner, step)
    assert {r for r, _, _ in observed.rows} == set("abcd")
    assert len(observed.rows) == 16
    return observed, {r.request_id: r.token_ids for r in (a, b, c, d)}


def reference_logits(
    model_dir: Path, dtype: torch.dtype, tokens: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """transformers' logits (T, V) of each whole sequence: row p is the distribution after token p."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    model.to(TEST_DEVICE).eval()
    out = {}
    with torch.inference_mode():
        for name, ids in tokens.items():
            x = torch.tensor([ids], device=TEST_DEVICE)
            out[name] = model(input_ids=x).logits[0].float().cpu()
    return out


def mismatches(observed: Observed, reference: dict[str, torch.Tensor], tol: Tolerance) -> list[str]:
    """One line per row outside the tolerance (empty when the engine agrees)."""
    bad = []
    for name, pos, row in observed.rows:
        ref = reference[name][pos]
        scale = ref.abs().max().item()
        rel = (row - ref).abs().max().item() / scale
        if rel > tol.max_rel:
            bad.append(f"{name}@{pos}: max |Δ| = {rel:.3g} × scale > {tol.max_rel}")
        top2 = ref.topk(2).values
        if (top2[0] - top2[1]).item() > tol.argmax_margin * scale and row.argmax() != ref.argmax():
            bad.append(f"{name}@{pos}: argmax {row.argmax().item()} != {ref.argmax().item()} (clear margin)")
    return bad


def make_runner(model_dir: Path, dtype: str, backend: str) -> ModelRunner:
    """With the triton backend, decode-only steps run through the padded static buffers (on CUDA their
    graphs, cuda_graphs being on by default)."""
    settings = EngineSettings(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        attention_backend=backend,
    )
    runner = ModelRunner(settings, static_decode=backend == "triton")
    runner.prepare(NUM_BLOCKS * BLOCK_SIZE, 8)
    return runner


def _cases() -> list[object]:
    """Every model, dtype and backend; under Triton's interpreter on CPU (seconds a run) the triton
    backend in bfloat16 only for qwen2 (GQA, a window and full attention), float32 for every model."""
    cases: list[object] = []
    for model in MODELS:
        for dtype in DTYPES:
            cases.append(pytest.param(model, dtype, "torch", id=f"{model}-{dtype}-torch"))
            if TEST_DEVICE == "cpu":
                cases.append(pytest.param(model, dtype, "cpu", id=f"{model}-{dtype}-cpu"))
            if TEST_DEVICE != "cpu" or dtype == "float32" or model == "qwen2":
                cases.append(pytest.param(model, dtype, "triton", marks=TRITON, id=f"{model}-{dtype}-triton"))
    return cases


@pytest.mark.parametrize(("model", "dtype", "backend"), _cases())
def test_engine_logits_match_transformers(
    model_dirs: dict[str, Path], model: str, dtype: str, backend: str
) -> None:
    if backend == "cpu" and cpu_kernels.load() is None:
        pytest.skip(f"the CPU paged kernel does not run here: {cpu_kernels.status()[1]}")
    torch_dtype, tol = DTYPES[dtype]
    runner = make_runner(model_dirs[model], dtype, backend)
    assert runner.dtype == torch_dtype and runner.kv[0][0].dtype == torch_dtype
    assert runner.backend == backend
    observed, tokens = run_schedule(runner)
    reference = reference_logits(model_dirs[model], torch_dtype, tokens)
    assert mismatches(observed, reference, tol) == []


A_SLOT_31 = 3 * BLOCK_SIZE + 15  # a's position 31 (the last of its second block), written in step 1


def _negate_key(runner: ModelRunner) -> None:
    k_pool, _ = runner.kv[1]
    k_pool[A_SLOT_31] = -4 * k_pool[A_SLOT_31]


def _copy_neighbour_key(runner: ModelRunner) -> None:
    """What a write one slot off leaves behind: position 31 holds position 30's key."""
    k_pool, _ = runner.kv[0]
    k_pool[A_SLOT_31] = k_pool[A_SLOT_31 - 1]


@pytest.mark.parametrize(
    ("dtype", "corrupt"),
    [("bfloat16", _negate_key), ("float32", _negate_key), ("float32", _copy_neighbour_key)],
    ids=["bfloat16-negated", "float32-negated", "float32-neighbour"],
)
def test_a_corrupted_pool_slot_fails_the_comparison(
    model_dirs: dict[str, Path], dtype: str, corrupt: Callable[[ModelRunner], None]
) -> None:
    """The comparison can fail: one key of a's context changed in the pool after the step that wrote it
    puts a's later rows, and only a's, outside the tolerance."""
    torch_dtype, tol = DTYPES[dtype]

    def after_step(runner: ModelRunner, step: int) -> None:
        if step == 1:
            corrupt(runner)

    runner = make_runner(model_dirs["llama"], dtype, "torch")
    observed, tokens = run_schedule(runner, after_step)
    bad = mismatches(observed, reference_logits(model_dirs["llama"], torch_dtype, tokens), tol)
    assert bad and all(line.startswith("a@") for line in bad), bad
