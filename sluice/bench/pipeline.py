"""`sluice bench pipeline`: what the four-service trip costs against the engine alone.

Usage: `sluice bench pipeline [--model DIR] [--num-requests 64] [--prompt-words 12,200] [--output-len 8,256]
[--api openai|ws|grpc] [--engine-flags "..."] [--repeat N] [--json FILE] [--plot FILE.png]`.

Runs one workload (all requests at once, greedy, fixed output lengths) twice on this machine:
1. **in-process**: the prompts tokenized here exactly as the tokenizer service does, then the engine core
   (`LLMEngine`, the same settings the service gets) stepped until every request is done;
2. **end to end**: the same prompts as streaming requests through gateway → tokenizer → engine →
   detokenizer (a `Stack` of real processes) from the load generator in this process.

It prints output tokens/s both ways and their ratio, raw and scaled: the load generator shares the
machine with the pipeline, so the end-to-end rate is also compared with the in-process rate times the
share of the machine the generator leaves (`1 - generator CPU / (wall × cores)`). Where the difference
goes: engine steps and mean step time both ways (the engine's own step histogram), each process's CPU
seconds and cores used, and the gateway's per-stage times. With `--repeat N` the two runs alternate N
times and the best of each is compared (every run is in the JSON).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import uvloop
from prometheus_client.parser import text_string_to_metric_families

from sluice.bench.serve import run_meta
from sluice.bench.serve_data import BenchRequest, uniform_requests
from sluice.bench.serve_report import write_json_doc
from sluice.bench.stack import Stack, StackOptions
from sluice.launcher import default_engine_threads, resolve_model

TARGET_SCALED_RATIO = 0.85
WARMUP_REQUESTS = 4
# Histograms read from each service's /metrics: (service, metric family, label filter, report name).
STAGE_HISTOGRAMS = (
    ("engine", "sluice_step_duration_seconds", {}, "engine step"),
    ("tokenizer", "sluice_tokenize_duration_seconds", {}, "tokenizer batch"),
    ("detokenizer", "sluice_detokenize_duration_seconds", {}, "detokenizer batch"),
    ("gateway", "sluice_gateway_stage_duration_seconds", {"stage": "tokenize"}, "gateway: tokenize"),
    ("gateway", "sluice_gateway_stage_duration_seconds", {"stage": "engine_first_token"},
     "gateway: submit → first tokens"),
    ("gateway", "sluice_gateway_stage_duration_seconds", {"stage": "detokenize"},
     "gateway: first tokens → first text"),
)


@dataclass
class InProcessRun:
    """The engine core alone on the workload."""

    output_tokens: int
    wall_s: float
    cpu_s: float
    steps: int
    step_s: float  # summed step time
    forward_s: float  # summed model forward time

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def mean_step_ms(self) -> float:
        return 1000.0 * self.step_s / max(1, self.steps)


@dataclass
class EndToEndRun:
    """The workload through the four services, with what each process spent on it."""

    summary: dict[str, Any]
    wall_s: float
    cpu_s: dict[str, float]  # per service, plus "load generator"
    stages: dict[str, tuple[int, float]] = field(default_factory=dict)  # name → (count, summed seconds)

    @property
    def tokens_per_s(self) -> float:
        return float(self.summary["output_throughput"])

    @property
    def generator_share(self) -> float:
        """The share of the whole machine the load generator used over the run."""
        return self.cpu_s["load generator"] / (self.wall_s * (os.cpu_count() or 1))


# ---- the two runs ----------------------------------------------------------------------------------


def run_in_process(model: str, engine_flags: list[str], requests: list[BenchRequest]) -> InProcessRun:
    """Tokenizes the prompts as the tokenizer service does for a completion, then steps the engine
    core until every request is done. The engine gets the flags `sluice up` gives the service (its
    thread count included), then `engine_flags`."""
    from services.common.settings import load_settings
    from services.engine.core.engine import LLMEngine
    from services.engine.core.params import SamplingParams, StoppingParams
    from services.engine.settings import EngineSettings
    from services.tokenizer.core import TokenizerCore
    from sluice.bench.engine_methods import drain

    flags = ["--model", model, "--threads", str(default_engine_threads()), *engine_flags]
    settings = load_settings(EngineSettings, flags, prog="engine flags")
    prompts = TokenizerCore(model).encode_batch([r.prompt for r in requests], add_special_tokens=True)
    engine = LLMEngine(settings)
    greedy = SamplingParams(temperature=0.0)
    engine.add_request("warmup", prompts[0], greedy, StoppingParams(max_new_tokens=4, ignore_eos=True))
    drain(engine, {}, _no_progress)
    engine.reset_stats()
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    cpu, start = time.process_time(), time.perf_counter()
    for i, (ids, request) in enumerate(zip(prompts, requests, strict=True)):
        stopping = StoppingParams(max_new_tokens=request.output_len, ignore_eos=True)
        engine.add_request(f"r{i}", ids, greedy, stopping)
    drain(engine, outputs, _no_progress)
    wall = time.perf_counter() - start
    tokens = sum(len(ids) for ids in outputs.values())
    stats = engine.stats()
    return InProcessRun(tokens, wall, time.process_time() - cpu, stats.steps, stats.step_time_s,
                        stats.forward_time_s)


def _no_progress(tokens: int) -> None:
    """Progress callback of the in-process run: nothing to show."""


def run_end_to_end(stack: Stack, api: str, requests: list[BenchRequest], progress: bool) -> EndToEndRun:
    """Warms the stack up, then sends every request at once through `api` and reads what each process
    spent (CPU seconds from the OS, stage times from the services' own histograms)."""
    from sluice.bench.serve import ServeConfig, run_serve

    url = {"openai": stack.openai_url, "ws": stack.ws_url, "grpc": stack.grpc_address}[api]
    config = ServeConfig(api=api, url=url, progress=progress)
    warm = ServeConfig(api=api, url=url, progress=False)
    uvloop.run(run_serve(warm, requests[:WARMUP_REQUESTS]))
    cpu_before, stages_before = stack.cpu_seconds(), _stage_totals(stack)
    result = uvloop.run(run_serve(config, requests))
    cpu_after, stages_after = stack.cpu_seconds(), _stage_totals(stack)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after}
    cpu["load generator"] = result.client_cpu_s
    stages = {
        name: (count - stages_before[name][0], total - stages_before[name][1])
        for name, (count, total) in stages_after.items()
    }
    return EndToEndRun(result.summary(), result.duration_s, cpu, stages)


