"""Quantized weights, applied to a loaded transformers model in place (the model code stays the same).

`quantize_model(model, method, device)`: "int8" replaces every `nn.Linear` (the lm_head included; a tied
one gets its own copy, the embedding stays) by an `Int8Linear`: weight-only, symmetric, one scale per
output channel (torchao's); "fp8" applies torchao's float8 weights with per-row dynamic activation scales.
`check_quantization` raises ValueError, before the model loads, for an unknown method or fp8 off a CUDA
GPU of capability 8.9 or newer. An `Int8Linear` step under `FEW_ROWS` rows runs the kernel chosen per
layer at load (`few_row_kernel`: `onednn`, oneDNN's int8 matmul on two int8 limbs of each activation
row; `int8pack`; or `convert`, always on CUDA); larger steps convert the weight. torchao is imported only
when a quantization is asked for. Design: docs/architecture.md ("Quantized weights"); kernel choice and
measurements: docs/benchmarks.md ("The int8 kernels").
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

METHODS = ("none", "int8", "fp8")
FEW_ROWS = 16  # steps of fewer rows take the few-row kernels (measured crossing at ~16 rows on CPU)
ONEDNN_MIN_OUT = 192  # narrower layers fall to oneDNN's reference int8 kernel (docs/benchmarks.md)
ONEDNN_MIN_WEIGHTS = 1 << 19  # one thread: smaller weights stay in cache, where the limbs' ops cost more
ONEDNN_MIN_WEIGHTS_THREADED = 1 << 24  # more threads: only the largest layers (the lm_head) gain
LIMB = 254.0  # the second limb counts 1/254ths of the first's unit: |x / s - a1| <= 1/2 -> |a2| <= 127
FP8_MIN_CAPABILITY = (8, 9)
KERNELS = ("onednn", "int8pack", "convert")


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 (N, K) and one scale per output channel.

    `qweight` (N, K) int8, `scale` (N,) in the compute dtype (bf16 for fp32 models, else the model's
    half dtype), `bias` (N,) in the model's dtype or None. `kernel` is the few-row kernel (one of
    KERNELS; docs/benchmarks.md, "The int8 kernels"); steps of FEW_ROWS rows or more always convert.
    The output is in the input's dtype.
    """

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: str
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.in_features = int(qweight.shape[1])
        self.out_features = int(qweight.shape[0])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.kernel = kernel
        if kernel == "onednn":
            # The prepacked weight is an opaque oneDNN tensor: an attribute, not a buffer.
            self.packed = torch.ops.onednn.qlinear_prepack(qweight, [2, self.in_features])
            self.register_buffer("scale32", scale.float())
            self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if flat.shape[0] >= FEW_ROWS or self.kernel == "convert":
            y = F.linear(flat.to(self.scale.dtype), self.qweight.to(self.scale.dtype)) * self.scale
        elif self.kernel == "onednn":
            y = self._two_limb_mm(flat.float())
        else:
            y = torch._weight_int8pack_mm(flat.to(self.scale.dtype).contiguous(), self.qweight, self.scale)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _two_limb_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) fp32 -> (M, N) fp32 through oneDNN's int8 matmul on the two int8 limbs of x."""
        m = x.shape[0]
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)  # (M, 1)
        units = x * (127.0 / amax)  # |units| <= 127
        first = units.round()
        second = (units - first).mul_(LIMB).round_()
        limbs = torch.cat([first, second]).to(torch.int8)  # (2M, K)
        y = onednn_int8_mm(limbs, self.packed, self.scale32, self.zero_points)  # (2M, N)
        return torch.add(y[:m], y[m:], alpha=1.0 / LIMB).mul_(amax * (1.0 / 127.0))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernel={self.kernel}"
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
    if method != "fp8":
        return
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


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata int8 (N, K), scale fp32 (N,)) of `weight` (N, K): symmetric, one scale per output channel,
    as torchao's Int8WeightOnlyConfig computes them (weight ≈ qdata * scale[:, None])."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    with torch.no_grad():
        q = Int8Tensor.from_hp(weight.detach(), granularity=PerRow())
    return q.qdata.contiguous(), q.scale.reshape(-1).float()


def onednn_int8_mm(
    a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """a (M, K) int8 @ W^T * scale -> (M, N) fp32, W (N, K) int8 prepacked by
    `torch.ops.onednn.qlinear_prepack`, scale (N,) fp32, zero_points (N,) int64 zeros. The int32 sums
    are exact; M * N must be large enough for oneDNN's VNNI / AMX kernel (see ONEDNN_MIN_OUT)."""
    args = (1.0, 0, torch.float32, "none", [], "")  # output scale, zero point, dtype, no post-op
    return torch.ops.onednn.qlinear_pointwise(a, 1.0, 0, packed, scale, zero_points, None, *args)


@functools.cache
def onednn_int8_supported() -> bool:
    """Whether this CPU has VNNI and oneDNN's int8 matmul runs and is exact here (probed once)."""
    if not torch.cpu._is_vnni_supported():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (2, 64), dtype=torch.int8, generator=gen)
        w = torch.randint(-127, 128, (ONEDNN_MIN_OUT, 64), dtype=torch.int8, generator=gen)
        packed = torch.ops.onednn.qlinear_prepack(w, [2, 64])
        zeros = torch.zeros(ONEDNN_MIN_OUT, dtype=torch.long)
        y = onednn_int8_mm(a, packed, torch.ones(ONEDNN_MIN_OUT), zeros)
        return bool(torch.equal(y, (a.int() @ w.int().T).float()))
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.info("int8: oneDNN's int8 matmul does not run here (%s)", exc)
        return False


def few_row_kernel(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> str:
    """The kernel of an int8 layer (out_features, in_features) for steps of fewer than FEW_ROWS rows on
    `device` with activations of `dtype` in the matmul: onednn, int8pack or convert (docs/benchmarks.md,
    "The int8 kernels"). The size floor depends on torch's thread count at the time of the call."""
    if device.type != "cpu":
        return "convert"
    floor = ONEDNN_MIN_WEIGHTS if torch.get_num_threads() == 1 else ONEDNN_MIN_WEIGHTS_THREADED
    wide = out_features >= ONEDNN_MIN_OUT and out_features * in_features >= floor
    if wide and onednn_int8_supported():
        return "onednn"
    return "int8pack" if int8pack_supported(device, dtype) else "convert"


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
    # The activations' dtype in the int8 matmuls: the model's half dtype, else bf16.
    model_dtype = targets[0][1].weight.dtype
    dtype = model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    kernels: Counter[str] = Counter()
    for name, linear in targets:
        qdata, scale = int8_per_channel(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        kernel = few_row_kernel(device, dtype, linear.out_features, linear.in_features)
        kernels[kernel] += 1
        model.set_submodule(name, Int8Linear(qdata, scale.to(dtype), bias, kernel))
    log.info(
        "int8 weight-only: %d linear layers; below %d rows %s; else %s after conversion",
        len(targets),
        FEW_ROWS,
        ", ".join(f"{count} {kernel}" for kernel, count in kernels.items()),
        dtype,
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
