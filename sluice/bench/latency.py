"""The latency and perplexity variants of `sluice bench engine` (also `sluice bench latency`): speculative
decoding and quantized weights against the plain engine, one in-process engine per variant at a time
(docs/benchmarks.md describes the stages and figures). Exit status 0 when every variant asked for ran (fp8
on a CPU is skipped, not failed), 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from sluice.bench import engine
from sluice.bench import engine_driver as drv
from sluice.bench import latency_run as lrun
from sluice.bench import perplexity as ppl
from sluice.bench import report as rep
from sluice.bench.common import (
    add_count,
    error_text,
    names,
    positive_float,
    progress_bar,
)
from sluice.bench.latency_run import RunFigures
from sluice.bench.report import write_json
from sluice.model.presets import PRESET_NAMES, preset_model_dir

DEFAULTS = {  # option: (with --quick, without)
    "num_requests": (2, 8),
    "concurrency": (4, 64),
    "output_len": (12, 128),
    "int8_preset": ("none", "qwen2-0.5b"),
    "shape_requests": (1, 2),
    "shape_output_len": (6, 32),
    "perplexity_tokens": (1024, ppl.DEFAULT_MAX_TOKENS),
}
SHAPE_PROMPT_LEN = 64
KV_BUDGET_GB = 1.0
SPEC_FLAGS = (
    "num_speculative_tokens",
    "ngram_min",
    "ngram_max",
    "speculative_disable_batch_size",
    "speculative_min_acceptance",
)


def add_variant_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the latency and perplexity variants (engine.build_parser adds the model and the run's)."""
    add = parser.add_argument
    about = f"comma list of {', '.join(lrun.VARIANTS)} (default: off,ngram,int8, and fp8 on CUDA)"
    add("--variants", type=names(tuple(lrun.VARIANTS), "variant(s)"), metavar="LIST", help=about)
    workloads = names(lrun.WORKLOADS, "workload(s)")
    add("--workloads", type=workloads, default=lrun.WORKLOADS, metavar="LIST", help=",".join(lrun.WORKLOADS))
    about = "the shape of the int8 (and fp8) batch-1 decode target (default qwen2-0.5b; none = skip)"
    add("--int8-preset", choices=(*PRESET_NAMES, "none"), help=about)
    for flag, about in (
        ("num_requests", "batch-1 requests per workload"),
        ("concurrency", "requests added at once"),
        ("output_len", "output tokens per request"),
        ("shape_requests", "requests on the --int8-preset shape"),
        ("shape_output_len", "their output tokens"),
    ):
        add_count(parser, f"--{flag.replace('_', '-')}", None, f"{about} (default {DEFAULTS[flag][1]})")
    about = "held-out tokens scored for perplexity (default 16384; 0 = skip)"
    add_count(parser, "--perplexity-tokens", None, about, type=int)
    about = "CUDA: the budget at which KV blocks are counted with kv_cache_dtype auto and fp8"
    add("--kv-budget-gb", type=positive_float, default=KV_BUDGET_GB, metavar="GB", help=about)
    for name in SPEC_FLAGS:
        flag = f"--{name.replace('_', '-')}"
        about = f"ngram variant: the engine's {name} (default: the engine's)"
        if "acceptance" in name:
            add(flag, type=float, metavar="X", help=about)
        else:
            add_count(parser, flag, None, about, type=int)
    about = "the model whose perplexity is compared (default: the embedded chat model; with tokenizer.json)"
    add("--quality-model", type=Path, metavar="DIR", help=about)
    about = (
        "when the embedded chat model is not built yet (a fresh machine), run the variants on PRESET "
        "and leave perplexity out instead of training the model first (minutes)"
    )
    add("--if-no-embedded", choices=PRESET_NAMES, metavar="PRESET", help=about)


def resolve_variant(args: argparse.Namespace) -> None:
    """Resolves the options (engine.resolve, bfloat16 on CUDA for any model), the variants by device, and
    checks the rest; ValueError names a bad one. Then `--if-no-embedded` (see `_fall_back`)."""
    cuda = engine.resolve(args, DEFAULTS, real_model=True)
    if args.variants is None:
        args.variants = ("off", "ngram", "int8", "fp8") if cuda else ("off", "ngram", "int8")
    if args.perplexity_tokens < 0:
        raise ValueError("--perplexity-tokens must be >= 0")
    if args.quality_model is not None and not (args.quality_model / "tokenizer.json").is_file():
        raise ValueError(f"--quality-model {args.quality_model}: no tokenizer.json there")
    _fall_back(args)


