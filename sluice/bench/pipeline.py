"""`sluice bench pipeline`: one workload through the engine in-process and through the four-service trip,
output tokens/s both ways, raw and scaled by the share of the machine the load generator leaves
(docs/benchmarks.md), and where the difference goes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from sluice.bench import engine_driver as drv
from sluice.bench import sweep as sw
from sluice.bench.common import int_range
from sluice.bench.report import format_pipeline, write_json
from sluice.bench.serve_data import BenchRequest, uniform_requests
from sluice.plan import default_engine_threads

WARMUP_REQUESTS = 4
# Histograms read from each service's /metrics: (service, metric family, label filter, report name).
GATEWAY_STAGES = "sluice_gateway_stage_duration_seconds"
STAGE_HISTOGRAMS = (
    ("engine", "sluice_step_duration_seconds", {}, "engine step"),
    ("tokenizer", "sluice_tokenize_duration_seconds", {}, "tokenizer batch"),
    ("detokenizer", "sluice_detokenize_duration_seconds", {}, "detokenizer batch"),
    ("gateway", GATEWAY_STAGES, {"stage": "tokenize"}, "gateway: tokenize"),
    ("gateway", GATEWAY_STAGES, {"stage": "engine_first_token"}, "gateway: submit → first tokens"),
    ("gateway", GATEWAY_STAGES, {"stage": "detokenize"}, "gateway: first tokens → first text"),
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


def run_in_process(
    model: str, engine_flags: list[str], requests: list[BenchRequest], threads: int
) -> InProcessRun:
    """Tokenizes the prompts as the tokenizer service does for a completion, then steps the engine
    core until every request is done. The engine gets the flags `sluice up` gives the service (`threads`:
    the default of `sluice up`, decided once for both runs by `main`, whatever `--up-flags` give the
    end-to-end engine), then `engine_flags`."""
    from services.tokenizer.core import TokenizerCore

    prompts = TokenizerCore(model).encode_batch([r.prompt for r in requests], add_special_tokens=True)
    engine = drv.engine_from_flags(["--model", model, "--threads", str(threads), *engine_flags])
    drv.warm_up(engine, prompts[0])
    cpu = time.process_time()
    outputs, wall = drv.generate(engine, prompts, [r.output_len for r in requests])
    stats = engine.stats()
    tokens = sum(len(ids) for ids in outputs)
    cpu = time.process_time() - cpu
    return InProcessRun(tokens, wall, cpu, stats.steps, stats.step_time_s, stats.forward_time_s)


def run_end_to_end(endpoint: sw.Endpoint, requests: list[BenchRequest], progress: bool) -> EndToEndRun:
    """Warms the stack up, then sends every request at once (OpenAI completions) and reads what each process
    spent (CPU seconds from the OS, stage times from the services' own histograms)."""
    sw.serve_load(endpoint, requests[:WARMUP_REQUESTS], progress=False)
    cpu_before, stages_before = endpoint.cpu_seconds(), _stage_totals(endpoint)
    result = sw.serve_load(endpoint, requests, progress=progress)
    cpu = sw.cpu_used(cpu_before, endpoint.cpu_seconds())
    stages_after = _stage_totals(endpoint)
    cpu["load generator"] = result.client_cpu_s
    stages = {
        name: (count - stages_before[name][0], total - stages_before[name][1])
        for name, (count, total) in stages_after.items()
    }
    return EndToEndRun(result.summary(), result.duration_s, cpu, stages)


def _stage_totals(endpoint: sw.Endpoint) -> dict[str, tuple[int, float]]:
    """(count, sum in seconds) of each histogram in STAGE_HISTOGRAMS, as the services report now."""
    scraped = {name: sw.scrape_metrics(url) for name, url in endpoint.metrics_urls.items()}
    totals = {}
    for service, family, labels, name in STAGE_HISTOGRAMS:
        samples = scraped.get(service, {})
        count = samples.get((f"{family}_count", tuple(sorted(labels.items()))), 0.0)
        total = samples.get((f"{family}_sum", tuple(sorted(labels.items()))), 0.0)
        totals[name] = (int(count), total)
    return totals


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

    def to_json(self) -> dict[str, Any]:
        inp, e2e = self.in_process, self.end_to_end
        return {
            "in_process": {**asdict(inp), "tokens_per_s": inp.tokens_per_s},
            "end_to_end": {
                **asdict(e2e),
                "tokens_per_s": e2e.tokens_per_s,
                "generator_share": e2e.generator_share,
            },
            "raw_ratio": self.raw_ratio,
            "scaled_ratio": self.scaled_ratio,
        }


def build_parser() -> argparse.ArgumentParser:
    about = "Output tokens/s of one workload through the four services against the engine alone, with where "
    parser = argparse.ArgumentParser(prog="sluice bench pipeline", description=about + "the difference goes.")
    add = parser.add_argument
    add("--prompt-words", type=int_range, default=(12, 200), metavar="MIN,MAX", help="prompt words (12,200)")
    add("--output-len", type=int_range, default=(8, 256), metavar="MIN,MAX", help="output tokens (8,256)")
    helps = {
        "num_requests": "requests, all sent at once (default 64)",
        "repeat": "alternate the two runs N times",
    }
    sw.add_sweep_flags(parser, 64, "repeat", **helps)
    about = '`sluice up` flags of the end-to-end run, e.g. "--engine-threads 1 --light-nice 0" (the '
    about += "in-process engine keeps sluice up's default threads; OMP_WAIT_POLICY=PASSIVE as sluice up's "
    about += "children have it: docs/benchmarks.md)"
    add("--up-flags", default="", metavar="FLAGS", help=about)
    return parser


def load_average() -> str:
    """The host's 1, 5 and 15 minute load averages ("n/a" where the OS has none)."""
    try:
        return " / ".join(f"{load:.2f}" for load in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model, engine_flags = sw.model_and_flags(args)
    lengths = {"prompt_words": args.prompt_words, "output_len": args.output_len}
    requests = uniform_requests(args.num_requests, args.seed, **lengths)
    (words_lo, words_hi), (out_lo, out_hi) = args.prompt_words, args.output_len
    print(
        f"workload: {len(requests)} requests at once, prompts {words_lo}-{words_hi} words, outputs "
        f"{out_lo}-{out_hi} tokens ({sum(r.output_len for r in requests)} in all), greedy; "
        f"model {model}; sluice up {args.up_flags or '(defaults)'}"
    )
    loads = [load_average()]
    # `sluice up`'s default threads depend on the load when it starts: decided once here, so that the
    # in-process engine and the end-to-end one get the same unless --up-flags say otherwise.
    threads = default_engine_threads()
    up_flags = shlex.split(args.up_flags)
    if not any(flag.startswith("--engine-threads") for flag in up_flags):
        up_flags = ["--engine-threads", str(threads), *up_flags]

    def measure(system: str, endpoint: sw.Endpoint, k: int, index: int) -> Comparison:
        print(f"[{k + 1}/{args.repeat}] in-process engine ...", file=sys.stderr)
        in_process = run_in_process(model, engine_flags, requests, threads)
        print(f"[{k + 1}/{args.repeat}] end to end ...", file=sys.stderr)
        return Comparison(in_process, run_end_to_end(endpoint, requests, not args.no_progress))

    opener = partial(sw.stack_endpoint, model, engine_flags, up_flags=tuple(up_flags))
    (run,) = sw.sweep({"pipeline": opener}, range(args.repeat), measure).values()
    if run.error is not None:
        print(f"sluice bench pipeline: {run.error}", file=sys.stderr)
        return 1
    best = Comparison(
        max((c.in_process for c in run.points), key=lambda r: r.tokens_per_s),
        max((c.end_to_end for c in run.points), key=lambda r: r.tokens_per_s),
    )
    loads.append(load_average())
    print("\n" + format_pipeline(best))
    print(f"load average (1/5/15 min): {loads[0]} at the start, {loads[1]} at the end")
    doc = {"meta": sw.sweep_meta("pipeline", argv, model, load_average=loads), "best": best.to_json()}
    write_json(args.json, {**doc, "runs": [c.to_json() for c in run.points]}, announce=True)
    return 1 if any(c.end_to_end.summary["failed"] for c in run.points) else 0
