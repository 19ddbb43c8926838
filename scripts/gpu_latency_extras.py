"""`PYTHONPATH=. python scripts/gpu_latency_extras.py`: the weight formats where weight bytes count, beside
`sluice bench latency`: batch-1 decode (tokens after the first ÷ summed first-to-last times) of the off,
int8 and fp8 (CUDA) engines on `--preset`'s random weights (default qwen2-0.5b), random 64-token prompts,
greedy; then, on CUDA, the KV blocks one budget buys with kv_cache_dtype auto and fp8 on the same model.
Writes `--json` {"shape", "kv_blocks"}; exit status 0 when every variant asked for ran (fp8 on a CPU is
skipped, not failed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import random
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from sluice.bench import engine_driver as drv
from sluice.bench.common import (
    add_count,
    add_flags,
    error_text,
    names,
    positive_float,
    progress_bar,
    quiet_torch,
    run_meta,
)
from sluice.bench.engine import model_dir, resolve
from sluice.bench.engine_methods import BenchContext
from sluice.bench.latency import (
    FIRST_PLAIN_ID,
    LatencyRequest,
    LatencyWorkload,
    RunFigures,
    build_engine,
    faster,
    run_requests,
    warm_up,
)
from sluice.bench.report import OFF, Column, column_table, fmt, ratio, run_json, write_json
from sluice.model.presets import PRESET_NAMES

VARIANTS = (OFF, "int8", "fp8")  # off always runs: the others are set against it
DEFAULTS = {"requests": (1, 2), "output_len": (6, 32)}  # option: (with --quick, without)
PROMPT_LEN = 64


@dataclass
class ShapeRun:
    """Batch-1 decode on a model shape (random weights), per variant."""

    model: str
    dtype: str
    runs: dict[str, RunFigures] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def ratio(self, variant: str) -> float | None:
        run, off = self.runs.get(variant), self.runs.get(OFF)
        return None if run is None or off is None else ratio(run.decode_tok_s, off.decode_tok_s)


@dataclass
class KvBlocks:
    """KV pool blocks at one budget with the model's dtype and with fp8 (CUDA only)."""

    budget_gb: float
    blocks: dict[str, int] = field(default_factory=dict)  # kv_cache_dtype -> num_blocks
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return ratio(self.blocks.get("fp8"), self.blocks.get("auto"))


def _x(value: float | None) -> str:
    return fmt(value, ".2f") + ("x" if value is not None else "")


def format_shape(shape: ShapeRun) -> str:
    columns: list[Column] = [
        ("model", lambda _: shape.model),
        ("variant", lambda item: item[0]),
        ("b1 dec tok/s", lambda item: fmt(item[1].decode_tok_s, ",.2f")),
        ("x off", lambda item: _x(shape.ratio(item[0]))),
        ("b1 TTFT p50 ms", lambda item: fmt(item[1].ttft(0.5) * 1e3, ".1f")),
        ("tokens", lambda item: item[1].output_tokens),
    ]
    text = f"batch-1 decode on {shape.model} ({shape.dtype}, random weights):\n"
    text += column_table(columns, shape.runs.items(), right_from=2)
    return text + "".join(f"\n{shape.model} {v}: no figures ({why})" for v, why in shape.errors.items())


def format_kv(kv: KvBlocks | None) -> str:
    if kv is None:
        return "fp8 KV blocks: not measured (CUDA only)"
    if kv.error:
        return f"fp8 KV blocks: FAILED: {kv.error}"
    shown = ", ".join(f"{k}: {n:,}" for k, n in kv.blocks.items())
    return f"KV blocks at {kv.budget_gb:g} GiB: {shown} ({_x(kv.ratio)})"


def extras_json(shape: ShapeRun, kv: KvBlocks | None, meta: dict[str, Any]) -> dict[str, Any]:
    runs = {v: run_json(r) for v, r in shape.runs.items()}
    ratios = {v: shape.ratio(v) for v in shape.runs}
    doc_shape = {**vars(shape), "runs": runs, "ratios_to_off": ratios}
    return {
        **meta,
        "bench": "latency-extras",
        "shape": doc_shape,
        "kv_blocks": kv and {**vars(kv), "ratio": kv.ratio},
    }


