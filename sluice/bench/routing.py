"""`sluice bench routing`: the gateway's engine routing policies (round_robin, least_load,
prefix_affinity) compared across engine replicas on `sluice bench serve`'s shared-prefix workload (many
tenants, each with a long shared context).

Usage: `sluice bench routing [--model DIR] [--engines 2] [--policies ...] [--num-requests 96]
[--num-prefixes 8] [--prefix-len 512] [--suffix-len 32] [--output-len 32] [--rate inf] [--seed 0]
[--engine-flags "--num-kv-blocks 256"] [--repeat N] [--json FILE] [--no-progress]`.

For each policy it starts the whole pipeline with `--engines N` (`Stack`, the gateway's `SLUICE_ROUTING`
set to the policy), runs the same seeded workload through the OpenAI API, and reads each engine's
prefix-cache counters from its /metrics. It prints, per policy, output tokens/s, p90 time to first
token, the prefix-cache hit rate and the share of prompt tokens each engine got, and the throughput and
p90 TTFT relative to round_robin. With `--repeat N` it runs N rounds, the policies in alternating order
(so drift of a shared machine falls on each alike), prints each round, and then the median over rounds
of each policy's ratios to round_robin within the same round. Exit status 0 when every policy completed
every request, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import ROUTING_POLICIES
from sluice.bench.serve import ServeConfig, run_serve
from sluice.bench.serve_data import shared_prefix_requests
from sluice.bench.stack import Stack, StackOptions
from sluice.launcher import resolve_model

NUM_WARMUP = 2
BASELINE = "round_robin"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sluice bench routing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="", help="model directory ('' = the embedded model)")
    parser.add_argument("--engines", type=int, default=2, help="engine replicas")
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES), help="comma-separated")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--num-prefixes", type=int, default=8, help="tenants, each with its own context")
    parser.add_argument("--prefix-len", type=int, default=512, help="words of each tenant's context")
    parser.add_argument("--suffix-len", type=int, default=32, help="words of each request's own question")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-flags", default="", help="extra engine flags, e.g. '--num-kv-blocks 256'")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every policy, alternating order")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in ROUTING_POLICIES]
    if unknown or not policies:
        parser.error(f"--policies: one or more of {', '.join(ROUTING_POLICIES)}")
    if args.engines < 1:
        parser.error("--engines must be >= 1")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    args.policies = policies
    return args


def _counter(text: str, name: str) -> float:
    """The sum of a counter's samples in a Prometheus exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == f"{name}_total" or s.name == name)
    return 0.0


def _engine_counters(stack: Stack) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, url in stack.metrics_urls.items():
        if not name.startswith("engine"):
            continue
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        out[name] = {
            "prompt_tokens": _counter(text, "sluice_prompt_tokens"),
            "prefix_queries": _counter(text, "sluice_prefix_cache_queries"),
            "prefix_hits": _counter(text, "sluice_prefix_cache_hits"),
        }
    return out


def run_policy(args: argparse.Namespace, model: str, policy: str) -> dict[str, Any]:
    requests = shared_prefix_requests(
        args.num_requests,
        args.seed,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        output_len=args.output_len,
    )
    options = StackOptions(
        model=model,
        engines=args.engines,
        env={"SLUICE_ROUTING": policy},
        engine_flags=tuple(shlex.split(args.engine_flags)),
    )
    with Stack(options) as stack:
        config = ServeConfig(
            api="openai",
            url=stack.openai_url,
            request_rate=args.rate,
            num_warmup=NUM_WARMUP,
            seed=args.seed,
            progress=not args.no_progress,
        )
        result = uvloop.run(run_serve(config, requests))
        engines = _engine_counters(stack)
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
        "prefix_hit_rate": sum(e["prefix_hits"] for e in engines.values()) / queries if queries else 0.0,
        "prompt_token_share": {name: e["prompt_tokens"] / prompt_tokens for name, e in engines.items()},
        "errors": summary["errors"],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["policy"] == BASELINE), None)
    lines = [
        f"{'policy':<16}{'out tok/s':>11}{'p90 TTFT ms':>13}{'prefix hits':>13}{'x tok/s':>9}{'x p90':>8}"
        "  prompt-token share"
    ]
    for r in rows:
        speed = r["output_throughput"] / base["output_throughput"] if base else float("nan")
        ttft = r["ttft_p90_ms"] / base["ttft_p90_ms"] if base else float("nan")
        share = " ".join(f"{v:.2f}" for v in r["prompt_token_share"].values())
        lines.append(
            f"{r['policy']:<16}{r['output_throughput']:>11.1f}{r['ttft_p90_ms']:>13.0f}"
            f"{r['prefix_hit_rate']:>13.2f}{speed:>9.2f}{ttft:>8.2f}  {share}"
        )
    return "\n".join(lines)


def round_order(policies: list[str], index: int) -> list[str]:
    """The order of round `index`: as given in even rounds, reversed in odd ones."""
    return list(policies) if index % 2 == 0 else list(reversed(policies))


def median_ratios(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per policy, the median over rounds of its output tokens/s and p90 TTFT divided by round_robin's
    in the same round (rounds without round_robin are left out)."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for rows in rounds:
        base = next((r for r in rows if r["policy"] == BASELINE), None)
        if base is None:
            continue
        for r in rows:
            entry = ratios.setdefault(r["policy"], {"tok_s": [], "ttft_p90": []})
            entry["tok_s"].append(r["output_throughput"] / base["output_throughput"])
            entry["ttft_p90"].append(r["ttft_p90_ms"] / base["ttft_p90_ms"])
    return {p: {k: statistics.median(v) for k, v in e.items()} for p, e in ratios.items()}


def format_medians(medians: dict[str, dict[str, float]], num_rounds: int) -> str:
    lines = [f"median over {num_rounds} rounds, relative to {BASELINE} in the same round:"]
    for policy, m in medians.items():
        lines.append(f"  {policy:<16} x tok/s {m['tok_s']:.2f}   x p90 TTFT {m['ttft_p90']:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model = str(resolve_model(args.model))
    rounds: list[list[dict[str, Any]]] = []
    for index in range(args.repeat):
        by_policy = {p: run_policy(args, model, p) for p in round_order(args.policies, index)}
        rounds.append([by_policy[p] for p in args.policies])
        if args.repeat > 1:
            print(f"round {index + 1} of {args.repeat}")
        print(format_table(rounds[-1]))
    medians = median_ratios(rounds)
    if args.repeat > 1:
        print(format_medians(medians, len(rounds)))
    if args.json is not None:
        doc = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "rounds": rounds,
               "results": rounds[-1], "median_ratios": medians}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0 if all(r["failed"] == 0 for rows in rounds for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
