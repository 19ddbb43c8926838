"""`sluice bench engine`: the engine against transformers on one fixed workload, in one process: per
`--concurrency` every method timed and its greedy outputs checked against hf-sequential's
(docs/benchmarks.md; decode-only steps against the memory roofline: scripts/decode_roofline.py). Exit status
0 when every method ran, 1 when one failed, 2 on bad arguments. The command's other variants over the same
driver: `sluice bench engine latency` (speculation and quantized weights; also `sluice bench latency`) and
`sluice bench engine perplexity`.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from sluice.bench import report
from sluice.bench.common import (
    add_flags,
    error_text,
    int_range,
    names,
    positive_list,
    progress_bar,
    quiet_torch,
    resolve_device,
    run_meta,
)
from sluice.bench.engine_driver import Progress, on_cuda, release_memory
from sluice.bench.engine_methods import (
    ALL_METHODS,
    DEFAULT_METHODS,
    EAGER,
    NOT_ON_CPU,
    BenchContext,
    MethodResult,
    Workload,
    load_hf_model,
    make_workload,
    run_hf_sequential,
    run_hf_static,
    run_sluice,
)
from sluice.bench.report import write_json
from sluice.model.presets import PRESET_NAMES, TINY, preset_model_dir

DEFAULTS = {  # option: (with --quick, without)
    "concurrency": ((4,), (64,)),
    "prompt_len": ((16, 48), (16, 256)),
    "output_len": ((8, 24), (8, 256)),
}
GPU_MODEL_CONCURRENCY = (64, 256)  # the default on CUDA for every model but the tiny one
VARIANTS = ("throughput", "latency", "perplexity")  # `sluice bench engine [VARIANT]`; throughput the default
DESCRIPTIONS = {  # variant → its --help description
    "throughput": "Time the sluice engine's batching policies against transformers on one fixed workload. "
    "Variants: `sluice bench engine [throughput]` (this), `... latency`, `... perplexity` (--help each).",
    "latency": "Batch-1 and loaded tokens/s and TTFT of speculative decoding and quantized weights.",
    "perplexity": "Perplexity on held-out text of the unquantized model and each quantization asked for.",
}
RUN_HELP = {  # variant → --preset's help and rewordings of the shared flags
    "throughput": {
        "preset": "the model: the tiny Llama (default), its MoE sibling tiny-moe, or random weights in a "
        "real model's shape (cached)",
        "dtype": "every method's dtype (default float32; bfloat16 on CUDA for a model other than tiny)",
        "repeat": "run each method N times, report its fastest",
        "quick": "a small workload (4 short requests) for smoke tests",
    },
    "latency": {
        "preset": "random weights in a model's shape (default: the embedded chat model)",
        "dtype": "the engines' dtype (default float32 on CPU, bfloat16 on CUDA)",
        "repeat": "N rounds of every measurement, the best kept",
        "quick": "tiny counts (2 / 4 requests, 12 tokens) for smoke tests",
    },
}


def build_parser(variant: str = "throughput", prog: str = "sluice bench engine") -> argparse.ArgumentParser:
    """The one parser of every variant: the model (--preset or --model), the variant's own flags, then the
    run's (seed, device, dtype, json, threads, repeat, quick, no-progress)."""
    from sluice.bench import latency

    kind = "throughput" if variant == "throughput" else "latency"
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTIONS[variant])
    model = parser.add_mutually_exclusive_group()
    preset = TINY if kind == "throughput" else None
    model.add_argument("--preset", default=preset, choices=PRESET_NAMES, help=RUN_HELP[kind]["preset"])
    add_flags(model, "model", model="a local Hugging Face model")
    (_add_throughput_flags if kind == "throughput" else latency.add_variant_flags)(parser)
    flags = ("seed", "device", "dtype", "json", "threads", "repeat", "quick", "no-progress")
    add_flags(parser, *flags, **RUN_HELP[kind])
    return parser


def _add_throughput_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    about = "requests arriving at once, one workload per value (default 64; 64,256 on CUDA but for tiny)"
    add("--concurrency", type=positive_list, metavar="LIST", help=about)
    about = f"comma list of {','.join(ALL_METHODS)} (default: all; {EAGER} on CUDA only)"
    add("--methods", type=names(ALL_METHODS, "method(s)"), metavar="LIST", help=about)
    add("--prompt-len", type=int_range, metavar="MIN,MAX", help="prompt tokens (default 16,256)")
    add("--output-len", type=int_range, metavar="MIN,MAX", help="output tokens (default 8,256)")


