"""`sluice bench compare`: output tokens/s and p99 TTFT against request rate for sluice's batching policies
(one pipeline each) on one seeded workload of streaming OpenAI completions, greedy and stopping at EOS, so
that every policy generates the same tokens; "(EOS)" marks points that produced fewer than max_tokens.
Exit status 0 when every policy ran every point, 1 when one failed to start or a point completed no
request, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sluice.bench import sweep as sw
from sluice.bench.common import add_count, names, positive_float, positive_list, progress_bar
from sluice.bench.engine_driver import BATCHING_POLICIES
from sluice.bench.report import compare_json, fmt, format_points, rate_text, write_json
from sluice.bench.serve_data import BenchRequest, synthetic_requests

HEADLINE = "continuous"
BASELINE = "static"
DEFAULT_RATES = (2.0, 8.0, 32.0, math.inf)
NUM_WARMUP = 4  # requests sent and awaited before a policy's first point
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Point:
    """One run of the workload at one request rate against one policy's pipeline."""

    system: str
    rate: float
    summary: dict[str, Any]  # ServeResult.summary()
    asked_tokens: int  # output tokens the completed requests asked for
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per service in the run

    @property
    def completed(self) -> int:
        return int(self.summary["completed"])

    @property
    def tokens_per_s(self) -> float | None:
        return float(self.summary["output_throughput"]) if self.completed else None

    @property
    def ttft_p99_ms(self) -> float | None:
        return self.summary["ttft_ms"]["p99"]

    @property
    def short_of_tokens(self) -> bool:
        """Whether the completed requests produced fewer tokens than they asked for (stopped at EOS)."""
        return int(self.summary["total_output_tokens"]) < self.asked_tokens


def _rates(text: str) -> tuple[float, ...]:
    return tuple(sorted(set(positive_list(text, float, "request rates (numbers or inf)"))))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice bench compare", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    about = f"sluice batching policies to run (default {','.join(BATCHING_POLICIES[::-1])})"
    policies = names(BATCHING_POLICIES, "policy")
    add("--policies", type=policies, default=BATCHING_POLICIES[::-1], metavar="LIST", help=about)
    about = "request rates in requests/s, inf = all at once (default 2,8,32,inf)"
    add("--rates", type=_rates, default=DEFAULT_RATES, metavar="LIST", help=about)
    add_count(parser, "--input-len", 64, "mean prompt words (default 64)")
    add_count(parser, "--output-len", 128, "mean output tokens (default 128)")
    about = "p99 TTFT bound of the highest-rate figure (default 1000)"
    add("--ttft-bound-ms", type=positive_float, default=1000.0, metavar="MS", help=about)
    about = "requests per point (default 64: at rate inf, 64 streams at once)"
    sw.add_sweep_flags(parser, 64, num_requests=about)
    return parser


def run_point(
    system: str, endpoint: sw.Endpoint, rate: float, requests: list[BenchRequest], seed: int, warm_up: bool
) -> Point:
    """One run of the workload at `rate` (after NUM_WARMUP requests when `warm_up`), greedy, each request
    ending at EOS or max_tokens."""
    before = endpoint.cpu_seconds()
    warmup = NUM_WARMUP if warm_up else 0
    load = {"request_rate": rate, "num_warmup": warmup, "ignore_eos": False, "seed": seed, "progress": False}
    result = sw.serve_load(endpoint, requests, **load, request_timeout_s=REQUEST_TIMEOUT_S)
    asked = sum(req.output_len for req, rec in zip(requests, result.records, strict=True) if rec.ok)
    return Point(system, rate, result.summary(), asked, sw.cpu_used(before, endpoint.cpu_seconds()))


def highest_rate_under(run: sw.SystemRun, bound_ms: float, num_requests: int) -> float | None:
    """The highest rate r such that at every rate up to r every request completed with p99 TTFT within
    `bound_ms`; None when the lowest rate already missed (or the system did not run)."""
    best = None
    for point in run.points:
        p99 = point.ttft_p99_ms
        if point.completed < num_requests or p99 is None or p99 > bound_ms:
            break
        best = point.rate
    return best


def capacity_ratio(
    head: float | None, base: float | None, rates: Sequence[float]
) -> tuple[float | None, str]:
    """HEADLINE's highest rate under the bound ÷ BASELINE's, and a note on what the value is. The sweep only
    brackets each limit, so the value is a lower bound ("at least") when HEADLINE held the bound at rate
    inf or BASELINE at no rate, and None when the sweep cannot bracket the ratio."""
    finite = [r for r in rates if math.isfinite(r)]
    if head is None:
        return None, f"{HEADLINE} held the bound at no rate tried"
    if not finite:
        return None, "the sweep has no finite rate"
    if base is not None and math.isinf(base) and math.isinf(head):
        return None, "both held the bound at every rate: the sweep did not reach their limits"
    notes = []
    if math.isinf(head):
        head = max(finite)
        notes.append(f"{HEADLINE} held the bound at every rate, inf too")
    if base is None:
        base = min(finite)
        notes.append(f"{BASELINE} held it at no rate tried")
    elif math.isinf(base):
        base = max(finite)
    return head / base, f"at least: {'; '.join(notes)}" if notes else ""


def _report(args: argparse.Namespace, runs: dict[str, sw.SystemRun], meta: dict[str, Any]) -> int:
    """Prints the table, capacities and their ratio, writes the JSON; returns the exit status."""
    bound, n = args.ttft_bound_ms, args.num_requests
    capacities = {name: highest_rate_under(run, bound, n) for name, run in runs.items()}
    print(f"\n{format_points(runs, args.num_requests)}")
    print(f"\nhighest request rate with p99 TTFT ≤ {args.ttft_bound_ms:g} ms at it and every lower rate:")
    for name, best in capacities.items():
        shown = "none of the rates tried" if best is None else f"{rate_text(best)} req/s"
        print(f"  sluice-{name:<15} {shown}")
    value, note = capacity_ratio(capacities.get(HEADLINE), capacities.get(BASELINE), args.rates)
    print(f"{HEADLINE}'s highest rate ÷ {BASELINE}'s: {fmt(value, '.3g')}" + (f" ({note})" if note else ""))
    write_json(args.json, compare_json(runs, capacities, (value, note), meta), announce=True)
    failed = any(run.error is not None or any(not p.completed for p in run.points) for run in runs.values())
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model, engine_flags = sw.model_and_flags(args)
    lengths = {"input_len": args.input_len, "output_len": args.output_len}
    requests = synthetic_requests(args.num_requests, args.seed, **lengths)
    asked = sum(r.output_len for r in requests)
    workload = {"num_requests": args.num_requests, **lengths, "asked_output_tokens": asked, "seed": args.seed}
    workload["api"] = "openai"
    more = {"rates": list(args.rates), "ttft_bound_ms": args.ttft_bound_ms}
    meta = sw.sweep_meta("compare", argv, model, workload=workload, **more)
    openers: dict[str, sw.Opener] = {
        policy: partial(sw.stack_endpoint, model, engine_flags, batching=policy, metrics=False)
        for policy in args.policies
    }
    rates = ", ".join(map(rate_text, args.rates))
    print(f"model: {model}; {args.num_requests} requests per point; rates {rates} req/s")

    def measure(system: str, endpoint: sw.Endpoint, rate: float, k: int) -> Point:
        return run_point(system, endpoint, rate, requests, args.seed, warm_up=k == 0)

    with progress_bar(not args.no_progress, len(openers) * len(args.rates), "points", unit="pt") as bar:
        runs = sw.sweep(openers, args.rates, measure, bar)
    return _report(args, runs, meta)
