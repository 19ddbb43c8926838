"""Quantized weights, applied to a loaded transformers model in place (the model code stays the same).

- int8: weight-only, symmetric, one scale per output channel, computed by torchao
  (`Int8Tensor.from_hp` with `PerRow()`, what `Int8WeightOnlyConfig` stores). Every `nn.Linear` of the
  decoder layers and the lm_head becomes an `Int8Linear`; a tied lm_head gets its own int8 copy and the
  embedding stays as it is. A decode step reads every weight once for a few rows of activations, so its
  time is the time to stream the weights from memory, and the kernel decides how close to the memory's
  rate that is. Steps of fewer than `FEW_ROWS` rows (every decode step of a small batch) take one of two
  CPU kernels, chosen per layer at load:
  - `onednn`: oneDNN's int8 matmul (`onednn::qlinear_pointwise`, VNNI / AMX, the weight prepacked once),
    which multiplies int8 by int8 exactly into int32. To keep the activations' precision (weight-only
    quantization), each activation row x is split into two int8 limbs, x ~ s (a1 + a2 / 254) with s =
    max|x| / 127, a1 = round(x / s), a2 = round(254 (x / s - a1)): both limbs go through the matmul as
    rows of one call (the weight is read once), and the output is s (y1 + y2 / 254). The activation's
    error is at most s / 508 per element (max|x| / 64,516: finer than bf16's 2^-9 relative). Used on a
    CPU with VNNI for layers at least `ONEDNN_MIN_OUT` outputs wide: on narrower ones (and on single-row
    problems, hence never one limb alone) oneDNN picks its reference kernel, 9 ms for a 128 x 896 weight
    against 25 us for int8pack. And only for layers of enough weights: with one torch thread
    `ONEDNN_MIN_WEIGHTS` (smaller ones sit in cache, where the limbs' dozen small ops cost more than
    they save: the embedded model's decode ran 0.65x of int8pack with oneDNN on every layer), with more
    threads `ONEDNN_MIN_WEIGHTS_THREADED`, in practice the lm_head (at two threads oneDNN's few-row
    matmul on the 0.5B shape's 896- and 4864-wide layers ran slower than int8pack).
  - `int8pack`: `torch._weight_int8pack_mm` (bf16 activations, the int8 weight read as is, the scale
    applied by the kernel), for the narrower layers and CPUs without VNNI. It streams int8 weights at
    about 6 GB/s on one core of this project's Xeon, where oneDNN's kernel and fp32 matmuls reach 13.
  Measured on the qwen2-0.5b preset (fp32, batch-1 forward, the variants alternated in one process, 12
  rounds, median ms): one thread, fp32 134.6, int8pack everywhere 96.6 (1.39x), oneDNN on the lm_head
  80.0 (1.68x), oneDNN on every layer from 2^19 weights 67.8 (1.99x); two threads, fp32 108.7, int8pack
  74.0 (1.47x), oneDNN on the lm_head 72.9 (1.49x), on every layer 92.7 (1.17x). This shared host's AMX
  units have slow spells (oneDNN's rate on the lm_head falls from ~13 to ~5 GB/s for a while), which
  the medians include. Larger steps (prefill, big decode batches) convert the weight to bf16 and run a
  bf16 matmul, scaling the output (torchao's eager weight-only linear does the same in the model's dtype).
  torchao's own `Int8WeightOnlyConfig` linear converts the weight to the activation dtype on every call,
  which on a CPU makes an fp32 model's decode slower, not faster. On CUDA every step takes the
  converting path: torch 2.11's CUDA int8pack kernel was slower still on an H200 (896x4864 weight, one
  row, in a CUDA graph: 42 us against 15 us converting and 3.8 us for bf16; batch-1 decode of the
  qwen2-0.5b preset 12.6 ms/token against 4.7 converting and 2.7 bf16). Without a fused kernel
  (torch.compile) int8 only saves memory on a GPU. The `onednn` kernel keeps the prepacked weight beside
  the int8 one (which the large steps convert), so int8 weights take half the bytes of fp32 there, not a
  quarter.
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
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

METHODS = ("none", "int8", "fp8")
FEW_ROWS = 16  # steps of fewer rows take the few-row kernels (measured crossing at ~16 rows on CPU)
ONEDNN_MIN_OUT = 192  # narrower layers fall to oneDNN's reference int8 kernel (see the module docstring)
ONEDNN_MIN_WEIGHTS = 1 << 19  # one thread: smaller weights stay in cache, where the limbs' ops cost more
ONEDNN_MIN_WEIGHTS_THREADED = 1 << 24  # more threads: only the largest layers (the lm_head) gain
LIMB = 254.0  # the second limb counts 1/254ths of the first's unit: |x / s - a1| <= 1/2 -> |a2| <= 127
FP8_MIN_CAPABILITY = (8, 9)
KERNELS = ("onednn", "int8pack", "convert")


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 (N, K) and one scale per output channel.

    `qweight` (N, K) int8, `scale` (N,) in the compute dtype (bf16 for fp32 models, else the model's
    half dtype), `bias` (N,) in the model's dtype or None. `kernel` is the few-row kernel (one of
    KERNELS; see the module docstring); steps of FEW_ROWS rows or more always convert. The output is in
    the input's dtype.
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
    `device` with activations of `dtype` in the matmul: onednn, int8pack or convert (see the module
    docstring). The size floor depends on torch's thread count at the time of the call."""
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
