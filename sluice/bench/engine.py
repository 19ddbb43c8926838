"""`sluice bench engine`: the engine against transformers on one fixed workload, in one process.

Usage: `sluice bench engine [--device cpu|cuda] [--methods a,b] [--json FILE] [--plot FILE] [--quick]`.
Writes a random-weight tiny Llama to a temporary directory, builds the workload (64 requests arriving at
once, prompts 16-256 tokens, outputs 8-256 tokens, fixed seed), times each method on it, checks every
method's greedy outputs against hf-sequential's (near-ties of the reference's logits told apart from real
differences), and prints a table, the greedy check and the targets. Exit status 0 when every method ran,
1 when one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from sluice.bench import engine_report as report
from sluice.bench.engine_methods import (
    ALL_METHODS,
    BenchContext,
    MethodResult,
    Progress,
    load_hf_model,
    reference_logits,
    run_hf_continuous,
    run_hf_sequential,
    run_hf_static,
    run_sluice,
)
from sluice.bench.engine_workload import Workload, bench_model_config, make_workload, write_bench_model

QUICK_DEFAULTS = {"num_requests": 4, "prompt_len": (16, 48), "output_len": (8, 24), "hf_batch_tokens": (256,)}
FULL_DEFAULTS = {
    "num_requests": 64,
    "prompt_len": (16, 256),
    "output_len": (8, 256),
    "hf_batch_tokens": (256, 512, 1024),
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with MIN <= MAX, got {text!r}")
    return values[0], values[1]


def _methods(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in ALL_METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench engine",
        description="Time the sluice engine's batching policies against transformers on one fixed workload.",
    )
    add = parser.add_argument
    add("--num-requests", type=int, default=None, metavar="N", help="requests in the workload (default 64)")
    add("--seed", type=int, default=0, metavar="N", help="seed of the model weights and the workload")
    methods = ",".join(ALL_METHODS)
    add("--methods", type=_methods, default=ALL_METHODS, metavar="LIST", help=f"comma list of {methods}")
    add("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="every method's dtype")
    add("--prompt-len", type=_range, default=None, metavar="MIN,MAX", help="prompt tokens (default 16,256)")
    add("--output-len", type=_range, default=None, metavar="MIN,MAX", help="output tokens (default 8,256)")
    add(
        "--hf-batch-tokens", type=_int_list, default=None, metavar="LIST",
        help="max_batch_tokens settings tried for hf-continuous, best reported (default 256,512,1024)",
    )
    add("--json", type=Path, default=None, metavar="FILE", help="write the figures as JSON here")
    add("--plot", type=Path, default=None, metavar="FILE", help="write a PNG bar chart of tokens/s here")
    add("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    add("--repeat", type=int, default=1, metavar="N", help="run each method N times, report its fastest")
    add("--quick", action="store_true", help="a small workload (4 short requests) for smoke tests")
    add("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def _resolve(args: argparse.Namespace) -> None:
    """Fills unset workload options from the quick or full defaults and picks the device."""
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")


HF_RUNNERS = {
    "hf-sequential": run_hf_sequential,
    "hf-static": run_hf_static,
    "hf-continuous": run_hf_continuous,
}


def _runner(
    name: str, ctx: BenchContext, work: Workload, hf: Callable[[], PreTrainedModel]
) -> Callable[[Progress], MethodResult]:
    """A callable that runs method `name`, reporting delivered tokens to the progress callback."""
    if name in HF_RUNNERS:
        return lambda progress: HF_RUNNERS[name](ctx, hf(), work, progress)
    batching = name.removeprefix("sluice-")
    return lambda progress: run_sluice(ctx, work, batching, progress)


def run_methods(
    ctx: BenchContext, work: Workload, methods: tuple[str, ...], repeat: int, show_progress: bool
) -> tuple[dict[str, MethodResult], dict[str, str]]:
    """Runs each method `repeat` times in order and keeps its fastest run; a method that raises is
    recorded in the errors and the others go on.

    Each transformers method loads its own copy of the model, so no state carries from one to the next.
    """
    results: dict[str, MethodResult] = {}
    errors: dict[str, str] = {}
    for k, name in enumerate(methods, 1):
        passes = (len(ctx.hf_batch_tokens) if name == "hf-continuous" else 1) * repeat
        bar = tqdm(
            total=work.total_output_tokens * passes, desc=f"[{k}/{len(methods)}] {name}", unit="tok",
            disable=not show_progress, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
        )
        progress: Progress = bar.update
        try:
            runner = _runner(name, ctx, work, lambda: load_hf_model(ctx))
            with bar:
                runs = [runner(progress) for _ in range(repeat)]
            best = max(runs, key=lambda r: r.tokens_per_s)
            best.runs_tokens_per_s = [r.tokens_per_s for r in runs]
            results[name] = best
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
    return results, errors


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _resolve(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    vocab = bench_model_config().vocab_size
    work = make_workload(args.num_requests, args.seed, vocab, args.prompt_len, args.output_len)
    meta: dict[str, Any] = {
        "command": "sluice bench engine " + " ".join(argv),
        "workload": work.describe(args.prompt_len, args.output_len, args.seed),
        "dtype": args.dtype,
        "repeat": args.repeat,
        "machine": report.machine_info(args.device),
    }
    print(f"workload: {meta['workload']}")
    print(f"machine: {meta['machine']}")
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        model_dir = write_bench_model(Path(tmp) / "tiny-llama", args.seed)
        ctx = BenchContext(model_dir, args.device, args.dtype, args.hf_batch_tokens)
        results, errors = run_methods(ctx, work, args.methods, args.repeat, not args.no_progress)
        check = check_greedy(ctx, work, results)
    return _report(args, work, meta, results, errors, check)


def check_greedy(
    ctx: BenchContext, work: Workload, results: dict[str, MethodResult]
) -> report.GreedyCheck | None:
    """Every method's greedy outputs against the reference's, judged by the reference's own logits (scored
    after the timed runs); None when the reference did not run."""
    ref = results.get(report.REFERENCE)
    if ref is None:
        return None
    logits = reference_logits(ctx, work, ref.outputs)
    return report.check_greedy(results, logits, report.NEAR_TIE_THRESHOLD[ctx.torch_dtype])


def _report(
    args: argparse.Namespace,
    work: Workload,
    meta: dict[str, Any],
    results: dict[str, MethodResult],
    errors: dict[str, str],
    check: report.GreedyCheck | None,
) -> int:
    """Prints the table, the greedy check and the targets, writes the JSON and the plot; returns the exit
    status."""
    rows = report.build_rows(results, check)
    targets = report.evaluate_targets(results, rows, errors)
    print()
    print(report.format_table(rows, errors, len(work)))
    if check is not None:
        print(report.format_greedy_check(check, rows))
    hf_cb = results.get("hf-continuous")
    if hf_cb is not None:
        tried = ", ".join(f"{s['max_batch_tokens']}: {s['tokens_per_s']:.1f} tok/s" for s in hf_cb.sweep)
        print(f"hf-continuous max_batch_tokens tried ({tried}); best {hf_cb.setting}")
    if args.repeat > 1:
        print(f"each method ran {args.repeat} times; its fastest run is shown (all runs in the JSON)")
    print("targets:")
    for target in targets:
        print(target.line())
    if args.json is not None:
        report.write_json(args.json, report.to_json(rows, errors, targets, meta, check))
        print(f"wrote {args.json}")
    if args.plot is not None and rows:
        title = f"sluice bench engine: {len(work)} requests, {args.device}, {args.dtype}"
        report.write_plot(args.plot, rows, title)
        print(f"wrote {args.plot}")
    return 1 if errors else 0
