"""Linear layers on oneDNN's prepacked weights, on a CPU (`--cpu-linear`).

`pack_linears(model, mode, ...)` replaces each `nn.Linear` by a `PackedLinear` (its weight reordered once into
oneDNN's blocked layout, the dense one dropped but by small layers: `DENSE_MAX_ELEMENTS`) and a tied lm_head
by a `SharedLinear` (the shared weight, a packed copy when small). Steps of fewer than FEW_ROWS rows run on
the C++ kernel `linear_rows` (kernels/cpu_kernels.py; torch's GEMM where it is not built); oneDNN keeps a
kernel per input shape, so its rows go in padded to a few sizes (`row_bucket`), in pieces of `MAX_ROWS`. In
a compiled step a layer is the opaque custom op `sluice::packed_linear` (or `sluice::linear_rows`), so
inductor fuses what lies between the products. Modes: auto (the default) packs on a CPU where torch has
oneDNN, for fp32 or bf16 weights without quantization; onednn does the same, else raises ValueError; torch
never packs. Why, and the measurements: docs/architecture.md ("Where the cycles go").
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.executor.kernels import cpu_kernels
from services.engine.settings import CPU_LINEAR_MODES as MODES

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)


# A weight of at most this many elements also keeps its dense copy, which steps of fewer than FEW_ROWS
# rows multiply with the C++ kernel `linear_rows` (before it, torch's GEMM): with two threads waiting
# passively (as `sluice up` runs them), oneDNN's parallel region around a small matrix-vector product cost
# more than the product (tiny model, batch 1: 8.0-8.7 ms a step against 3.6-5.4 on torch's GEMM; one
# 256 x 704 weight, two threads: 66 µs against 13). Larger weights go to oneDNN at any row count: from
# 1024 x 1024 on, torch's matrix-vector product reads the weight at about 20 GB/s, oneDNN's at 35-47
# (h1024's batch-1 step 19-21 -> 16-17 ms when this limit went from 2^20 to 2^19).
DENSE_MAX_ELEMENTS = 1 << 19
FEW_ROWS = 8
MAX_ROWS = 2048  # rows of one oneDNN call (the default step budget); more go in pieces


def row_bucket(n: int) -> int:
    """The padded row count for n rows (1 <= n <= MAX_ROWS): n itself up to 16 (batch-1 and small decode
    steps pay nothing), a multiple of 8 up to 64, eight sizes an octave up to 256 (72, 80, ... 128, 144,
    ... 256), then four (320, 384, 448, 512, 640, ... 2,048): at most 7 padding rows, 1/8 of them up to
    256, 1/4 past it. A padding row costs about what a real one does (tiny model's shapes, 57 rows run as
    64: +9-13%); steps past 256 rows are mostly prefill chunks, which fill the step's budget exactly."""
    if n <= 16:
        return n
    per_octave = 8 if n <= 256 else 4
    step = 8 if n <= 64 else (1 << (n - 1).bit_length()) // (2 * per_octave)
    return -(-n // step) * step


ROW_BUCKETS = sorted({row_bucket(n) for n in range(1, MAX_ROWS + 1)})


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's x W^T + b, W as `_reorder_linear_weight` packed it: (rows, in) -> (rows, out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("sluice::linear_rows", mutates_args=())
def linear_rows_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The C++ kernel's x W^T + b: (n, in) -> (n, out), a new tensor (W contiguous, one dtype); what a
    compiled step calls (a traced graph cannot call the module's function itself)."""
    module = cpu_kernels.load()
    assert module is not None, "linear_rows_op without the CPU kernels"
    return module.linear_rows(x, weight, bias)


@linear_rows_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def rows_kernel(weight: torch.Tensor | None) -> Callable[..., torch.Tensor] | None:
    """The C++ kernel's `linear_rows(x, W, b)` for steps of few rows on `weight` (dense, (out, in)), or None
    where it does not run: not built, another dtype, a non-contiguous weight."""
    if weight is None or weight.dtype not in DTYPES or not weight.is_contiguous():
        return None
    module = cpu_kernels.load()
    return None if module is None else module.linear_rows


# Every PackedLinear of the process by its number: what the custom op multiplies by (a packed weight is an
# opaque oneDNN tensor, which a traced graph cannot take as an input).
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


@torch.library.custom_op("sluice::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, layer: int) -> torch.Tensor:
    """PackedLinear number `layer` of x: (..., in) -> (..., out), a new tensor."""
    return _LAYERS[layer].product(x)


@packed_linear_op.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[layer].out_features))


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight in oneDNN's layout: y = x W^T + b for x (..., in_features); a
    small weight's steps of few rows on its dense copy (DENSE_MAX_ELEMENTS, FEW_ROWS). Traced by
    torch.compile, the layer is the custom op `sluice::packed_linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.number = next(_NUMBERS)
        _LAYERS[self.number] = self
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # (out, in) in oneDNN's blocked layout; a buffer, as the weight is no longer a dense tensor.
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        small = weight.numel() <= DENSE_MAX_ELEMENTS
        self.register_buffer("dense", weight if small else None)
        self.rows_kernel = rows_kernel(self.dense)  # for steps of few rows; None: torch's GEMM
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear_op(x, self.number)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b: (..., in_features) -> (..., out_features)."""
        if self.dense is not None and x.numel() < FEW_ROWS * self.in_features:
            if self.rows_kernel is None:
                return F.linear(x, self.dense, self.bias)
            y = self.rows_kernel(x.reshape(-1, self.in_features), self.dense, self.bias)  # (n, out)
            return y.view(*x.shape[:-1], self.out_features)
        rows = x.reshape(-1, self.in_features)  # (n, in)
        n = rows.shape[0]
        if n <= MAX_ROWS:
            y = self._padded(rows)
        else:
            y = rows.new_empty(n, self.out_features)  # (n, out), filled piece by piece
            for start in range(0, n, MAX_ROWS):
                y[start : start + MAX_ROWS] = self._padded(rows[start : start + MAX_ROWS])
        return y.view(*x.shape[:-1], self.out_features)

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        """oneDNN's product of n <= MAX_ROWS rows, run on row_bucket(n) rows: (n, in) -> (n, out)."""
        n, bucket = rows.shape[0], row_bucket(rows.shape[0])
        padded = F.pad(rows, (0, 0, 0, bucket - n)) if bucket > n else rows  # (bucket, in)
        return onednn_linear(padded, self.weight, self.bias)[:n]

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


# A tied lm_head of at most this many elements also gets a packed copy for steps of FEW_ROWS rows or more
# (64 MB in fp32): oneDNN multiplies the tiny model's 4096 x 256 head at 8-128 rows 1.4-2.3x faster than
# torch's GEMM (64 rows, weight out of cache: 1.5 against 2.7 ms). A larger head stays on torch's GEMM
# rather than take a second copy of its size.
TIED_PACK_MAX_ELEMENTS = 1 << 24


class SharedLinear(nn.Linear):
    """A linear layer whose weight another module shares (a tied lm_head): the weight stays dense and
    shared; steps of few rows on the C++ kernel, others on a packed copy (`packed`, a PackedLinear) when
    the weight has at most TIED_PACK_MAX_ELEMENTS, else on torch's GEMM. Still an `nn.Linear` to whoever
    asks."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # nn.Linear's own would allocate a weight: this one takes `linear`'s
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the shared Parameter itself: the tie holds
        self.bias = linear.bias
        self.rows_kernel = rows_kernel(self.weight.detach())
        small = linear.weight.numel() <= TIED_PACK_MAX_ELEMENTS
        self.packed = PackedLinear(linear) if small else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and x.numel() < FEW_ROWS * self.in_features:
            rows = x.reshape(-1, self.in_features)  # (n, in)
            if torch.compiler.is_compiling():
                y = linear_rows_op(rows, self.weight, self.bias)
            else:  # the op's dispatch costs as much as a small product: eager calls the kernel itself
                y = self.rows_kernel(rows, self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        copy = ", packed copy" if self.packed is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, shared weight{copy}"


def why_not(mode: str, device: torch.device, dtype: torch.dtype, quantization: str) -> str:
    """Why `mode` packs nothing here ("" when it packs). Raises ValueError for an unknown mode, and for
    onednn where it cannot run (the reason in the message)."""
    if mode not in MODES:
        raise ValueError(f"cpu_linear must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "torch":
        return "cpu_linear torch"
    reason = ""
    if device.type != "cpu":
        reason = f"the device is {device.type}"
    elif not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        reason = "this torch has no oneDNN"
    elif dtype not in DTYPES:
        reason = f"{dtype} weights (oneDNN's linear here: float32, bfloat16)"
    elif quantization != "none":
        reason = f"quantization {quantization} has its own linear layers"
    if reason and mode == "onednn":
        raise ValueError(f"cpu_linear onednn cannot run here: {reason}")
    return reason


def pack_linears(
    model: nn.Module,
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str,
) -> int:
    """Replaces `model`'s linear layers by `PackedLinear`s where `mode` asks for it (see `why_not`) and
    returns how many; logs the count or the reason for none."""
    reason = why_not(mode, device, dtype, quantization)
    if reason:
        log.info("linear layers: torch's (%s)", reason)
        return 0
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    linears = [
        (name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m.weight.dtype in DTYPES
    ]
    shared = 0
    for name, linear in linears:
        if uses[id(linear.weight)] == 1:
            model.set_submodule(name, PackedLinear(linear))
        else:
            model.set_submodule(name, SharedLinear(linear))
            shared += 1
    built = cpu_kernels.load() is not None
    kernel = "the C++ kernel" if built else "torch's GEMM (the CPU kernels are not built)"
    log.info(
        "linear layers: %d on oneDNN's prepacked weights, %d sharing their weight kept dense (a packed copy "
        "up to %d elements); steps of few rows on %s",
        len(linears) - shared,
        shared,
        TIED_PACK_MAX_ELEMENTS,
        kernel,
    )
    return len(linears) - shared
