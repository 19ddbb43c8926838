"""The latency and perplexity variants of `sluice bench engine` (also `sluice bench latency`): speculative
decoding and quantized weights against the plain engine, one in-process engine per variant at a time,
prefix caching off so every TTFT is a full prefill. Batch 1: decode rate = tokens after the first ÷ summed
first-to-last times; concurrent: every request added at once, output rate = tokens ÷ wall time. Then
perplexity (docs/benchmarks.md; the weight formats on a larger shape: scripts/gpu_latency_extras.py).
Exit status 0 when every variant asked for ran (fp8 on a CPU is skipped, not failed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoConfig

from sluice.bench import engine
from sluice.bench import engine_driver as drv
from sluice.bench import perplexity as ppl
from sluice.bench import report as rep
from sluice.bench.common import add_count, error_text, names, progress_bar
from sluice.bench.engine_driver import LLMEngine, Progress
from sluice.bench.engine_methods import BenchContext
from sluice.bench.report import OFF, write_json
from sluice.model.presets import BOS_ID, PRESET_NAMES

REPETITIVE, NON_REPETITIVE = WORKLOADS = ("repetitive", "non-repetitive")
VARIANTS: dict[str, dict[str, str]] = {
    OFF: {},
    "ngram": {"speculative": "ngram"},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
}
CUDA_ONLY = ("fp8",)
DEFAULTS = {  # option: (with --quick, without)
    "num_requests": (2, 8),
    "concurrency": (4, 64),
    "output_len": (12, 128),
    "perplexity_tokens": (1024, ppl.DEFAULT_MAX_TOKENS),
}
SEED_TOKENS = 24  # tokens of a held-out paragraph the model continues into the document
COPY_NGRAM = 4  # a token counts as copied when it lies in a span of this many tokens found in the prompt
NON_REPETITIVE_TEMPERATURE = 0.9
FIRST_PLAIN_ID = 5  # ids below are special tokens in every model the benchmark makes (pad, bos, eos, ...)
QUESTIONS = ("What does {t} do?", "When would I use {t}?", "Give me an overview of {t}.")
QUESTIONS += ("What are the pitfalls of {t}?",)


@dataclass(frozen=True)
class LatencyRequest:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class LatencyWorkload:
    """Requests of one kind; `how` says in a sentence how they were built."""

    name: str
    requests: tuple[LatencyRequest, ...]
    how: str

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> LatencyWorkload:
        return LatencyWorkload(self.name, self.requests[:n], self.how)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


Encoder = Callable[[str], list[int]]


def make_encoder(model_dir: Path, vocab_size: int) -> Encoder:
    """The model's tokenizer (no special tokens added; markup such as `<|im_start|>` is parsed as the
    special token it names), or, without tokenizer.json, each word mapped to an id by crc32."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    span = vocab_size - FIRST_PLAIN_ID
    return lambda text: [FIRST_PLAIN_ID + zlib.crc32(w.encode()) % span for w in text.split()]


def _user_turn(encode: Encoder, text: Sequence[int] | str) -> list[int]:
    body = encode(text) if isinstance(text, str) else list(text)
    return [BOS_ID, *encode("<|im_start|>user\n"), *body, *encode("<|im_end|>\n<|im_start|>assistant\n")]


Continue = Callable[[list[list[int]], int], list[list[int]]]  # prompts, n -> each one's n greedy tokens


