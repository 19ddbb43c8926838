"""`sluice bench routing`: the gateway's engine routing policies across engine replicas on the
shared-prefix workload (docs/benchmarks.md), rounds with the policies in alternating order. Exit status 0
when every policy completed every request, 1 otherwise (also when a stack failed to start).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

from gateway.choices import ROUTING_POLICIES
from sluice.bench import sweep as sw
from sluice.bench.common import names, positive_int
from sluice.bench.report import ROUTING_BASELINE, format_medians, format_rows, ratio, write_json
from sluice.bench.serve_data import shared_prefix_requests

NUM_WARMUP = 2


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice bench routing", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--engines", type=positive_int, default=2, help="engine replicas")
    policies = names(ROUTING_POLICIES, "policy")
    add("--policies", type=policies, default=ROUTING_POLICIES, help="comma-separated")
    add("--num-prefixes", type=int, default=8, help="tenants, each with its own context")
    add("--prefix-len", type=int, default=512, help="words of each tenant's context")
    add("--suffix-len", type=int, default=32, help="words of each request's own question")
    add("--output-len", type=int, default=32, help="tokens generated per request")
    add("--rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    helps = {"num_requests": "requests (default 96)", "repeat": "rounds of every policy, alternating order"}
    sw.add_sweep_flags(parser, 96, "repeat", **helps)
    return parser.parse_args(argv)


def _engine_counters(endpoint: sw.Endpoint) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, url in endpoint.metrics_urls.items():
        if name.startswith("engine"):
            samples = sw.scrape_metrics(url)
            out[name] = {
                "prompt_tokens": sw.counter(samples, "sluice_prompt_tokens"),
                "prefix_queries": sw.counter(samples, "sluice_prefix_cache_queries"),
                "prefix_hits": sw.counter(samples, "sluice_prefix_cache_hits"),
            }
    return out


def measure(
    args: argparse.Namespace, policy: str, endpoint: sw.Endpoint, rate: float, index: int
) -> dict[str, Any]:
    """The workload through `policy`'s stack: the load generator's figures and the engines' prefix cache."""
    shape = {name: getattr(args, name) for name in ("num_prefixes", "prefix_len", "suffix_len", "output_len")}
    requests = shared_prefix_requests(args.num_requests, args.seed, **shape)
    load = dict(request_rate=rate, num_warmup=NUM_WARMUP, seed=args.seed, progress=not args.no_progress)
    result = sw.serve_load(endpoint, requests, **load)
    engines = _engine_counters(endpoint)
    summary = result.summary()
    queries = sum(e["prefix_queries"] for e in engines.values())
    prompt_tokens = sum(e["prompt_tokens"] for e in engines.values()) or 1.0
    return {
        "policy": policy,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "output_throughput": summary["output_throughput"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "prefix_hit_rate": ratio(sum(e["prefix_hits"] for e in engines.values()), queries) or 0.0,
        "prompt_token_share": {name: e["prompt_tokens"] / prompt_tokens for name, e in engines.items()},
        "errors": summary["errors"],
    }


def round_order(policies: list[str], index: int) -> list[str]:
    """The order of round `index`: as given in even rounds, reversed in odd ones."""
    return list(policies) if index % 2 == 0 else list(reversed(policies))


def median_ratios(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per policy, the median over rounds of its output tokens/s and p90 TTFT divided by round_robin's
    in the same round (rounds without round_robin are left out)."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for rows in rounds:
        base = next((r for r in rows if r["policy"] == ROUTING_BASELINE), None)
        if base is None:
            continue
        for r in rows:
            entry = ratios.setdefault(r["policy"], {"tok_s": [], "ttft_p90": []})
            entry["tok_s"].append(r["output_throughput"] / base["output_throughput"])
            entry["ttft_p90"].append(r["ttft_p90_ms"] / base["ttft_p90_ms"])
    return {p: {k: statistics.median(v) for k, v in e.items()} for p, e in ratios.items()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    model, engine_flags = sw.model_and_flags(args)
    rounds: list[list[dict[str, Any]]] = []
    for index in range(args.repeat):
        opener = partial(sw.stack_endpoint, model, engine_flags, engines=args.engines)
        openers = {p: partial(opener, env={"SLUICE_ROUTING": p}) for p in round_order(args.policies, index)}
        runs = sw.sweep(openers, [args.rate], partial(measure, args))
        failed = {p: run.error for p, run in runs.items() if run.error is not None}
        if failed:
            print(f"sluice bench routing: {failed}", file=sys.stderr)
            return 1
        rounds.append([runs[p].points[0] for p in args.policies])
        if args.repeat > 1:
            print(f"round {index + 1} of {args.repeat}")
        print(format_rows(rounds[-1]))
    medians = median_ratios(rounds)
    if args.repeat > 1:
        print(format_medians(medians, len(rounds)))
    config = {k: v for k, v in vars(args).items() if k != "json"}
    doc = {"meta": sw.sweep_meta("routing", argv, model), "config": config, "rounds": rounds}
    write_json(args.json, {**doc, "results": rounds[-1], "median_ratios": medians})
    return 0 if all(r["failed"] == 0 for rows in rounds for r in rows) else 1