def _stage_totals(stack: Stack) -> dict[str, tuple[int, float]]:
    """(count, sum in seconds) of each histogram in STAGE_HISTOGRAMS, as the services report now."""
    scraped = {name: scrape_metrics(url) for name, url in stack.metrics_urls.items()}
    totals = {}
    for service, family, labels, name in STAGE_HISTOGRAMS:
        samples = scraped.get(service, {})
        count = samples.get((f"{family}_count", tuple(sorted(labels.items()))), 0.0)
        total = samples.get((f"{family}_sum", tuple(sorted(labels.items()))), 0.0)
        totals[name] = (int(count), total)
    return totals


def scrape_metrics(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample a Prometheus endpoint serves now: (sample name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# ---- the report ------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """The best in-process and end-to-end runs and their ratios."""

    in_process: InProcessRun
    end_to_end: EndToEndRun

    @property
    def raw_ratio(self) -> float:
        return self.end_to_end.tokens_per_s / self.in_process.tokens_per_s

    @property
    def scaled_ratio(self) -> float:
        """End to end ÷ (in-process × the share of the machine the load generator leaves)."""
        return self.raw_ratio / (1.0 - self.end_to_end.generator_share)

    def lines(self) -> list[str]:
        inp, e2e = self.in_process, self.end_to_end
        e2e_steps, e2e_step_s = e2e.stages.get("engine step", (0, 0.0))
        cores = os.cpu_count() or 1
        out = [
            f"in-process engine : {inp.tokens_per_s:9.1f} tok/s  ({inp.output_tokens} tokens in "
            f"{inp.wall_s:.2f} s; {inp.steps} steps, mean step {inp.mean_step_ms:.1f} ms; "
            f"{inp.cpu_s / inp.wall_s:.2f} cores)",
            f"end to end        : {e2e.tokens_per_s:9.1f} tok/s  ({e2e.summary['total_output_tokens']} "
            f"tokens in {e2e.wall_s:.2f} s; {e2e_steps} steps, mean step "
            f"{1000 * e2e_step_s / max(1, e2e_steps):.1f} ms; {e2e.summary['failed']} failed)",
            f"ratio, raw        : {self.raw_ratio:.3f}",
            f"load generator    : {e2e.generator_share:.1%} of the machine ({cores} cores)",
            f"ratio, scaled     : {self.scaled_ratio:.3f}  (target >= {TARGET_SCALED_RATIO}: "
            f"{'met' if self.scaled_ratio >= TARGET_SCALED_RATIO else 'NOT met'})",
            "",
            "CPU over the end-to-end run   seconds   cores",
        ]
        for name, seconds in sorted(e2e.cpu_s.items(), key=lambda kv: -kv[1]):
            out.append(f"  {name:<27} {seconds:8.2f}   {seconds / e2e.wall_s:5.2f}")
        idle = cores - sum(e2e.cpu_s.values()) / e2e.wall_s
        out.append(f"  {'(not used by these)':<27} {'':8}   {idle:5.2f}")
        out += ["", "stage times (services' histograms)   count   mean ms   total s"]
        for name, (count, total) in e2e.stages.items():
            mean = 1000 * total / count if count else float("nan")
            out.append(f"  {name:<34} {count:6d}  {mean:8.2f}  {total:8.2f}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "in_process": {**asdict(self.in_process), "tokens_per_s": self.in_process.tokens_per_s},
            "end_to_end": {
                **asdict(self.end_to_end),
                "tokens_per_s": self.end_to_end.tokens_per_s,
                "generator_share": self.end_to_end.generator_share,
            },
            "raw_ratio": self.raw_ratio,
            "scaled_ratio": self.scaled_ratio,
            "target_scaled_ratio": TARGET_SCALED_RATIO,
            "target_met": self.scaled_ratio >= TARGET_SCALED_RATIO,
        }


def write_plot(path: Path, best: Comparison) -> None:
    """A PNG of two panels: output tokens/s in-process and end to end, and the cores each process used
    over the end-to-end run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=120)
    speed, cores = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    rates = [best.in_process.tokens_per_s, best.end_to_end.tokens_per_s]
    bars = speed.bar(["in-process engine", "end to end"], rates, color=["#9a9a9a", "#1f77b4"])
    speed.bar_label(bars, labels=[f"{r:.0f}" for r in rates], fontsize=8)
    speed.set_ylabel("output tokens/s")
    speed.set_title(f"end to end ÷ in-process: {best.raw_ratio:.3f} raw, {best.scaled_ratio:.3f} scaled",
                    fontsize=9)
    speed.margins(y=0.15)
    e2e = best.end_to_end
    used = sorted(e2e.cpu_s.items(), key=lambda kv: kv[1])
    cores.barh([name for name, _ in used], [seconds / e2e.wall_s for _, seconds in used], color="#1f77b4")
    cores.axvline(os.cpu_count() or 1, color="grey", linestyle=":", label="cores of the machine")
    cores.set_xlabel("cores used over the end-to-end run")
    cores.legend(fontsize=8, loc="lower right")
    fig.suptitle("sluice bench pipeline", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


# ---- the command line ------------------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(p) for p in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from exc
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench pipeline",
        description="Output tokens/s of one workload through the four services against the engine "
        "alone, with where the difference goes.",
    )
    add = parser.add_argument
    add("--model", default="", help="model directory (default: the embedded model)")
    add("--num-requests", type=int, default=64, metavar="N", help="requests, all sent at once (default 64)")
    add("--prompt-words", type=_pair, default=(12, 200), metavar="MIN,MAX", help="prompt words (12,200)")
    add("--output-len", type=_pair, default=(8, 256), metavar="MIN,MAX", help="output tokens (8,256)")
    add("--seed", type=int, default=0, help="seed of the workload")
    add("--api", choices=("openai", "ws", "grpc"), default="openai", help="the gateway API to drive")
    add("--engine-flags", default="", metavar="FLAGS",
        help="engine flags for both runs, e.g. \"--max-num-batched-tokens 1024\"")
    add("--repeat", type=int, default=1, metavar="N", help="alternate the two runs N times, best of each")
    add("--json", type=Path, default=None, metavar="FILE", help="write every run and the ratios here")
    add("--plot", type=Path, default=None, metavar="FILE.png", help="write tokens/s and cores used here")
    add("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.repeat < 1:
        parser.error("--num-requests and --repeat must be at least 1")
    engine_flags = shlex.split(args.engine_flags)
    model = resolve_model(args.model)
    requests = uniform_requests(args.num_requests, args.seed, prompt_words=args.prompt_words,
                                output_len=args.output_len)
    (words_lo, words_hi), (out_lo, out_hi) = args.prompt_words, args.output_len
    print(f"workload: {len(requests)} requests at once, prompts {words_lo}-{words_hi} words, outputs "
          f"{out_lo}-{out_hi} tokens ({sum(r.output_len for r in requests)} in all), greedy; api {args.api}; "
          f"model {model}")
    in_process: list[InProcessRun] = []
    end_to_end: list[EndToEndRun] = []
    try:
        with Stack(StackOptions(model=model, engine_flags=tuple(engine_flags))) as stack:
            for k in range(args.repeat):
                print(f"[{k + 1}/{args.repeat}] in-process engine ...", file=sys.stderr)
                in_process.append(run_in_process(model, engine_flags, requests))
                print(f"[{k + 1}/{args.repeat}] end to end ...", file=sys.stderr)
                end_to_end.append(run_end_to_end(stack, args.api, requests, not args.no_progress))
    except RuntimeError as exc:
        print(f"sluice bench pipeline: {exc}", file=sys.stderr)
        return 1
    best = Comparison(max(in_process, key=lambda r: r.tokens_per_s),
                      max(end_to_end, key=lambda r: r.tokens_per_s))
    print()
    print("\n".join(best.lines()))
    if args.json is not None:
        payload = {
            "meta": run_meta(["pipeline", *argv]),
            "best": best.to_json(),
            "runs": [Comparison(i, e).to_json() for i, e in zip(in_process, end_to_end, strict=True)],
        }
        write_json_doc(args.json, payload)
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(args.plot, best)
        print(f"wrote {args.plot}")
    failed = any(e.summary["failed"] for e in end_to_end)
    return 1 if failed else 0