def repetitive(
    encode: Encoder, continue_greedy: Continue, count: int, output_len: int, seed: int
) -> LatencyWorkload:
    """`count` user turns asking to repeat a document: SEED_TOKENS of a held-out paragraph and the model's
    own greedy answer to the request with those tokens alone (`continue_greedy`); the answer starts with
    the paragraph's tokens, so the answer to the full document is (nearly) the same text."""
    usable = [ids[:SEED_TOKENS] for t in ppl.held_out_texts() if len(ids := encode(t)) >= SEED_TOKENS]
    if len(usable) < count:
        raise ValueError(f"only {len(usable)} held-out paragraphs are long enough, {count} wanted")
    seeds = random.Random(seed).sample(usable, count)
    instruction = encode("Repeat the following text exactly.\n\n")
    continuations = continue_greedy(
        [[*_user_turn(encode, [*instruction, *s]), *s] for s in seeds], output_len
    )
    requests = [
        LatencyRequest(tuple([*_user_turn(encode, [*instruction, *s, *c]), *s]), output_len)
        for s, c in zip(seeds, continuations, strict=True)
    ]
    how = (
        f"a user turn asks to repeat a document: {SEED_TOKENS} tokens of a held-out paragraph and the "
        f"model's own greedy answer to that request with those tokens alone ({output_len} tokens); the "
        f"answer starts with the paragraph's {SEED_TOKENS} tokens; greedy, {output_len} tokens per request"
    )
    return LatencyWorkload(REPETITIVE, tuple(requests), how)


def non_repetitive(encode: Encoder, count: int, output_len: int, seed: int) -> LatencyWorkload:
    """`count` short questions about held-out paragraphs' first words, sampled at the temperature above."""
    rng = random.Random(seed + 1)
    requests = []
    for i, text in enumerate(rng.sample(list(ppl.held_out_texts()), count)):
        topic = " ".join(text.split()[:4]).rstrip(".,:;")
        prompt = _user_turn(encode, rng.choice(QUESTIONS).format(t=topic))
        requests.append(
            LatencyRequest(tuple(prompt), output_len, NON_REPETITIVE_TEMPERATURE, seed * 1000 + i)
        )
    how = (
        f"a user turn asks a short question about a held-out paragraph's first words; sampled at "
        f"temperature {NON_REPETITIVE_TEMPERATURE} with a seed per request, {output_len} tokens per request"
    )
    return LatencyWorkload(NON_REPETITIVE, tuple(requests), how)


def copy_fraction(prompt: Sequence[int], output: Sequence[int], n: int = COPY_NGRAM) -> float:
    """Share of `output`'s tokens that lie in some span of `n` output tokens also found in `prompt`."""
    if not output:
        return 0.0
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for j in range(len(output) - n + 1):
        if tuple(output[j : j + n]) in grams:
            covered[j : j + n] = [True] * n
    return sum(covered) / len(output)