def run_shape(args: argparse.Namespace, path: Path) -> ShapeRun:
    """Batch-1 decode of off and each weight variant asked for, `--repeat` times each, the fastest kept."""
    shape = ShapeRun(args.preset, args.dtype)
    vocab, rng = int(AutoConfig.from_pretrained(path).vocab_size), random.Random(args.seed)
    token = functools.partial(rng.randrange, FIRST_PLAIN_ID, vocab)
    prompts = [tuple(token() for _ in range(PROMPT_LEN)) for _ in range(args.requests)]
    work = LatencyWorkload("random", tuple(LatencyRequest(p, args.output_len) for p in prompts), "random")
    spec = BenchContext(path, args.device, args.dtype, threads=args.threads or 0)
    lengths = [PROMPT_LEN + args.output_len] * args.requests
    print(f"== batch-1 decode on {args.preset}: {', '.join(args.variants)}")
    for variant in args.variants:
        if variant == "fp8" and not args.device.startswith("cuda"):
            shape.errors[variant] = "skipped: CUDA only"
            continue
        total = args.repeat * args.requests * args.output_len
        try:
            with progress_bar(not args.no_progress, total, f"{args.preset} {variant}") as bar:
                eng = build_engine(spec, variant, lengths, 1)
                warm_up(eng, work, 1, tokens=2)
                for _ in range(args.repeat):
                    run = run_requests(eng, work, args.device, bar.update, at_once=False)
                    shape.runs[variant] = faster(shape.runs.get(variant), run, "decode_tok_s")
        except Exception as exc:
            shape.errors[variant] = error_text(exc)
        finally:
            eng = None
            drv.release_memory(args.device)
    return shape


def run_kv_blocks(args: argparse.Namespace, path: Path) -> KvBlocks | None:
    """CUDA: the blocks of one budget with kv_cache_dtype auto and fp8 (engine stats num_blocks)."""
    if not args.device.startswith("cuda"):
        return None
    kv = KvBlocks(args.kv_budget_gb)
    settings = dict(model=str(path), device=args.device, dtype=args.dtype, max_num_seqs=8, cuda_graphs="off")
    for kv_dtype in ("auto", "fp8"):
        try:
            eng = drv.make_engine(**settings, kv_cache_gb=args.kv_budget_gb, kv_cache_dtype=kv_dtype)
            kv.blocks[kv_dtype] = eng.stats().num_blocks
        except Exception as exc:
            kv.error = error_text(exc)
            break
        finally:
            eng = None
            drv.release_memory(args.device)
    return kv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/gpu_latency_extras.py", description=__doc__.split("\n")[0])
    about = "random weights in this model's shape (cached)"
    parser.add_argument("--preset", default="qwen2-0.5b", choices=PRESET_NAMES, help=about)
    about = f"comma list of {', '.join(VARIANTS)} (default: off,int8, and fp8 on CUDA; off always runs)"
    parser.add_argument("--variants", type=names(VARIANTS, "variant(s)"), metavar="LIST", help=about)
    add_count(parser, "--requests", None, "batch-1 requests (default 2)")
    add_count(parser, "--output-len", None, "output tokens per request (default 32)")
    about = "CUDA: the budget at which KV blocks are counted with kv_cache_dtype auto and fp8"
    parser.add_argument("--kv-budget-gb", type=positive_float, default=1.0, metavar="GB", help=about)
    flags = ("seed", "device", "dtype", "json", "threads", "repeat", "quick", "no-progress")
    add_flags(parser, *flags, dtype="the engines' dtype (default float32 on CPU, bfloat16 on CUDA)")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.model = None
    try:
        cuda = resolve(args, DEFAULTS, real_model=True)
    except ValueError as exc:
        parser.error(str(exc))
    wanted = args.variants or (OFF, "int8", *(("fp8",) if cuda else ()))
    args.variants = (OFF, *(v for v in wanted if v != OFF))
    quiet_torch(args.threads)
    meta = {**run_meta([], args.device), "command": shlex.join([parser.prog, *argv])}
    with tempfile.TemporaryDirectory(prefix="sluice-extras-") as tmp:
        path = model_dir(args, Path(tmp))
        shape, kv = run_shape(args, path), run_kv_blocks(args, path)
    print(f"\n{format_shape(shape)}\n\n{format_kv(kv)}")
    write_json(args.json, extras_json(shape, kv, meta), announce=True)
    return (
        1 if any(not why.startswith("skipped") for why in shape.errors.values()) or (kv and kv.error) else 0
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
