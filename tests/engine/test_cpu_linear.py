"""oneDNN's prepacked linear layers (`--cpu-linear`): the same products as `nn.Linear`, which layers are
packed, and when none are; steps of few rows on the C++ kernel `linear_rows`, a tied head's included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.engine.executor import cpu_linear
from services.engine.executor.cpu_linear import PackedLinear, SharedLinear, pack_linears, why_not
from services.engine.executor.kernels import cpu_kernels
from sluice.launcher import parse_args, plan_children

CPU = torch.device("cpu")
HAS_ONEDNN = why_not("auto", CPU, torch.float32, "none") == ""
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN")
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("keeps_dense", [True, False], ids=["small", "large"])
def test_packed_linear_computes_what_linear_does(
    dtype: torch.dtype, bias: bool, keeps_dense: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths of a small weight (dense below FEW_ROWS rows, oneDNN from it on) and a large one's
    (oneDNN at any row count, no dense copy kept)."""
    if not keeps_dense:
        monkeypatch.setattr(cpu_linear, "DENSE_MAX_ELEMENTS", 100)
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=gen))
    packed = PackedLinear(linear)
    assert (packed.dense is not None) == keeps_dense
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for shape in [(1, 96), (7, 96), (cpu_linear.FEW_ROWS, 96), (2, 5, 96), (33, 96)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        with torch.inference_mode():
            want, got = linear(x), packed(x)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    x = torch.randn(96, 4, generator=gen).to(dtype).t()  # a non-contiguous input
    torch.testing.assert_close(packed(x).float(), linear(x).float(), rtol=tol, atol=tol * 10)


def test_row_buckets_are_few_and_pad_little() -> None:
    """Every row count a oneDNN call can see maps to one of a few sizes: up to 16 rows unpadded, then at
    most 7 padding rows up to 64, 1/8 up to 256 and 1/4 past it."""
    assert len(cpu_linear.ROW_BUCKETS) <= 50 and max(cpu_linear.ROW_BUCKETS) == cpu_linear.MAX_ROWS
    for n in range(1, cpu_linear.MAX_ROWS + 1):
        bucket = cpu_linear.row_bucket(n)
        assert bucket in cpu_linear.ROW_BUCKETS and n <= bucket
        allowed = 0 if n <= 16 else 7 if n <= 64 else n // 8 if n <= 256 else n // 4
        assert bucket - n <= allowed, (n, bucket)


@needs_onednn
def test_packed_linear_calls_onednn_on_bucketed_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the row count, oneDNN sees only ROW_BUCKETS rows (so its kernel per shape stays bounded),
    and the product still equals nn.Linear's, across pieces of MAX_ROWS too."""
    seen: set[int] = set()
    real = cpu_linear.onednn_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.add(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_linear, "onednn_linear", recording)
    monkeypatch.setattr(cpu_linear, "DENSE_MAX_ELEMENTS", 100)
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    for n in [1, 5, 17, 57, 65, 200, 256, 257, 300, 700, cpu_linear.MAX_ROWS + 52]:
        x = torch.randn(n, 32, generator=gen)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert seen <= set(cpu_linear.ROW_BUCKETS)
    # 17 -> 24, 57 -> 64, 65 -> 72, 200 -> 208, 257 and 300 -> 320, 700 -> 768; the last in two pieces
    assert seen == {1, 5, 24, 64, 72, 208, 256, 320, 768, cpu_linear.MAX_ROWS, 56}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as many lm_heads are

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


@needs_onednn
def test_pack_linears_packs_all_but_a_tied_head_and_keeps_the_outputs() -> None:
    torch.manual_seed(0)
    model = _Tied().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        want = model(ids)
    assert pack_linears(model, "auto", CPU, torch.float32, "none") == 2
    assert isinstance(model.up, PackedLinear) and isinstance(model.down, PackedLinear)
    assert isinstance(model.head, SharedLinear) and model.head.weight is model.embed.weight
    assert isinstance(model.head, nn.Linear)  # to whoever asks (transformers' output embeddings)
    assert not any(name.startswith(("up.", "down.")) for name, _ in model.named_parameters())
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("device", "dtype", "quantization", "reason"),
    [
        ("cuda", torch.float32, "none", "the device is cuda"),
        ("cpu", torch.float16, "none", "torch.float16 weights"),
        ("cpu", torch.float32, "int8", "quantization int8"),
    ],
)
def test_auto_packs_nothing_where_it_cannot_and_onednn_is_refused_there(
    device: str, dtype: torch.dtype, quantization: str, reason: str
) -> None:
    dev = torch.device(device)
    assert reason in why_not("auto", dev, dtype, quantization)
    with pytest.raises(ValueError, match=f"cpu_linear onednn cannot run here: {reason}"):
        why_not("onednn", dev, dtype, quantization)
    model = nn.Sequential(nn.Linear(4, 4))
    assert pack_linears(model, "auto", dev, dtype, quantization) == 0
    assert isinstance(model[0], nn.Linear)


