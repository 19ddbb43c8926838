"""ModelRunner's attention backend and step inputs: backend resolution and its start-up errors, the staged
(pinned on CUDA) step inputs, the triton backend end to end, and decode-only steps through the padded
static buffers of executor/cuda_graphs.py (eagerly on CPU) against transformers' generate while
requests join and leave across the padded sizes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from services.common.models import tokenizer_size
from services.engine.core.engine import LLMEngine
from services.engine.executor.cuda_graphs import Staging, StaticDecode
from services.engine.executor.kernels import cpu_kernels
from services.engine.executor.model_runner import ModelRunner, resolve_backend
from services.engine.settings import EngineSettings
from sluice.bench import engine_driver as drv
from sluice.model.presets import FIRST_PLAIN_ID
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_model import Workload, reference, run_engine, workload

if TEST_DEVICE == "cpu":  # the kernel runs under Triton's interpreter on CPU (tests/conftest.py sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

CPU = torch.device("cpu")
# Requests joining and leaving so that the decode batch crosses the padded sizes 1 -> 2 -> 4 -> 5 and back.
JOIN_AND_LEAVE: Workload = [
    (0, [5, 9, 13, 17, 21, 40, 41], 14),
    (3, [7, 3, 99, 100, 101, 102, 103, 104, 105, 6, 8, 10, 12, 14, 16, 18, 20], 9),
    (5, [33, 34], 5),
    (6, list(range(50, 90)), 10),
    (6, [200, 201, 202], 3),
    (9, [11] * 20, 4),
]


def test_auto_on_a_cpu_is_the_cpu_kernel_where_it_builds_and_torch_is_always_torch() -> None:
    assert resolve_backend("auto", CPU) == ("cpu" if cpu_kernels.load() is not None else "torch")
    assert resolve_backend("torch", CPU) == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", CPU) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"attention_backend triton cannot run: .*TRITON_INTERPRET=1"):
        resolve_backend("triton", CPU)
    with pytest.raises(ValueError, match="attention_backend must be"):
        resolve_backend("flash", CPU)


def test_engine_refuses_triton_at_start_up_where_it_cannot_run(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    settings = EngineSettings(
        model=str(llama_dir), device="cpu", num_kv_blocks=8, max_model_len=64, attention_backend="triton"
    )
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 is not set"):
        LLMEngine(settings)


def test_static_decode_needs_the_triton_backend(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="static_decode needs the triton"):
        settings = EngineSettings(
            model=str(llama_dir), device=TEST_DEVICE, num_kv_blocks=8, attention_backend="torch"
        )
        ModelRunner(settings, static_decode=True)


def test_staging_packs_parts_and_grows() -> None:
    staging = Staging(CPU, torch.int64, capacity=4)
    a, b, c = staging.stage([[1, 2, 3], [], [7, 8]])
    assert a.tolist() == [1, 2, 3] and b.numel() == 0 and c.tolist() == [7, 8]
    (big,) = staging.stage([list(range(100))])
    assert big.tolist() == list(range(100)) and staging.capacity == 128


def engine_with(model_dir: Path, async_scheduling: str = "auto", **runner_kw: object) -> LLMEngine:
    """A small engine (as test_model's) whose runner is built with `runner_kw`."""
    static_decode = bool(runner_kw.pop("static_decode", False))
    runner = ModelRunner(
        EngineSettings(
            model=str(model_dir), device=TEST_DEVICE, dtype="float32", num_kv_blocks=32, **runner_kw
        ),  # type: ignore[arg-type]
        static_decode=static_decode,
    )
    settings = EngineSettings(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype="float32",
        max_num_batched_tokens=32,
        num_kv_blocks=32,
        max_num_seqs=5,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    return LLMEngine(settings, runner=runner)


def test_triton_backend_greedy_matches_generate(llama_dir: Path) -> None:
    items = workload(seed=3, n=10)
    engine = engine_with(llama_dir, attention_backend="triton", cuda_graphs="off")
    assert engine.runner.backend == "triton" and engine.runner._static is None
    assert run_engine(engine, items) == reference(llama_dir, items)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padded_static_decode_matches_generate(
    family: str, llama_dir: Path, qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = llama_dir if family == "llama" else qwen2_dir
    # The decode batch sizes checked below are the synchronous schedule's (on CUDA, auto would overlap
    # steps, and a request joining lands in a step with a prefill instead).
    engine = engine_with(model_dir, async_scheduling="off", attention_backend="triton", static_decode=True)
    static = engine.runner._static
    assert static is not None and static.sizes == [1, 2, 4, 5]
    padded: list[tuple[int, int]] = []
    run = StaticDecode.run

    def spy(self: StaticDecode, ids: list[int], *args: object, **kw: object) -> torch.Tensor:
        out = run(self, ids, *args, **kw)  # type: ignore[arg-type]
        padded.append((len(ids), out.shape[0]))
        return out

    monkeypatch.setattr(StaticDecode, "run", spy)
    assert run_engine(engine, JOIN_AND_LEAVE) == reference(model_dir, JOIN_AND_LEAVE)
    rows = {b for b, _ in padded}
    assert {1, 2, 3, 4} <= rows, f"decode batches seen: {sorted(rows)}"
    assert all(n == b for b, n in padded), "the logits of the real rows only"


def test_rows_past_the_tokenizers_ids_are_never_sampled(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model whose vocabulary has rows past its tokenizer's ids (embeddings padded to a round size),
    those rows made to win every argmax (+-10x copies of the first rows): the engine never samples them,
    where transformers' argmax does, so no request ends on an id the detokenizer cannot decode."""
    size = tokenizer_size(tiny_model_dir)
    assert size is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    k = 32
    model.resize_token_embeddings(size + 2 * k, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[size : size + k] = 10 * head[:k]
        head[size + k :] = -10 * head[:k]
    out = tmp_path / "padded"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, out / name)
    prompt = [FIRST_PLAIN_ID + i for i in range(12)]
    with torch.inference_mode():
        assert int(model(torch.tensor([prompt])).logits[0, -1].argmax()) >= size  # the premise
    engine = drv.make_engine(drv.engine_settings(out, "cpu", "float32", [len(prompt) + 16]))
    assert engine.runner.sampled_vocab == size < engine.runner.vocab_size
    (tokens,), _ = drv.generate(engine, [prompt], [16])
    assert len(tokens) == 16 and max(tokens) < size, tokens