def mean_copy_fraction(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    """`copy_fraction` over every request, weighted by output length."""
    total = sum(len(o) for o in outputs)
    pairs = zip(prompts, outputs, strict=True)
    return sum(copy_fraction(p, o) * len(o) for p, o in pairs) / total if total else 0.0


def build_engine(spec: BenchContext, variant: str, lengths: Sequence[int], max_num_seqs: int) -> LLMEngine:
    """The engine of `variant` for requests of these total lengths (prompt + output) at most
    `max_num_seqs` at once; the pool also holds each request's drafts."""
    fixed = {"threads": spec.threads, "max_num_seqs": max_num_seqs, "enable_prefix_caching": False}
    model = (spec.model_dir, spec.device, spec.dtype)
    extra = drv.NUM_SPECULATIVE_TOKENS + 1
    return drv.make_engine(drv.engine_settings(*model, lengths, extra=extra, **fixed, **VARIANTS[variant]))


def _add(engine: LLMEngine, rid: str, req: LatencyRequest) -> None:
    sampling = drv.SamplingParams(temperature=req.temperature, seed=req.seed)
    engine.add_request(rid, list(req.prompt), sampling, drv.stop_after(req.max_new_tokens))


def warm_up(engine: LLMEngine, workload: LatencyWorkload, concurrency: int, tokens: int = 8) -> None:
    """Outside any timed run, the workload's first request alone, then its first `concurrency` at once,
    each for `tokens` tokens, so that both runs' shapes have run once (CUDA's one-time costs)."""
    rounds = [workload.requests[:1]] + ([workload.requests[:concurrency]] if concurrency > 1 else [])
    for k, requests in enumerate(rounds):
        for i, req in enumerate(requests):
            short = dataclasses.replace(req, max_new_tokens=min(tokens, req.max_new_tokens))
            _add(engine, f"warmup{k}-{i}", short)
        drv.drain(engine)


@dataclass
class RunFigures:
    """One timed run: `concurrency` 1 is the batch-1 run (requests one at a time)."""

    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float  # batch 1: the summed request times; else add-all to last token
    decode_tokens: int  # tokens after each request's first
    decode_s: float  # batch 1: summed first-to-last times; else the wall time after the first token
    ttft_s: list[float]
    outputs: list[list[int]]
    spec: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    repeats: list[float] = field(default_factory=list)  # the headline figure of every repeat (--repeat)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def ttft(self, q: float) -> float:
        """The q-quantile (0..1) of the TTFTs, interpolated between closest ranks; nan without any."""
        return float(np.percentile(self.ttft_s, 100 * q)) if self.ttft_s else math.nan


def run_requests(
    engine: LLMEngine, workload: LatencyWorkload, device: str, progress: Progress, at_once: bool
) -> RunFigures:
    """The workload's requests one at a time (batch 1), or all added at once (see the module docstring)."""
    engine.reset_stats()
    tracks = {f"r{i}": drv.Track() for i in range(len(workload))}
    drv.sync(device)
    start = time.perf_counter()
    for (rid, track), req in zip(tracks.items(), workload.requests, strict=True):
        track.added = start
        if not at_once:
            drv.sync(device)
            track.added = time.perf_counter()
        _add(engine, rid, req)
        if not at_once:
            drv.drain(engine, {rid: track}, progress)
    drv.drain(engine, tracks, progress)
    runs: list[Any] = list(tracks.values())  # every one finished: first and done are set
    if at_once:
        end = max(t.done for t in runs)
        wall, decode = end - start, end - min(t.first for t in runs)
    else:
        wall, decode = sum(t.done - t.added for t in runs), sum(t.done - t.first for t in runs)
    return RunFigures(
        concurrency=len(runs) if at_once else 1,
        requests=len(runs),
        output_tokens=sum(len(t.tokens) for t in runs),
        wall_s=wall,
        decode_tokens=sum(max(0, len(t.tokens) - 1) for t in runs),
        decode_s=decode,
        ttft_s=[t.first - t.added for t in runs],
        outputs=[t.tokens for t in runs],
        spec=drv.spec_stats(engine),
        steps=engine.stats().steps,
    )


def greedy_continuations(
    spec: BenchContext, prompts: list[list[int]], n: int, max_num_seqs: int
) -> list[list[int]]:
    """Each prompt's `n` greedy tokens from a speculation-off engine (built for this and released)."""
    engine = build_engine(spec, OFF, [len(p) + n for p in prompts], max_num_seqs)
    outputs, _ = drv.generate(engine, prompts, [n] * len(prompts))
    del engine
    drv.release_memory(spec.device)
    return outputs


def faster(kept: RunFigures | None, new: RunFigures, figure: str) -> RunFigures:
    """Of an earlier run of a measurement (or None) and a new one, the one with the higher `figure`; its
    `repeats` lists the figure of every run so far."""
    repeats = [*(kept.repeats if kept else []), getattr(new, figure)]
    best = new if kept is None or getattr(new, figure) > getattr(kept, figure) else kept
    best.repeats = repeats
    return best


FLAGS = (  # option, its help (the default: DEFAULTS' second value)
    ("num_requests", "batch-1 requests per workload"),
    ("concurrency", "requests added at once"),
    ("output_len", "output tokens per request"),
)


def add_variant_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the latency and perplexity variants (engine.build_parser adds the model and the run's)."""
    add = parser.add_argument
    about = f"comma list of {', '.join(VARIANTS)} (default: off,ngram,int8, and fp8 on CUDA)"
    add("--variants", type=names(tuple(VARIANTS), "variant(s)"), metavar="LIST", help=about)
    workloads = names(WORKLOADS, "workload(s)")
    add("--workloads", type=workloads, default=WORKLOADS, metavar="LIST", help=",".join(WORKLOADS))
    for flag, about in FLAGS:
        add_count(parser, f"--{flag.replace('_', '-')}", None, f"{about} (default {DEFAULTS[flag][1]})")
    about = f"held-out tokens scored for perplexity (default {ppl.DEFAULT_MAX_TOKENS}; 0 = skip)"
    add_count(parser, "--perplexity-tokens", None, about, type=int)
    about = "the model whose perplexity is compared (default: the embedded chat model; with tokenizer.json)"
    add("--quality-model", type=Path, metavar="DIR", help=about)
    about = "when the embedded chat model is not built yet, run on PRESET and leave perplexity out"
    add("--if-no-embedded", choices=PRESET_NAMES, metavar="PRESET", help=about)


def resolve_variant(args: argparse.Namespace) -> None:
    """Resolves the options (engine.resolve, bfloat16 on CUDA for any model) and the variants by device;
    ValueError names a bad one. `--if-no-embedded PRESET` on a machine without the embedded model: PRESET,
    and no perplexity."""
    cuda = engine.resolve(args, DEFAULTS, real_model=True)
    if args.variants is None:
        args.variants = ("off", "ngram", "int8", "fp8") if cuda else ("off", "ngram", "int8")
    if args.perplexity_tokens < 0:
        raise ValueError("--perplexity-tokens must be >= 0")
    if args.quality_model is not None and not (args.quality_model / "tokenizer.json").is_file():
        raise ValueError(f"--quality-model {args.quality_model}: no tokenizer.json there")
    if args.if_no_embedded is None or cached_embedded_model() is not None:
        return
    if args.model is None and args.preset is None:
        args.preset = args.if_no_embedded
    if args.quality_model is None and args.perplexity_tokens:
        args.perplexity_tokens = 0
        print("perplexity: left out, the embedded chat model is not built on this machine")


def cached_embedded_model() -> Path | None:
    """The embedded chat model's directory when it is already built in the cache, else None."""
    from sluice.model import tiny

    path = tiny.cache_root() / f"tiny-chat-llama-t{tiny.DEFAULT_TRAIN_SECONDS:g}-s0-r{tiny.RECIPE_VERSION}"
    return path if (path / tiny.MARKER).exists() else None


def _skip_reason(variant: str, device: str) -> str | None:
    return "skipped: CUDA only" if variant in CUDA_ONLY and not device.startswith("cuda") else None


class Bench:
    """One run: the options, the model, and the report filled in as the stages finish."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, label: str, meta: dict[str, Any]) -> None:
        self.args, self.model_dir, self.meta = args, model_dir, meta
        self.spec = BenchContext(model_dir, args.device, args.dtype, threads=args.threads or 0)
        self.report = rep.LatencyReport(label, args.concurrency, [])

    def save(self, partial: bool) -> None:
        """Writes the JSON so far (`"partial": true` until the end), so that a run cut short keeps it."""
        write_json(self.args.json, rep.latency_json(self.report, {**self.meta, "partial": partial}))

    def workloads(self) -> list[LatencyWorkload]:
        args = self.args
        encode = make_encoder(self.model_dir, int(AutoConfig.from_pretrained(self.model_dir).vocab_size))
        n = max(args.concurrency, args.num_requests)
        greedy = functools.partial(greedy_continuations, self.spec, max_num_seqs=n)
        built = [
            repetitive(encode, greedy, n, args.output_len, args.seed)
            if name == REPETITIVE
            else non_repetitive(encode, n, args.output_len, args.seed)
            for name in args.workloads
        ]
        for w in built:
            self.report.workloads[w.name] = dict(how=w.how, requests=len(w), prompt_tokens=w.prompt_tokens)
            print(f"workload {w.name}: {len(w)} requests, {w.prompt_tokens} prompt tokens; {w.how}")
        return built

    def run_variant(self, k: int, variant: str, workloads: list[LatencyWorkload]) -> None:
        """One round of `variant`: its engine, then per workload a warm-up, the batch-1 run and the
        concurrent run; a later round (--repeat) keeps, per run, the faster figures."""
        args, report = self.args, self.report
        skip = _skip_reason(variant, args.device)
        if skip is not None or variant in report.errors:
            report.errors.setdefault(variant, skip or "")
            return
        lengths = [len(r.prompt) + r.max_new_tokens for w in workloads for r in w.requests]
        total = sum(
            r.max_new_tokens for w in workloads for r in (*w.requests[: args.num_requests], *w.requests)
        )
        try:
            with progress_bar(not args.no_progress, total, f"[{k}/{len(args.variants)}] {variant}") as bar:
                eng = build_engine(self.spec, variant, lengths, args.concurrency)
                for w in workloads:
                    warm_up(eng, w, args.concurrency)
                    b1 = run_requests(eng, w.head(args.num_requests), args.device, bar.update, at_once=False)
                    many = run_requests(eng, w.head(args.concurrency), args.device, bar.update, at_once=True)
                    if (cell := report.cell(variant, w.name)) is None:
                        report.cells.append(cell := rep.Cell(variant, w.name))
                    cell.batch1 = faster(cell.batch1, b1, "decode_tok_s")
                    cell.concurrent = faster(cell.concurrent, many, "output_tok_s")
                    prompts = [r.prompt for r in w.requests[: args.concurrency]]
                    cell.copy_fraction = mean_copy_fraction(prompts, cell.concurrent.outputs)
        except Exception as exc:
            report.errors[variant] = error_text(exc)
        finally:
            eng = None
            drv.release_memory(args.device)
        self.save(partial=True)

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
        quantized = [q for q in ("int8", "fp8") if q in args.variants and not _skip_reason(q, args.device)]
        cases = [("none", "none", "auto"), *((q, q, "auto") for q in quantized)]
        cases += [("fp8-kv", "none", "fp8")] if args.device.startswith("cuda") else []
        print(f"== perplexity on {len(ids)} held-out tokens: {', '.join(c[0] for c in cases)}")
        for case in cases:
            options = {"threads": self.spec.threads, "quantization": case[1], "kv_cache_dtype": case[2]}
            try:
                value, tokens = ppl.perplexity(
                    model_dir, ids, args.device, args.dtype, cuda_graphs="off", **options
                )
                result = ppl.QualityResult(*case, value, tokens)
            except Exception as exc:
                result = ppl.QualityResult(*case, None, 0, error_text(exc))
            finally:
                drv.release_memory(args.device)
            self.report.quality.append(result)
        self.save(partial=True)


def run(args: argparse.Namespace, variant: str, meta: dict[str, Any], label: str, scratch: Path) -> int:
    """The latency variant (every stage) or the perplexity variant (the perplexity stage alone, same flags
    and JSON), under engine.main; returns the exit status."""
    meta.update(dtype=args.dtype, stage_s={})
    print(f"model: {label}, {args.dtype}, {args.device}; variants {','.join(args.variants)}")
    bench = Bench(args, engine.model_dir(args, scratch), label, meta)
    stages: list[tuple[str, Callable[[], object]]] = [("perplexity", bench.run_quality)]
    if variant != "perplexity":
        workloads: list[LatencyWorkload] = []
        # --repeat N: N rounds over the variants in turn, so that a busy spell of the machine falls on
        # one round of each rather than on every run of one variant.
        rounds = [(k, v) for _ in range(args.repeat) for k, v in enumerate(args.variants, 1)]
        stages = [
            ("workloads", lambda: workloads.extend(bench.workloads())),
            *((v, functools.partial(bench.run_variant, k, v, workloads)) for k, v in rounds),
            *stages,
        ]
    for name, stage in stages:
        start = time.perf_counter()
        stage()
        meta["stage_s"][name] = meta["stage_s"].get(name, 0.0) + time.perf_counter() - start
    print("seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in meta["stage_s"].items()))
    report = bench.report
    tables = [rep.format_quality(report)]
    if variant != "perplexity":
        tables = [rep.format_latency(report), *tables]
    print("\n" + "\n\n".join(tables))
    bench.save(partial=False)
    if args.json is not None:
        print(f"wrote {args.json}")
    failed = [why for why in report.errors.values() if not why.startswith("skipped")]
    return 1 if failed or any(q.error for q in report.quality) else 0


def main(argv: list[str]) -> int:
    """`sluice bench latency`: the engine command's latency variant under its older name."""
    return engine.main(["latency", *argv], prog="sluice bench latency")
