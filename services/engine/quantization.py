"""Quantized weights, applied to a loaded transformers model in place (the model code stays the same).

- int8: weight-only, symmetric, one scale per output channel, computed by torchao
  (`Int8Tensor.from_hp` with `PerRow()`, what `Int8WeightOnlyConfig` stores). Every `nn.Linear` of the
  decoder layers and the lm_head becomes an `Int8Linear`; a tied lm_head gets its own int8 copy and the
  embedding stays as it is. The matmul: `torch._weight_int8pack_mm` (activations in bf16, the int8 weight
  read as is, the per-channel scale applied by the kernel) for steps of fewer than `PACK_MAX_ROWS` rows,
  which is every decode step of a small batch; the kernel's time grows with the rows (it is a
  matrix-vector kernel), so larger steps (prefill, big decode batches) convert the weight to bf16 and run
  a bf16 matmul, scaling the output (torchao's eager weight-only linear does the same in the model's
  dtype). torchao's own `Int8WeightOnlyConfig` linear converts the weight to the activation dtype on every
  call, which on a CPU makes an fp32 model's decode slower, not faster. Batch-1 decode of the qwen2-0.5b
  preset (fp32 model, LLMEngine steps, 2 threads, best of 4 alternated rounds): 100.5 -> 59.1 ms/token
  (1.70x) on an idle Xeon, 85.0 -> 57.9 (1.47x) on this project's shared 2-core machine at load ~0.6.
  On CUDA every step takes the converting path: torch 2.11's CUDA int8pack kernel was slower still on an
  H200 (896x4864 weight, one row, in a CUDA graph: 42 us against 15 us converting and 3.8 us for bf16;
  batch-1 decode of the qwen2-0.5b preset 12.6 ms/token against 4.7 converting and 2.7 bf16). Without a
  fused kernel (torch.compile) int8 only saves memory on a GPU.
- fp8: torchao `Float8DynamicActivationFloat8WeightConfig` with per-row scales: the weights in float8
  e4m3 and each step's activations quantized per row on the fly, the matmul on the fp8 tensor cores
  (`torch._scaled_mm`). torchao's Float8WeightOnlyConfig converts the weight back for every matmul in
  eager mode, as above (H200, qwen2-0.5b preset, batch-1 decode: 7.1 ms/token against 5.6 with dynamic
  activations and 2.7 for bf16: at this size a step is bound by kernel count, and each fp8 linear adds the
  activation's quantization kernels). Needs CUDA compute capability 8.9 or newer (Ada, Hopper); anywhere
  else a ValueError at start-up.

torchao is imported here only when a quantization is asked for (its import looks for CUDA extensions;
transformers imports it anyway when it is installed).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

METHODS = ("none", "int8", "fp8")
PACK_MAX_ROWS = 16  # steps of fewer rows use the int8pack kernel (measured crossing at ~16 rows on CPU)
FP8_MIN_CAPABILITY = (8, 9)


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 (N, K) and one scale per output channel.

    `qweight` (N, K) int8, `scale` (N,) in the compute dtype (bf16 for fp32 models, else the model's
    half dtype), `bias` (N,) in the model's dtype or None. The output is in the input's dtype.
    """

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, use_pack: bool
    ) -> None:
        super().__init__()
        self.in_features = int(qweight.shape[1])
        self.out_features = int(qweight.shape[0])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.use_pack = use_pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype)
        if self.use_pack and flat.shape[0] < PACK_MAX_ROWS:
            y = torch._weight_int8pack_mm(flat.contiguous(), self.qweight, self.scale)
        else:
            y = F.linear(flat, self.qweight.to(self.scale.dtype)) * self.scale
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8pack={self.use_pack}"
        )


def quantize_model(model: nn.Module, method: str, device: torch.device) -> int:
    """Quantizes `model` (already on `device`) in place with `method` (none | int8 | fp8) and returns the
    number of linear layers quantized (0 for none). Raises ValueError for an unknown method, and for fp8
    on a device without float8 tensor cores (the message names the device)."""
    check_quantization(method, device)
    if method == "none":
        return 0
    if method == "fp8":
        return _quantize_fp8(model)
    return _quantize_int8(model, device)


def check_quantization(method: str, device: torch.device) -> None:
    """Raises ValueError when `method` is unknown or cannot run on `device` (fp8 off a recent GPU)."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "fp8":
        check_fp8_device(device)


def check_fp8_device(device: torch.device) -> None:
    """Raises ValueError unless `device` is a CUDA GPU of compute capability 8.9 or newer."""
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability >= FP8_MIN_CAPABILITY:
            return
        where = f"{device} (compute capability {capability[0]}.{capability[1]})"
    else:
        where = str(device.type)
    raise ValueError(
        "quantization fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); "
        f"this device is {where}"
    )


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype in the int8 matmuls: the model's half dtype, else bf16."""
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata int8 (N, K), scale fp32 (N,)) of `weight` (N, K): symmetric, one scale per output channel,
    as torchao's Int8WeightOnlyConfig computes them (weight ≈ qdata * scale[:, None])."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    with torch.no_grad():
        q = Int8Tensor.from_hp(weight.detach(), granularity=PerRow())
    return q.qdata.contiguous(), q.scale.reshape(-1).float()


@functools.cache
def int8pack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._weight_int8pack_mm runs on `device` with activations of `dtype` (probed once)."""
    try:
        x = torch.ones((1, 64), dtype=dtype, device=device)
        w = torch.ones((32, 64), dtype=torch.int8, device=device)
        s = torch.ones((32,), dtype=dtype, device=device)
        y = torch._weight_int8pack_mm(x, w, s)
        return bool(torch.allclose(y.float().cpu(), torch.full((1, 32), 64.0)))
    except (RuntimeError, NotImplementedError) as exc:
        log.info("int8: torch._weight_int8pack_mm does not run on %s %s (%s)", device, dtype, exc)
        return False


def _quantize_int8(model: nn.Module, device: torch.device) -> int:
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not targets:
        return 0
    dtype = compute_dtype(targets[0][1].weight.dtype)
    use_pack = device.type == "cpu" and int8pack_supported(device, dtype)
    for name, linear in targets:
        qdata, scale = int8_per_channel(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        _set_module(model, name, Int8Linear(qdata, scale.to(dtype), bias, use_pack))
    log.info(
        "int8 weight-only: %d linear layers, matmul %s",
        len(targets),
        f"int8pack below {PACK_MAX_ROWS} rows, else bf16" if use_pack else f"{dtype} after conversion",
    )
    return len(targets)


def _quantize_fp8(model: nn.Module) -> int:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    count = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    # A tied lm_head would share its Parameter with the embedding: untie it first so that the embedding
    # keeps its weight when the lm_head's is replaced.
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(head, nn.Linear) and embed is not None and head.weight is embed.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    quantize_(
        model,
        Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        filter_fn=lambda m, _fqn: isinstance(m, nn.Linear),
    )
    log.info("fp8: %d linear layers, float8 e4m3 weights and per-row dynamic activations", count)
    return count


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
