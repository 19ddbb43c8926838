"""Quantized weights: int8 weight-only (every linear layer, CPU and CUDA) and fp8 (CUDA 8.9+ only).

int8 stores each weight as int8 with one fp32-derived scale per output channel. Steps of few rows take
oneDNN's int8 matmul on two int8 limbs of the activations (layers at least ONEDNN_MIN_OUT wide, on a CPU
with VNNI) or the int8pack kernel on bf16 activations; larger steps a bf16 matmul. The error against fp32,
relative to a logits row's scale (largest |logit|), measured on CPU on the tiny llama here: 0.017 over 8
rows (int8pack layers and a oneDNN lm_head), 0.037 over 48 rows (bf16 matmul, whose outputs are bf16
too). The bound 0.07 still fails when one output channel of one layer has its scale doubled (0.11 and
0.15).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from services.engine.core.engine import LLMEngine
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.executor import quantization
from services.engine.executor.quantization import (
    FEW_ROWS,
    KERNELS,
    ONEDNN_MIN_OUT,
    ONEDNN_MIN_WEIGHTS,
    ONEDNN_MIN_WEIGHTS_THREADED,
    Int8Linear,
    few_row_kernel,
    int8_per_channel,
    int8pack_supported,
    onednn_int8_supported,
    quantize_model,
)
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE, VOCAB, make_model_dir

DEVICE = torch.device(TEST_DEVICE)
MAX_REL = 0.07  # |int8 - fp32| / row scale, see the module docstring
CLEAR_MARGIN = 0.1  # rows whose fp32 top-2 gap exceeds this × scale must keep their argmax


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tied"), "qwen2", tie_word_embeddings=True)


def load(model_dir: Path) -> nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE)
    return model.eval()


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_int8_replaces_every_linear_with_int8_weights_a_quarter_of_the_bytes(llama_dir: Path) -> None:
    model = load(llama_dir)
    before = linears(model)
    assert len(before) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
    fp32_bytes = sum(m.weight.numel() * m.weight.element_size() for m in before.values())
    assert quantize_model(model, "int8", DEVICE) == len(before)
    assert not linears(model), "no nn.Linear may remain"
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert set(quantized) == set(before)
    for name, m in quantized.items():
        assert m.qweight.dtype == torch.int8
        assert tuple(m.qweight.shape) == tuple(before[name].weight.shape)
    int8_bytes = sum(m.qweight.numel() * m.qweight.element_size() for m in quantized.values())
    assert int8_bytes * 4 == fp32_bytes


def test_a_tied_lm_head_gets_its_own_int8_copy_and_the_embedding_stays(tied_dir: Path) -> None:
    model = load(tied_dir)
    embedding = model.get_input_embeddings().weight
    assert model.lm_head.weight is embedding  # tied before
    saved = embedding.detach().clone()
    quantize_model(model, "int8", DEVICE)
    assert isinstance(model.lm_head, Int8Linear)
    after = model.get_input_embeddings().weight
    assert after.dtype == torch.float32 and torch.equal(after, saved)
    assert model.lm_head.qweight.data_ptr() != after.data_ptr()


@pytest.mark.parametrize(
    ("rows", "min_weights"),
    [(8, ONEDNN_MIN_WEIGHTS), (8, 0), (48, ONEDNN_MIN_WEIGHTS)],
    ids=["few-rows", "few-rows-onednn-where-wide", "bf16-matmul-rows"],
)
def test_int8_logits_are_close_to_fp32_and_keep_every_clear_argmax(
    llama_dir: Path, rows: int, min_weights: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Teacher-forced: one forward over `rows` tokens (fewer than 16 rows take the few-row kernels on
    CPU, more the bf16 matmul). The test model's layers are too small for oneDNN's kernel; with the size
    floor lifted, its lm_head (384 wide) takes it."""
    monkeypatch.setattr(quantization, "ONEDNN_MIN_WEIGHTS", min_weights)
    monkeypatch.setattr(quantization, "ONEDNN_MIN_WEIGHTS_THREADED", min_weights)
    ref_model = load(llama_dir)
    model = copy.deepcopy(ref_model)
    quantize_model(model, "int8", DEVICE)
    if min_weights == 0 and _kernel_available("onednn"):
        assert model.lm_head.kernel == "onednn"
    ids = torch.randint(3, VOCAB, (1, rows), generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    with torch.inference_mode():
        ref = ref_model(input_ids=ids).logits[0].float()
        got = model(input_ids=ids).logits[0].float()
    scale = ref.abs().amax(dim=-1)
    rel = ((got - ref).abs().amax(dim=-1) / scale).max().item()
    assert rel < MAX_REL, rel
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN * scale
    assert clear.sum() >= rows // 4, "the model must have rows with a clear argmax"
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def _kernel_available(kernel: str) -> bool:
    if kernel == "onednn":
        return DEVICE.type == "cpu" and onednn_int8_supported()
    if kernel == "int8pack":
        return int8pack_supported(DEVICE, torch.bfloat16)
    return True


def _int8_linear(kernel: str, in_features: int, out_features: int, seed: int) -> Int8Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.empty((out_features, in_features)).normal_(0.0, 0.1, generator=gen)
    bias = torch.empty(out_features).normal_(0.0, 0.1, generator=gen)
    qdata, scale = int8_per_channel(weight)
    return Int8Linear(qdata.to(DEVICE), scale.to(torch.bfloat16).to(DEVICE), bias.to(DEVICE), kernel)


def _dequantized_matmul(m: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    return x.double() @ (m.qweight.double() * m.scale.double()[:, None]).T + m.bias.double()


@pytest.mark.parametrize("rows", [1, 15, 16, 40])
def test_quantize_model_keeps_the_dequantized_matmul(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 80, bias=True)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.1, generator=gen)
        linear.bias.normal_(0.0, 0.1, generator=gen)
    holder = nn.Sequential(linear).to(DEVICE)
    quantize_model(holder, "int8", DEVICE)
    m = holder[0]
    assert isinstance(m, Int8Linear)
    x = torch.randn((2, rows, 96), generator=gen).to(DEVICE)
    want = _dequantized_matmul(m, x)
    got = m(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    # bf16 activations: each product rounded at 2^-9 relative, summed over 96 terms.
    assert (got.double() - want).abs().max().item() < 0.02 * want.abs().max().item()
    dequantized = m.qweight.float() * m.scale.float()[:, None]
    assert (dequantized - linear.weight).abs().max().item() <= linear.weight.abs().max().item() / 127


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS - 1, FEW_ROWS, 40])
def test_every_kernel_computes_the_dequantized_matmul(kernel: str, rows: int) -> None:
    """Each few-row kernel (and the bf16 matmul of larger steps) against the float64 matmul of the
    dequantized weight. The two-limb oneDNN kernel keeps the activations to max|x| / 64,516 per element:
    its bound is 100x tighter than bf16's."""
    if not _kernel_available(kernel):
        pytest.skip(f"the {kernel} kernel does not run on {DEVICE}")
    m = _int8_linear(kernel, 320, 2 * ONEDNN_MIN_OUT, seed=rows)
    x = torch.randn((1, rows, 320), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    want = _dequantized_matmul(m, x)
    got = m(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    few_rows_on_onednn = kernel == "onednn" and rows < FEW_ROWS
    assert err < (2e-4 if few_rows_on_onednn else 0.02), err


@pytest.mark.skipif(not _kernel_available("onednn"), reason="oneDNN's int8 matmul needs a CPU with VNNI")
def test_the_two_limb_kernel_keeps_small_activations_beside_an_outlier() -> None:
    """One activation 1,000x the others: with one int8 limb (scale = outlier / 127) every small entry
    would round to zero; the second limb keeps them. Zero rows give zero outputs, not NaN."""
    m = _int8_linear("onednn", 256, ONEDNN_MIN_OUT, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((4, 256), generator=gen) * 0.01
    x[0, 17] = 10.0
    x[1] = 0.0
    got = m(x)
    want = _dequantized_matmul(m, x)
    assert torch.equal(got[1], m.bias), "a zero row is the bias"
    small = x.clone()
    small[0, 17] = 0.0
    signal = _dequantized_matmul(m, small) - m.bias.double()  # the small entries' share of row 0
    err = (got.double() - want)[0].abs().max().item()
    assert err < 0.01 * signal[0].abs().max().item(), (err, signal[0].abs().max().item())


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_each_layer_takes_the_kernel_its_shape_and_device_allow(one_thread: None) -> None:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    pack = "int8pack" if int8pack_supported(cpu, bf16) else "convert"
    onednn = "onednn" if onednn_int8_supported() else pack
    deep = ONEDNN_MIN_WEIGHTS // (ONEDNN_MIN_OUT - 64) + 1  # enough weights even when narrow
    assert few_row_kernel(cpu, bf16, ONEDNN_MIN_OUT - 64, deep) == pack  # too narrow for oneDNN
    shallow = ONEDNN_MIN_WEIGHTS // ONEDNN_MIN_OUT
    assert few_row_kernel(cpu, bf16, ONEDNN_MIN_OUT, shallow) == pack  # too few weights
    large = -(-ONEDNN_MIN_WEIGHTS // ONEDNN_MIN_OUT)
    assert few_row_kernel(cpu, bf16, ONEDNN_MIN_OUT, large) == onednn
    assert few_row_kernel(torch.device("cuda"), bf16, ONEDNN_MIN_OUT, large) == "convert"
    torch.set_num_threads(2)  # with more threads, only layers of the larger floor
    assert few_row_kernel(cpu, bf16, ONEDNN_MIN_OUT, large) == pack
    huge = -(-ONEDNN_MIN_WEIGHTS_THREADED // 4096)
    assert few_row_kernel(cpu, bf16, 4096, huge) == onednn
    assert few_row_kernel(cpu, bf16, 4096, huge - 1) == pack
    with pytest.raises(ValueError, match="kernel must be one of onednn, int8pack, convert"):
        Int8Linear(torch.zeros((4, 4), dtype=torch.int8), torch.ones(4), None, "int4")


def test_unknown_methods_are_refused(llama_dir: Path) -> None:
    model = load(llama_dir)
    with pytest.raises(ValueError, match="quantization must be one of none, int8, fp8, got 'int4'"):
        quantize_model(model, "int4", DEVICE)
    assert quantize_model(model, "none", DEVICE) == 0
    assert len(linears(model)) == 15


def test_an_engine_with_int8_weights_serves_requests_end_to_end(llama_dir: Path) -> None:
    engine = LLMEngine(
        EngineSettings(
            model=str(llama_dir),
            device=TEST_DEVICE,
            dtype="float32",
            quantization="int8",
            num_kv_blocks=32,
            max_num_seqs=8,
            max_model_len=256,
        )
    )
    assert any(isinstance(m, Int8Linear) for m in engine.runner.model.modules())
    prompts = {f"r{i}": [3 + (7 * i + j) % (VOCAB - 3) for j in range(5 + 9 * i)] for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(), StoppingParams(max_new_tokens=6, ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
    assert finished == set(prompts)
    assert all(len(t) == 6 and all(0 <= x < VOCAB for x in t) for t in tokens.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


FP8_MESSAGE = (
    "quantization fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this device is"
)


def _fp8_capable() -> bool:
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) >= (8, 9)


@pytest.mark.skipif(_fp8_capable(), reason="this device runs fp8")
def test_fp8_is_refused_without_a_recent_gpu(llama_dir: Path) -> None:
    model = load(llama_dir)
    with pytest.raises(ValueError, match=r"fp8 needs a CUDA GPU of compute capability 8\.9") as info:
        quantize_model(model, "fp8", DEVICE)
    assert str(info.value).startswith(FP8_MESSAGE)
    if DEVICE.type == "cpu":
        assert str(info.value).endswith("this device is cpu")
    assert len(linears(model)) == 15, "nothing may be changed"


@pytest.mark.skipif(_fp8_capable(), reason="this device runs fp8")
def test_fp8_on_a_device_without_it_stops_the_engine_with_one_line(llama_dir: Path) -> None:
    argv = [sys.executable, "-m", "sluice.cli", "serve", "engine", "--model", str(llama_dir), "--port", "0"]
    argv += ["--device", TEST_DEVICE, "--quantization", "fp8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert FP8_MESSAGE in done.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not _fp8_capable(), reason="fp8 weights need a CUDA GPU of compute capability 8.9+")
def test_fp8_logits_are_close_to_bf16_on_a_recent_gpu(llama_dir: Path) -> None:
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    ref_model = ref_model.to(DEVICE).eval()
    model = copy.deepcopy(ref_model)
    assert quantize_model(model, "fp8", DEVICE) == 15
    ids = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.inference_mode():
        ref = ref_model(input_ids=ids).logits[0].float()
        got = model(input_ids=ids).logits[0].float()
    scale = ref.abs().amax(dim=-1)
    # e4m3 keeps 3 bits of mantissa (2^-4 relative per element) on weights and activations.
    rel = ((got - ref).abs().amax(dim=-1) / scale).max().item()
    assert rel < 0.15, rel