def resolve(args: argparse.Namespace, defaults: dict[str, tuple[Any, Any]], real_model: bool) -> bool:
    """What every variant resolves: the device (returns whether it is CUDA), the dtype (bfloat16 on CUDA
    for a `real_model`, else float32), the unset options of `defaults` (option → (with --quick, without))
    and --model's directory. ValueError names a bad option."""
    cuda = resolve_device(args)
    if args.dtype is None:
        args.dtype = "bfloat16" if cuda and real_model else "float32"
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.model is not None and not (args.model / "config.json").is_file():
        raise ValueError(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    return cuda


def _resolve(args: argparse.Namespace) -> None:
    """The throughput variant's options: on CUDA, for a model other than tiny, bfloat16 and 64,256
    requests; the quick or full defaults; the methods by device."""
    real_model = args.model is not None or args.preset != TINY
    if args.concurrency is None and real_model and resolve_device(args) and not args.quick:
        args.concurrency = GPU_MODEL_CONCURRENCY
    resolve(args, DEFAULTS, real_model)
    if args.methods is None:
        args.methods = ALL_METHODS if on_cuda(args.device) else DEFAULT_METHODS


HF_RUNNERS = {"hf-sequential": run_hf_sequential, "hf-static": run_hf_static}


def _runner(name: str, ctx: BenchContext, work: Workload) -> Callable[[Progress], MethodResult]:
    """A callable that runs method `name` (a transformers method on its own model load), reporting
    delivered tokens to the progress callback."""
    if name in HF_RUNNERS:
        return lambda progress: HF_RUNNERS[name](ctx, load_hf_model(ctx), work, progress)
    if name == EAGER:
        return lambda progress: run_sluice(ctx, work, "continuous", progress, cuda_graphs="off")
    batching = name.removeprefix("sluice-")
    return lambda progress: run_sluice(ctx, work, batching, progress)


def run_methods(
    ctx: BenchContext, work: Workload, methods: tuple[str, ...], repeat: int, show_progress: bool
) -> tuple[dict[str, MethodResult], dict[str, str], dict[str, str]]:
    """Runs each method `repeat` times in order and keeps its fastest run; a method that raises is recorded
    in the errors and the others go on. Returns the results, the errors and the methods skipped with why
    (NOT_ON_CPU: the eager engine on a CPU). Each transformers method loads its own model; each method's
    memory is released before the next."""
    results: dict[str, MethodResult] = {}
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for k, name in enumerate(methods, 1):
        if name == EAGER and not on_cuda(ctx.device):
            skipped[name] = NOT_ON_CPU
            continue
        bar = progress_bar(show_progress, work.total_output_tokens * repeat, f"[{k}/{len(methods)}] {name}")
        try:
            runner = _runner(name, ctx, work)
            with bar:
                runs = [runner(bar.update) for _ in range(repeat)]
            best = max(runs, key=lambda r: r.tokens_per_s)
            best.runs_tokens_per_s = [r.tokens_per_s for r in runs]
            results[name] = best
        except Exception as exc:
            errors[name] = error_text(exc)
        finally:
            release_memory(ctx.device)
    return results, errors, skipped


def model_label(args: argparse.Namespace) -> str:
    return args.model.name if args.model is not None else args.preset or "embedded chat model"


def model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """--model, the preset's random weights (cached, else written under `scratch`), or the embedded model."""
    if args.model is not None:
        return args.model
    if args.preset is not None:
        return preset_model_dir(args.preset, args.dtype, args.seed, scratch)
    from services.common.models import resolve_model_dir

    return resolve_model_dir("")


def main(argv: list[str], prog: str | None = None) -> int:
    """`sluice bench engine [VARIANT] [FLAGS]`, the one driver of every variant: parses and resolves the
    flags, quiets torch, starts the run's metadata and a scratch folder for preset weights, then runs the
    variant (throughput here; latency and perplexity in latency.py) and returns its exit status. `prog`:
    the command as typed when an older name stands for a variant (`sluice bench latency`)."""
    from sluice.bench import latency

    variant = argv[0] if argv and argv[0] in VARIANTS else VARIANTS[0]
    argv = argv[1:] if argv and argv[0] in VARIANTS else argv
    prog = prog or " ".join(["sluice bench engine", *([variant] if variant != VARIANTS[0] else [])])
    parser = build_parser(variant, prog)
    args = parser.parse_args(argv)
    try:
        _resolve(args) if variant == VARIANTS[0] else latency.resolve_variant(args)
    except ValueError as exc:
        parser.error(str(exc))
    quiet_torch(args.threads)
    meta = run_meta([*prog.split()[2:], *argv], args.device)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        if variant != VARIANTS[0]:
            return latency.run(args, variant, meta, model_label(args), Path(tmp))
        return _run_throughput(args, meta, Path(tmp))


def _run_throughput(args: argparse.Namespace, meta: dict[str, Any], scratch: Path) -> int:
    """Every concurrency's block of methods (the JSON rewritten after each), then the report."""
    label = model_label(args)
    meta.update(model=label, dtype=args.dtype, repeat=args.repeat)
    print(f"model: {label}, {args.dtype}; concurrency {','.join(map(str, args.concurrency))}")
    print(f"machine: {meta['machine']}")
    path = model_dir(args, scratch)
    config = AutoConfig.from_pretrained(path)
    ctx = BenchContext(path, args.device, args.dtype)
    blocks: list[report.Block] = []
    for concurrency in args.concurrency:
        blocks.append(run_block(args, ctx, config, label, concurrency))
        # The blocks so far (`"partial": true`): a run stopped by a time limit keeps its finished figures.
        write_json(args.json, report.engine_json_runs(blocks, {**meta, "partial": True}))
    return _report(args, meta, blocks)


def run_block(
    args: argparse.Namespace, ctx: BenchContext, config: PretrainedConfig, label: str, concurrency: int
) -> report.Block:
    """Every method on the workload of `concurrency` requests arriving at once."""
    work = make_workload(concurrency, args.seed, config.vocab_size, args.prompt_len, args.output_len)
    described = work.describe(args.prompt_len, args.output_len, args.seed)
    print(f"== {label}, {concurrency} requests at once: {described}")
    results, errors, skipped = run_methods(ctx, work, args.methods, args.repeat, not args.no_progress)
    return report.Block(label, concurrency, work, described, results, errors, skipped)


def _report(args: argparse.Namespace, meta: dict[str, Any], blocks: list[report.Block]) -> int:
    """Prints each concurrency's table and the ratios, writes the JSON; returns the exit
    status."""
    ratios = [r for b in blocks for r in b.ratios()]
    for text in map(report.format_block, blocks):
        print(f"\n{text}")
    if args.repeat > 1:
        print(f"each method ran {args.repeat} times; its fastest run is shown (all runs in the JSON)")
    print("ratios:")
    print("\n".join(r.line() for r in ratios))
    write_json(args.json, report.engine_json_runs(blocks, meta), announce=True)
    return 1 if any(b.errors for b in blocks) else 0
