"""`PYTHONPATH=. .venv/bin/python scripts/step_profile.py`: where an engine step's time goes, in-process,
for decode-only steps at a few batch sizes, eager against compiled (`--compile`) in the same run.

Per (model, batch): one engine per compile mode (engine_driver.py), `batch` requests prefilled with
`--context` tokens, decode steps timed with the modes stepping in turn (medians), then one torch.profiler
pass per mode. Prints one Markdown table of fractions: of a step (scheduler, runner host work, forward,
sampler) and of the forward (GEMMs, attention, other operators, Python and dispatch, per layer), and the
GEMMs' GFLOP/s against torch.mm of the same shapes. docs/architecture.md ("Where the cycles go: one
decode step") explains each column and holds the measured tables.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from services.engine.executor import attention, compiled
from sluice.bench import engine_driver as drv
from sluice.model.presets import FIRST_PLAIN_ID, preset_config, preset_model_dir, write_random_model

H1024 = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
)
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")
# Linear layers as oneDNN runs them once inductor freezes the weights (their time only: packed shapes)
PACKED_GEMMS = ("mkldnn::_linear_pointwise", "mkl::_mkl_linear")
LABELS = ("schedule", "execute", "forward", "sample", "attention")


@contextmanager
def rows_kernel_timed(model: torch.nn.Module, flops: list[float]) -> Iterator[None]:
    """Each linear layer's C++ few-rows kernel (cpu_linear.rows_kernel: a plain function the profiler does
    not see) inside a profiler range "sluice.linear_rows", its FLOPs added to `flops[0]`."""
    layers = [m for m in model.modules() if getattr(m, "rows_kernel", None) is not None]

    def timed(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            flops[0] += 2.0 * x.shape[0] * w.shape[0] * w.shape[1]
            with record_function("sluice.linear_rows"):
                return kernel(x, w, b)

        return run

    originals = [m.rows_kernel for m in layers]
    for layer, kernel in zip(layers, originals, strict=True):
        layer.rows_kernel = timed(kernel)
    try:
        yield
    finally:
        for layer, kernel in zip(layers, originals, strict=True):
            layer.rows_kernel = kernel


def model_dir(shape: str, scratch: Path) -> Path:
    if shape == "tiny":
        return preset_model_dir("tiny", "float32", 0, scratch)
    target = scratch / "h1024-float32-s0"
    if not (target / "config.json").exists():
        write_random_model(preset_config("tiny", **H1024), target, "float32", 0)
    return target


class Timers:
    """Seconds spent in wrapped callables, by label, each call also a profiler range of that label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            with record_function(f"sluice.{label}"):
                out = fn(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - start
            return out

        return timed


@contextmanager
def attention_timed(timers: Timers) -> Iterator[None]:
    """attention.paged_attention (eager, and inside the compiled step's custom op) timed as "attention"."""
    original = attention.paged_attention
    attention.paged_attention = timers.wrap("attention", original)
    try:
        yield
    finally:
        attention.paged_attention = original


def decoding_engine(directory: Path, batch: int, context: int, steps: int, mode: str) -> tuple[Any, Timers]:
    """An engine with `batch` requests prefilled and decoding, its parts wrapped in timers."""
    new_tokens = 8 + steps * 8
    settings = drv.engine_settings(
        directory,
        "cpu",
        "float32",
        [context + new_tokens] * batch,
        max_num_seqs=batch,
        compile=mode,
        max_num_batched_tokens=max(256, batch),
    )
    sizes = compiled.buckets
    compiled.buckets = lambda rows, tokens: [batch]  # one graph: the decode batch measured (prefill eager)
    try:
        engine = drv.make_engine(settings)
    finally:
        compiled.buckets = sizes
    for i in range(batch):
        prompt = [FIRST_PLAIN_ID + (i * 7 + j) % 5000 for j in range(context)]
        engine.add_request(f"r{i}", prompt, drv.greedy(), drv.stop_after(new_tokens))
    while len(engine.scheduler.running) < batch or any(
        r.num_computed_tokens < context for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(4):
        engine.step()
    timers = Timers()
    runner = engine.runner
    engine._schedule = timers.wrap("schedule", engine._schedule)
    runner.execute = timers.wrap("execute", runner.execute)
    runner._forward = timers.wrap("forward", runner._forward)
    engine.sampler.launch = timers.wrap("sample", engine.sampler.launch)
    return engine, timers


def gemm_flops(shapes: list[list[int]], name: str) -> float:
    if name == "aten::addmm":
        shapes = shapes[1:]
    a, b = shapes[0], shapes[1]
    batch = a[0] if name == "aten::bmm" else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def plain_gflops(shape_counts: dict[tuple[int, int, int], int], reps: int = 5) -> float:
    """GFLOP/s of torch.mm on (M, K) x (K, N) with a transposed weight, as F.linear's, over the shapes
    weighted by how often the model ran them."""
    flops = seconds = 0.0
    for (m, k, n), count in shape_counts.items():
        a, w = torch.randn(m, k), torch.randn(n, k)
        torch.mm(a, w.t())
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, w.t())
        seconds += (time.perf_counter() - start) / reps * count
        flops += 2.0 * m * k * n * count
    return flops / seconds / 1e9 if seconds else 0.0


def forward_parts(prof: Any) -> dict[str, Any]:
    """Of the profiled forwards: seconds of GEMMs (self), attention (inclusive), other operators and
    kernels (self, outside attention), the GEMMs' FLOPs and their (M, K, N) shapes."""
    out: dict[str, Any] = {
        "gemm": 0.0,
        "attention": 0.0,
        "ops": 0.0,
        "flops": 0.0,
        "shapes": defaultdict(int),
    }
    for ev in prof.events():
        labels = []
        parent = ev.cpu_parent
        while parent is not None:
            labels.append(parent.name)
            parent = parent.cpu_parent
        if "sluice.forward" not in labels or ev.name.startswith("sluice."):
            if ev.name == "sluice.attention":
                out["attention"] += ev.cpu_time_total / 1e6
            elif ev.name == "sluice.linear_rows" and "sluice.forward" in labels:
                out["gemm"] += ev.cpu_time_total / 1e6  # the few-rows kernel (rows_kernel_timed)
            continue
        if "sluice.attention" in labels:
            continue
        if ev.name in GEMMS and ev.input_shapes and len(ev.input_shapes) >= 2:
            out["gemm"] += ev.self_cpu_time_total / 1e6
            shapes = [s for s in ev.input_shapes if s]
            out["flops"] += gemm_flops(shapes, ev.name)
            if ev.name != "aten::bmm":
                a, b = (shapes[1], shapes[2]) if ev.name == "aten::addmm" else (shapes[0], shapes[1])
                out["shapes"][(a[0], a[1], b[1])] += 1
        elif ev.name in PACKED_GEMMS:
            out["gemm"] += ev.self_cpu_time_total / 1e6
        elif ev.name.startswith(("aten::", "cpp_fused", "sluice::")) or "kernel" in ev.name:
            out["ops"] += ev.self_cpu_time_total / 1e6
    return out


def measure(args: argparse.Namespace, shape: str, batch: int) -> list[dict[str, Any]]:
    directory = model_dir(shape, args.scratch)
    modes = args.compile.split(",")
    engines = {m: decoding_engine(directory, batch, args.context, args.steps, m) for m in modes}
    walls: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds * args.steps):  # the modes step in turn: a load burst falls on both
        for mode, (engine, timers) in engines.items():
            with attention_timed(timers):
                start = time.perf_counter()
                engine.step()
                walls[mode].append(time.perf_counter() - start)
    rows = []
    for mode, (engine, timers) in engines.items():
        steps = args.rounds * args.steps
        sec = {k: v / steps for k, v in timers.seconds.items()}
        kernel_flops = [0.0]
        with (
            profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
            attention_timed(Timers()),
            rows_kernel_timed(engine.runner.model, kernel_flops),
        ):
            for _ in range(args.steps):
                engine.step()
        parts = forward_parts(prof)
        parts["flops"] += kernel_flops[0]
        fwd = sum(e.cpu_time_total for e in prof.events() if e.name == "sluice.forward") / 1e6
        python = max(0.0, fwd - parts["gemm"] - parts["attention"] - parts["ops"])
        step = statistics.median(walls[mode])
        mean = sum(walls[mode]) / steps
        in_model = parts["flops"] / (parts["gemm"] or 1.0) / 1e9
        rows.append(dict(
            shape=shape, batch=batch, mode=mode, step_ms=step * 1e3, tok_s=batch / step,
            schedule=sec["schedule"] / mean, host=(sec["execute"] - sec["forward"]) / mean,
            forward=sec["forward"] / mean, sample=sec["sample"] / mean,
            engine=1 - (sec["schedule"] + sec["execute"] + sec["sample"]) / mean,
            gemm=parts["gemm"] / fwd, attn=parts["attention"] / fwd, ops=parts["ops"] / fwd,
            python=python / fwd,
            python_layer_us=python / args.steps / engine.runner.num_layers * 1e6,
            gemm_ratio=in_model / (plain_gflops(parts["shapes"]) or math.nan), gemm_gflops=in_model,
        ))  # fmt: skip
    base = rows[0]["step_ms"]
    for row in rows:
        row["vs_first"] = base / row["step_ms"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | batch | compile | step ms | tok/s | speed vs first | schedule | runner host | forward | "
        "sampler | engine rest | GEMM | attention | other ops | Python+dispatch | per layer µs | "
        "GEMM GFLOP/s | vs torch.mm |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    for r in rows:
        cells = [
            r["shape"],
            r["batch"],
            r["mode"],
            f"{r['step_ms']:.2f}",
            f"{r['tok_s']:.0f}",
            f"{r['vs_first']:.2f}x",
        ]
        cells += [
            pct(r[k]) for k in ("schedule", "host", "forward", "sample", "engine", "gemm", "attn", "ops")
        ]
        cells += [
            pct(r["python"]),
            f"{r['python_layer_us']:.0f}",
            f"{r['gemm_gflops']:.1f}",
            f"{r['gemm_ratio']:.2f}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/step_profile.py", description=__doc__)
    parser.add_argument("--shapes", default="tiny,h1024", help="tiny | h1024, comma-separated")
    parser.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument(
        "--compile", default="off,on", help="compile modes side by side (the first is the base)"
    )
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, alternated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--scratch", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "sluice-profile"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # fused kernels named in the profile
    load = os.getloadavg()
    rows = [
        r
        for s in args.shapes.split(",")
        for b in map(int, args.batches.split(","))
        for r in measure(args, s, b)
    ]
    print(table(rows))
    print(
        f"\nload average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}; {args.threads} torch threads; "
        f"context {args.context}, {args.rounds} x {args.steps} timed steps per mode"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