def test_torch_mode_packs_nothing_and_an_unknown_mode_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    assert pack_linears(model, "torch", CPU, torch.float32, "none") == 0
    assert isinstance(model[0], nn.Linear)
    with pytest.raises(ValueError, match="cpu_linear must be one of auto, onednn, torch"):
        why_not("mkl", CPU, torch.float32, "none")
    assert cpu_linear.MODES == ("auto", "onednn", "torch")


def test_sluice_up_passes_cpu_linear_to_the_engines_only() -> None:
    children = plan_children(parse_args(["--cpu-linear", "torch"]), "/models/m")
    engine = next(c for c in children if c.service == "engine")
    assert engine.flags[list(engine.flags).index("--cpu-linear") + 1] == "torch"
    assert all("--cpu-linear" not in c.flags for c in children if c.service != "engine")
    assert all("--cpu-linear" not in c.flags for c in plan_children(parse_args([]), "/models/m"))
    with pytest.raises(SystemExit):
        parse_args(["--cpu-linear", "mkl"])


@needs_onednn
@pytest.mark.parametrize("keeps_dense", [True, False], ids=["small", "large"])
def test_a_compiled_graph_multiplies_through_the_custom_op(
    keeps_dense: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile the layer is `sluice::packed_linear`, one opaque node (torch.library.opcheck:
    its fake shapes and its schema), and the compiled graph around it computes what the eager layer does."""
    if not keeps_dense:
        monkeypatch.setattr(cpu_linear, "DENSE_MAX_ELEMENTS", 100)
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
    packed = PackedLinear(linear)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    fn = torch.compile(lambda x: torch.relu(packed(x)) * 2.0, backend=backend, fullgraph=True, dynamic=False)
    for rows in (1, 3, 20):
        x = torch.randn(1, rows, 64, generator=gen)
        torch.library.opcheck(cpu_linear.packed_linear_op, (x, packed.number))
        with torch.inference_mode():
            torch.testing.assert_close(fn(x), torch.relu(linear(x)) * 2.0, rtol=1e-5, atol=1e-5)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert "sluice.packed_linear.default" in targets, targets


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rows_kernel_computes_what_linear_does(dtype: torch.dtype) -> None:
    """Every row count up to FEW_ROWS, output sizes that are and are not multiples of 4, with and without
    a bias, a non-contiguous input; a weight large enough to be split over two threads."""
    kernel = cpu_kernels.load().linear_rows
    gen = torch.Generator().manual_seed(2)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows, out, inner, bias in [
            (1, 256, 64, False),
            (3, 130, 96, True),
            (7, 5, 40, True),
            (2, 1024, 1024, True),
        ]:
            x = torch.randn(rows, inner, generator=gen).to(dtype)
            w = torch.randn(out, inner, generator=gen).to(dtype)
            b = torch.randn(out, generator=gen).to(dtype) if bias else None
            want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            got = kernel(x, w, b)
            assert got.shape == (rows, out) and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
        x = torch.randn(64, 3, generator=gen).to(dtype).t()  # (3, 64), not contiguous
        w = torch.randn(8, 64, generator=gen).to(dtype)
        torch.testing.assert_close(
            kernel(x, w, None).float(), x.float() @ w.float().t(), rtol=tol, atol=tol * 10
        )
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(torch.randn(1, 8), torch.randn(4, 8).to(torch.bfloat16), None)


@needs_kernels
def test_the_kernels_spread_over_torchs_threads() -> None:
    """The module is built with OpenMP: a parallel region runs on every intra-op thread (built with the
    SIMD pragmas alone, each region ran on the calling thread, with no error to say so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu_kernels.load().parallel_threads() == 2
    finally:
        torch.set_num_threads(threads)


class _Counting:
    """Wraps a layer's rows kernel, counting its calls."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args: torch.Tensor | None) -> torch.Tensor:
        self.calls += 1
        return self.kernel(*args)  # type: ignore[operator]


@needs_onednn
@needs_kernels
def test_steps_of_few_rows_run_on_the_kernel_and_others_on_onednn() -> None:
    """A small weight's steps of fewer than FEW_ROWS rows go to the kernel (its dense copy), the rest to
    oneDNN; a tied head (SharedLinear) likewise on its shared weight, the rest on its packed copy."""
    torch.manual_seed(0)
    model = _Tied().eval()
    pack_linears(model, "auto", CPU, torch.float32, "none")
    for layer in (model.up, model.head):
        layer.rows_kernel = _Counting(layer.rows_kernel)
    for rows, calls in [(1, 1), (cpu_linear.FEW_ROWS - 1, 2), (cpu_linear.FEW_ROWS, 2), (40, 2)]:
        for layer, inner in ((model.up, model.up.in_features), (model.head, model.head.in_features)):
            x = torch.randn(rows, inner)
            with torch.inference_mode():
                want = torch.nn.functional.linear(x, _weight(layer), layer.bias)
                torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
            assert layer.rows_kernel.calls == calls, (layer, rows)


def _weight(layer: nn.Module) -> torch.Tensor:
    return layer.dense if isinstance(layer, PackedLinear) else layer.weight.detach()


@needs_onednn
def test_without_the_kernels_few_rows_run_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    torch.manual_seed(0)
    model = _Tied().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        want = model(ids)
    pack_linears(model, "auto", CPU, torch.float32, "none")
    assert model.up.rows_kernel is None and model.head.rows_kernel is None
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_compiled_graph_calls_a_shared_heads_kernel_through_its_op() -> None:
    """Under torch.compile a tied head's few-row product is `sluice::linear_rows` (opcheck: fake shapes
    and schema), and the graph computes what the eager layer does."""
    gen = torch.Generator().manual_seed(3)
    embed = nn.Embedding(48, 64)
    head = nn.Linear(64, 48, bias=False)
    head.weight = embed.weight
    shared = SharedLinear(head)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    fn = torch.compile(lambda x: shared(torch.tanh(x)), backend=backend, fullgraph=True, dynamic=False)
    weight = embed.weight.detach()
    for rows in (1, 3, 20):
        x = torch.randn(rows, 64, generator=gen)
        torch.library.opcheck(cpu_linear.linear_rows_op, (x, weight, None))
        with torch.inference_mode():
            torch.testing.assert_close(fn(x), torch.tanh(x) @ weight.t(), rtol=1e-5, atol=1e-5)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert "sluice.linear_rows.default" in targets, targets


@needs_onednn
@pytest.mark.parametrize("small", [True, False], ids=["packed-copy", "torch-gemm"])
def test_a_tied_heads_steps_of_many_rows_go_to_a_packed_copy_when_small(
    small: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied head of at most TIED_PACK_MAX_ELEMENTS gets a packed copy for steps of FEW_ROWS or more
    (oneDNN sees them), a larger one stays on torch's GEMM; the tie holds and the products are equal."""
    calls: list[int] = []
    real = cpu_linear.onednn_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_linear, "onednn_linear", recording)
    if not small:
        monkeypatch.setattr(cpu_linear, "TIED_PACK_MAX_ELEMENTS", 100)
    torch.manual_seed(0)
    model = _Tied().eval()
    pack_linears(model, "auto", CPU, torch.float32, "none")
    head = model.head
    assert isinstance(head, SharedLinear) and head.weight is model.embed.weight
    assert (head.packed is not None) == small
    calls.clear()
    x = torch.randn(40, head.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(head(x), x @ model.embed.weight.detach().t(), rtol=1e-5, atol=1e-5)
    assert calls == ([40] if small else [])