def _skip_reason(variant: str, device: str) -> str | None:
    if variant in lrun.CUDA_ONLY and not device.startswith("cuda"):
        return "skipped: CUDA only"
    return None


class Bench:
    """One run: the options, the model, and the report filled in as the stages finish."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, label: str, meta: dict[str, Any]) -> None:
        self.args = args
        self.model_dir = model_dir
        overrides = {name: getattr(args, name) for name in SPEC_FLAGS}
        self.spec = lrun.EngineSpec(model_dir, args.device, args.dtype, overrides, args.threads or 0)
        self.report = rep.LatencyReport(label, args.concurrency, [])
        self.meta = meta

    def save(self, partial: bool) -> None:
        """Writes the JSON so far (`"partial": true` until the end), so that a run cut short keeps it."""
        if self.args.json is not None:
            write_json(self.args.json, rep.latency_json(self.report, {**self.meta, "partial": partial}))

    def workloads(self) -> list[lrun.LatencyWorkload]:
        args = self.args
        vocab = int(AutoConfig.from_pretrained(self.model_dir).vocab_size)
        encode = lrun.make_encoder(self.model_dir, vocab)
        n = max(args.concurrency, args.num_requests)
        greedy = functools.partial(lrun.greedy_continuations, self.spec, max_num_seqs=n)
        built = [
            lrun.repetitive(encode, greedy, n, args.output_len, args.seed)
            if name == lrun.REPETITIVE
            else lrun.non_repetitive(encode, n, args.output_len, args.seed)
            for name in args.workloads
        ]
        for w in built:
            self.report.workloads[w.name] = dict(how=w.how, requests=len(w), prompt_tokens=w.prompt_tokens)
            print(f"workload {w.name}: {len(w)} requests, {w.prompt_tokens} prompt tokens; {w.how}")
        return built

    def run_variant(self, k: int, variant: str, workloads: list[lrun.LatencyWorkload]) -> None:
        """One round of `variant`: its engine, then per workload a warm-up, the batch-1 run and the
        concurrent run. A later round (--repeat) keeps, per run, the faster of its figures and the earlier
        ones."""
        args = self.args
        skip = _skip_reason(variant, args.device)
        if skip is not None or variant in self.report.errors:
            self.report.errors.setdefault(variant, skip or "")
            return
        lengths = [len(r.prompt) + r.max_new_tokens for w in workloads for r in w.requests]
        total = sum(
            r.max_new_tokens for w in workloads for r in (*w.requests[: args.num_requests], *w.requests)
        )
        bar = progress_bar(not args.no_progress, total, f"[{k}/{len(args.variants)}] {variant}")
        try:
            with bar:
                engine = lrun.build_engine(self.spec, variant, lengths, args.concurrency)
                for w in workloads:
                    lrun.warm_up(engine, w, args.concurrency)
                    b1 = lrun.run_batch1(engine, w.head(args.num_requests), args.device, bar.update)
                    many = lrun.run_concurrent(engine, w.head(args.concurrency), args.device, bar.update)
                    self._keep(variant, w, b1, many)
        except Exception as exc:
            self.report.errors[variant] = error_text(exc)
        finally:
            engine = None
            drv.release_memory(args.device)
        self.save(partial=True)

    def _keep(self, variant: str, work: lrun.LatencyWorkload, b1: RunFigures, many: RunFigures) -> None:
        cell = self.report.cell(variant, work.name)
        if cell is None:
            cell = rep.Cell(variant, work.name)
            self.report.cells.append(cell)
        cell.batch1 = faster(cell.batch1, b1, "decode_tok_s")
        cell.concurrent = faster(cell.concurrent, many, "output_tok_s")
        prompts = [r.prompt for r in work.requests[: self.args.concurrency]]
        cell.copy_fraction = lrun.mean_fraction(lrun.copy_fraction, prompts, cell.concurrent.outputs)
        cell.lookup_fraction = lrun.mean_fraction(lrun.lookup_fraction, prompts, cell.concurrent.outputs)

    def run_shape(self, scratch: Path) -> None:
        """Batch-1 decode of off and the weight variants asked for on `--int8-preset` (random weights)."""
        args = self.args
        wanted = [v for v in (lrun.OFF, "int8", "fp8") if v == lrun.OFF or v in args.variants]
        if args.int8_preset == "none" or wanted == [lrun.OFF]:
            return
        model_dir = preset_model_dir(args.int8_preset, args.dtype, args.seed, scratch)
        shape = rep.ShapeRun(args.int8_preset, args.dtype)
        self.report.shape = shape
        vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(lrun.FIRST_PLAIN_ID, vocab) for _ in range(SHAPE_PROMPT_LEN)]
            for _ in range(args.shape_requests)
        ]
        requests = tuple(lrun.LatencyRequest(tuple(p), args.shape_output_len) for p in prompts)
        work = lrun.LatencyWorkload("random", requests, "random prompts, greedy")
        spec = lrun.EngineSpec(model_dir, args.device, args.dtype, {}, args.threads or 0)
        lengths = [len(r.prompt) + r.max_new_tokens for r in requests]
        print(f"== batch-1 decode on {args.int8_preset}: {', '.join(wanted)}")
        for variant in wanted:
            skip = _skip_reason(variant, args.device)
            if skip is not None:
                shape.errors[variant] = skip
                continue
            total = args.repeat * sum(r.max_new_tokens for r in requests)
            try:
                with progress_bar(not args.no_progress, total, f"{args.int8_preset} {variant}") as bar:
                    engine = lrun.build_engine(spec, variant, lengths, 1)
                    lrun.warm_up(engine, work, 1, tokens=2)
                    shape.runs[variant] = best_of(
                        args.repeat, "decode_tok_s", lrun.run_batch1, engine, work, args.device, bar.update
                    )
            except Exception as exc:
                shape.errors[variant] = error_text(exc)
            finally:
                engine = None
                drv.release_memory(args.device)
            self.save(partial=True)

    def run_kv_blocks(self) -> None:
        """CUDA: the blocks of one budget with kv_cache_dtype auto and fp8 (engine stats num_blocks)."""
        args = self.args
        if not args.device.startswith("cuda"):
            return
        kv = self.report.kv = rep.KvBlocks(args.kv_budget_gb)
        settings = dict(model=str(self.model_dir), device=args.device, dtype=args.dtype, max_num_seqs=8)
        for kv_dtype in ("auto", "fp8"):
            try:
                engine = drv.make_engine(
                    **settings, kv_cache_gb=args.kv_budget_gb, kv_cache_dtype=kv_dtype, cuda_graphs="off"
                )
                kv.blocks[kv_dtype] = engine.stats().num_blocks
            except Exception as exc:
                kv.error = error_text(exc)
                return
            finally:
                engine = None
                drv.release_memory(args.device)
        print(rep.format_kv(kv))

    def run_quality(self) -> None:
        """Perplexity of the embedded chat model on held-out text: unquantized and each quantization asked
        for (on CUDA also the fp8 KV cache)."""
        args = self.args
        if args.perplexity_tokens == 0:
            return
        from services.common.models import resolve_model_dir

        model_dir = args.quality_model or resolve_model_dir("")
        self.report.quality_model = f"{model_dir.name}, {args.perplexity_tokens} held-out tokens"
        ids = ppl.encode_documents(model_dir / "tokenizer.json", ppl.held_out_texts(), args.perplexity_tokens)
        cases = [("none", "none", "auto")]
        quantized = [q for q in ("int8", "fp8") if q in args.variants and not _skip_reason(q, args.device)]
        cases += [(q, q, "auto") for q in quantized]
        if args.device.startswith("cuda"):
            cases.append(("fp8-kv", "none", "fp8"))
        print(f"== perplexity on {len(ids)} held-out tokens: {', '.join(c[0] for c in cases)}")
        for variant, quant, kv_dtype in cases:
            case = (variant, quant, kv_dtype)
            try:
                runner = ppl.make_runner(
                    model_dir, args.device, args.dtype, quant, kv_dtype, ppl.DEFAULT_WINDOW
                )
                result = ppl.runner_perplexity(runner, ids)
                self.report.quality.append(ppl.QualityResult(*case, result.value, result.tokens))
            except Exception as exc:
                self.report.quality.append(ppl.QualityResult(*case, None, 0, error_text(exc)))
            finally:
                runner = None
                drv.release_memory(args.device)
        self.save(partial=True)


def best_of(repeat: int, figure: str, run: Callable[..., RunFigures], *args: Any) -> RunFigures:
    """The run with the highest `figure` of `repeat` calls of `run(*args)` (see `faster`)."""
    best: RunFigures | None = None
    for _ in range(repeat):
        best = faster(best, run(*args), figure)
    assert best is not None
    return best


def faster(kept: RunFigures | None, new: RunFigures, figure: str) -> RunFigures:
    """Of an earlier run of a measurement (or None) and a new one, the one with the higher `figure`; its
    `repeats` lists the figure of every run so far."""
    repeats = [*(kept.repeats if kept else []), getattr(new, figure)]
    best = new if kept is None or getattr(new, figure) > getattr(kept, figure) else kept
    best.repeats = repeats
    return best


def cached_embedded_model() -> Path | None:
    """The embedded chat model's directory when it is already built in the cache, else None."""
    from sluice.model import tiny

    name = f"tiny-chat-llama-t{tiny.DEFAULT_TRAIN_SECONDS:g}-s0-r{tiny.RECIPE_VERSION}"
    path = tiny.cache_root() / name
    return path if (path / tiny.MARKER).exists() else None


def _fall_back(args: argparse.Namespace) -> None:
    """`--if-no-embedded PRESET` on a machine without the embedded model: PRESET, and no perplexity."""
    if args.if_no_embedded is None or cached_embedded_model() is not None:
        return
    if args.model is None and args.preset is None:
        args.preset = args.if_no_embedded
    if args.quality_model is None and args.perplexity_tokens:
        args.perplexity_tokens = 0
        print("perplexity: left out, the embedded chat model is not built on this machine")


def run(args: argparse.Namespace, variant: str, meta: dict[str, Any], label: str, scratch: Path) -> int:
    """The latency variant (every stage) or the perplexity variant (the perplexity stage alone, same flags
    and JSON), under engine.main; returns the exit status."""
    meta["dtype"] = args.dtype
    print(f"model: {label}, {args.dtype}, {args.device}; variants {','.join(args.variants)}")
    bench = Bench(args, engine.model_dir(args, scratch), label, meta)
    bench.meta["stage_s"] = {}
    if variant == "perplexity":
        return _stage_and_finish(args, bench, "perplexity", bench.run_quality)
    start = time.perf_counter()
    workloads = bench.workloads()
    bench.meta["stage_s"]["workloads"] = time.perf_counter() - start
    # --repeat N: N rounds over the variants in turn, so that a busy spell of the machine falls on
    # one round of each rather than on every run of one variant.
    stages: list[tuple[str, Callable[[], None]]] = [
        (v, lambda k=k, v=v: bench.run_variant(k, v, workloads))
        for _ in range(args.repeat)
        for k, v in enumerate(args.variants, 1)
    ]
    stages += [
        ("shape", lambda: bench.run_shape(scratch)),
        ("kv_blocks", bench.run_kv_blocks),
        ("perplexity", bench.run_quality),
    ]
    for name, stage in stages:
        start = time.perf_counter()
        stage()
        bench.meta["stage_s"][name] = bench.meta["stage_s"].get(name, 0.0) + time.perf_counter() - start
    print("seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in bench.meta["stage_s"].items()))
    return _finish(args, bench)


def main(argv: list[str]) -> int:
    """`sluice bench latency`: the engine command's latency variant under its older name."""
    return engine.main(["latency", *argv], prog="sluice bench latency")


def _stage_and_finish(args: argparse.Namespace, bench: Bench, name: str, stage: Callable[[], None]) -> int:
    start = time.perf_counter()
    stage()
    bench.meta["stage_s"][name] = time.perf_counter() - start
    return _finish(args, bench, only_quality=True)


def _finish(args: argparse.Namespace, bench: Bench, only_quality: bool = False) -> int:
    report = bench.report
    tables = [rep.format_latency(report), rep.format_shape(report.shape), rep.format_quality(report)]
    print("\n" + "\n\n".join(tables[2:] if only_quality else tables))
    if not only_quality:
        print(rep.format_kv(report.kv))
    bench.save(partial=False)
    if args.json is not None:
        print(f"wrote {args.json}")
    failed = [v for v, why in report.errors.items() if not why.startswith("skipped")]
    if report.shape is not None:
        failed += [v for v, why in report.shape.errors.items() if not why.startswith("skipped")]
    failed += [q.variant for q in report.quality if q.error]
    return 1 if failed else 0
