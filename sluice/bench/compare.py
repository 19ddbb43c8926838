"""`sluice bench compare`: sluice's three batching policies, and transformers' own server, under a sweep
of request rates.

Usage: `sluice bench compare [--model DIR] [--policies static,dynamic,continuous] [--rates 2,8,32,inf]
[--num-requests 64] [--input-len 64] [--output-len 128] [--seed 0] [--ttft-bound-ms 1000] [--no-peer]
[--json FILE] [--plot FILE.png] [--no-progress]`.

For each policy it starts the whole pipeline (`Stack`) once and runs `sluice bench serve`'s load
generator (`run_serve`, OpenAI streaming completions, Poisson arrivals) at each rate on one seeded
workload; then, unless `--no-peer`, the same against `transformers serve --continuous-batching` on the
same model (`PeerServer`). Exit status 0 when every system ran every point, 1 when a system failed to
start or a point completed no request, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import uvloop
from tqdm import tqdm

from services.engine.settings import BATCHING_POLICIES
from sluice.bench.engine_report import Target
from sluice.bench.serve import ServeConfig, run_meta, run_serve
from sluice.bench.serve_data import BenchRequest, synthetic_requests
from sluice.bench.serve_report import write_json_doc
from sluice.bench.stack import PeerServer, Stack, StackOptions
from sluice.launcher import resolve_model

PEER = "transformers-serve"  # `transformers serve --continuous-batching` on the same model
HEADLINE = "continuous"
BASELINE = "static"
DEFAULT_RATES = (2.0, 8.0, 32.0, math.inf)
NUM_WARMUP = 4  # requests sent and awaited before a system's first point
REQUEST_TIMEOUT_S = 300.0
PEER_SPEED_TARGET = 2.0  # sluice-continuous output tokens/s ÷ the peer's, at least
PEER_TTFT_TARGET = 0.5  # sluice-continuous p99 TTFT ÷ the peer's, at most
CAPACITY_TARGET = 3.0  # continuous's highest rate under the TTFT bound ÷ static's, at least

DESCRIPTION = """\
Measures output tokens/s and p99 time to first token (TTFT) against request rate for sluice's
batching policies (static, dynamic, continuous: one pipeline each, started here) and for
`transformers serve --continuous-batching` on the same model (the peer), on one seeded workload of
random-word prompts sent as streaming OpenAI completions with Poisson arrivals (rate inf: all at
once). Prints a table of every point, sluice-continuous ÷ peer at each rate, and per policy the
highest rate whose p99 TTFT stays under --ttft-bound-ms; the targets (continuous's highest rate ≥ 3×
static's; sluice-continuous ≥ 2× the peer's tokens/s with ≤ 0.5× its p99 TTFT, read at the highest
rate) are printed as MET / NOT MET / NOT MEASURED. Every system runs the same requests greedily and
stops at EOS (the peer does not accept ignore_eos), so each generates the same tokens; tokens/s counts
the tokens produced, and "(EOS)" marks points that produced fewer than max_tokens. The defaults take
about 4 minutes on a 2-core CPU with the embedded model."""


@dataclass(frozen=True)
class Point:
    """One run of the workload at one request rate against one system."""

    system: str
    rate: float
    summary: dict[str, Any]  # ServeResult.summary()
    asked_tokens: int  # output tokens the completed requests asked for
    cpu_s: dict[str, float] = field(default_factory=dict)  # sluice: CPU seconds per service in the run

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


@dataclass
class SystemRun:
    """A system's points in rate order, or why it could not be started."""

    name: str
    points: list[Point] = field(default_factory=list)
    error: str | None = None


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers or inf, got {text!r}") from exc
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive request rates, got {text!r}")
    return tuple(sorted(set(rates)))


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in BATCHING_POLICIES]
    if unknown or not names:
        choices = ", ".join(BATCHING_POLICIES)
        raise argparse.ArgumentTypeError(f"unknown policy {unknown}; choose from {choices}")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench compare",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="", metavar="DIR", help="model directory (default: the embedded model)")
    policies = ",".join(BATCHING_POLICIES[::-1])
    add("--policies", type=_policies, default=BATCHING_POLICIES[::-1], metavar="LIST",
        help=f"sluice batching policies to run (default {policies})")
    add("--rates", type=_rates, default=DEFAULT_RATES, metavar="LIST",
        help="request rates in requests/s, inf = all at once (default 2,8,32,inf)")
    add("--num-requests", type=_positive_int, default=64, metavar="N",
        help="requests per point (default 64: at rate inf, 64 streams at once)")
    add("--input-len", type=_positive_int, default=64, metavar="N",
        help="mean prompt words, about one token each (default 64)")
    add("--output-len", type=_positive_int, default=128, metavar="N",
        help="mean output tokens asked for (default 128)")
    add("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    add("--ttft-bound-ms", type=_positive_float, default=1000.0, metavar="MS",
        help="p99 TTFT bound of the highest-rate figure (default 1000)")
    add("--no-peer", action="store_true", help="skip transformers serve")
    add("--json", type=Path, default=None, metavar="FILE", help="write every point and the run's meta here")
    add("--plot", type=Path, default=None, metavar="FILE.png",
        help="write tokens/s and p99 TTFT against request rate here")
    add("--no-progress", action="store_true", help="hide the progress bar")
    return parser


# ---- running ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """A started system as the load generator drives it."""

    url: str  # OpenAI API base
    model: str | None  # the "model" field; None = the first of GET /models
    cpu_seconds: Callable[[], dict[str, float]]  # CPU seconds per process so far ({} when unknown)


Opener = Callable[[], AbstractContextManager[Endpoint]]


@contextmanager
def sluice_endpoint(model: str, policy: str) -> Iterator[Endpoint]:
    """The whole sluice pipeline with the engine's batching `policy`, for the life of the context."""
    with Stack(StackOptions(model, batching=policy, metrics=False)) as stack:
        yield Endpoint(stack.openai_url, None, stack.cpu_seconds)


@contextmanager
def peer_endpoint(model: str) -> Iterator[Endpoint]:
    """`transformers serve --continuous-batching` on `model`, for the life of the context."""
    with PeerServer(model) as peer:
        yield Endpoint(peer.openai_url, peer.model, dict)


def run_point(
    system: str, endpoint: Endpoint, rate: float, requests: list[BenchRequest], seed: int, warm_up: bool
) -> Point:
    """One run of the workload at `rate` (after NUM_WARMUP requests when `warm_up`), greedy, each request
    ending at EOS or max_tokens: the same for every system, since the peer rejects ignore_eos."""
    config = ServeConfig(
        api="openai", url=endpoint.url, model=endpoint.model, request_rate=rate,
        num_warmup=NUM_WARMUP if warm_up else 0, ignore_eos=False, seed=seed,
        request_timeout_s=REQUEST_TIMEOUT_S, progress=False,
    )
    before = endpoint.cpu_seconds()
    result = uvloop.run(run_serve(config, requests))
    after = endpoint.cpu_seconds()
    asked = sum(req.output_len for req, rec in zip(requests, result.records, strict=True) if rec.ok)
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    return Point(system, rate, result.summary(), asked, used)


def run_system(
    system: str, opener: Opener, rates: Sequence[float], requests: list[BenchRequest], seed: int, bar: tqdm
) -> SystemRun:
    """Starts the system once and runs the workload at each rate in turn, warming it up before the
    first; a start-up failure is recorded in the run and the progress bar skips its points."""
    run = SystemRun(system)
    try:
        with opener() as endpoint:
            for rate in rates:
                bar.set_postfix_str(f"{_label(system)} @ {_rate_text(rate)} req/s")
                run.points.append(run_point(system, endpoint, rate, requests, seed, warm_up=not run.points))
                bar.update()
    except (RuntimeError, OSError) as exc:
        run.error = str(exc)
        bar.update(len(rates) - len(run.points))
    return run


# ---- figures ----------------------------------------------------------------------------------------


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _label(system: str) -> str:
    return system if system == PEER else f"sluice-{system}"


def highest_rate_under(run: SystemRun, bound_ms: float, num_requests: int) -> float | None:
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
    """HEADLINE's highest rate under the bound ÷ BASELINE's, and a note on what the value is.

    The sweep only brackets each limit: a system that held the bound at rate inf held it at least up to
    the highest finite rate, one that held it at no rate has its limit below the lowest rate. So the
    value is a lower bound ("at least") when HEADLINE held at inf or BASELINE at no rate, and None when
    the sweep cannot bracket the ratio."""
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


def peer_ratios(head: SystemRun, peer: SystemRun) -> list[dict[str, Any]]:
    """At each rate both ran: sluice-continuous ÷ peer output tokens/s and p99 TTFT ratio (None where a
    side completed nothing), and the peer's requests completed, tokens produced and tokens asked for."""
    peer_points = {p.rate: p for p in peer.points}
    rows = []
    for point in head.points:
        other = peer_points.get(point.rate)
        if other is None:
            continue
        rows.append({
            "rate": point.rate,
            "tokens_per_s_ratio": _ratio(point.tokens_per_s, other.tokens_per_s),
            "ttft_p99_ratio": _ratio(point.ttft_p99_ms, other.ttft_p99_ms),
            "peer_completed": other.completed,
            "peer_output_tokens": other.summary["total_output_tokens"],
            "peer_asked_tokens": other.asked_tokens,
        })
    return rows


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def evaluate_targets(
    runs: dict[str, SystemRun], capacities: dict[str, float | None], rates: Sequence[float], peer_asked: bool
) -> list[Target]:
    """The issue's targets, never relaxed: one the run could not measure is reported as such. The peer
    ratios are read at the highest rate of the sweep, where tokens/s measures capacity rather than the
    offered load. The capacity ratio is NOT MET outright when continuous held the bound at no rate and
    static did at some, and NOT MEASURED when it is only a lower bound below the target."""
    head, base = capacities.get(HEADLINE), capacities.get(BASELINE)
    value, note = capacity_ratio(head, base, rates)
    name = f"{HEADLINE}'s highest rate under the TTFT bound ÷ {BASELINE}'s" + (f" ({note})" if note else "")
    met: bool | None
    if head is None and base is not None:
        met = False
    elif note.startswith("at least") and value is not None and value < CAPACITY_TARGET:
        met = None  # a lower bound under the target says nothing
    else:
        met = _met(value, CAPACITY_TARGET)
    targets = [Target(name, value, CAPACITY_TARGET, met)]
    if peer_asked:
        rows = peer_ratios(runs.get(HEADLINE, SystemRun(HEADLINE)), runs.get(PEER, SystemRun(PEER)))
        top = rows[-1] if rows and rows[-1]["rate"] == max(rates) else {}
        at = f"at {_rate_text(max(rates))} req/s"
        speed = top.get("tokens_per_s_ratio")
        targets.append(Target(f"sluice-{HEADLINE} output tokens/s ÷ {PEER} {at}", speed, PEER_SPEED_TARGET,
                              _met(speed, PEER_SPEED_TARGET)))
        ttft = top.get("ttft_p99_ratio")
        name = f"sluice-{HEADLINE} p99 TTFT ÷ {PEER} {at}, at most"
        met = None if ttft is None else ttft <= PEER_TTFT_TARGET
        targets.append(Target(name, ttft, PEER_TTFT_TARGET, met))
    return targets


def _met(value: float | None, threshold: float) -> bool | None:
    return None if value is None else value >= threshold


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def format_points(runs: dict[str, SystemRun], num_requests: int) -> str:
    header = ("system", "rate req/s", "done", "out tok/s", "p50 TTFT ms", "p99 TTFT ms", "p50 TPOT ms",
              "tokens out/asked")
    lines = [header]
    for run in runs.values():
        if run.error is not None:
            lines.append((_label(run.name), "FAILED", "", "", "", "", "", run.error.splitlines()[0][:80]))
        for p in run.points:
            s = p.summary
            short = " (EOS)" if p.short_of_tokens else ""
            lines.append((
                _label(run.name), _rate_text(p.rate), f"{p.completed}/{num_requests}",
                _fmt(p.tokens_per_s, ".1f"), _fmt(s["ttft_ms"]["p50"], ".0f"), _fmt(p.ttft_p99_ms, ".0f"),
                _fmt(s["tpot_ms"]["p50"], ".1f"), f"{s['total_output_tokens']}/{p.asked_tokens}{short}",
            ))
    return _table(lines)


def format_peer(rows: list[dict[str, Any]]) -> str:
    header = ("rate req/s", "tok/s ÷ peer", "p99 TTFT ÷ peer", "peer tokens out/asked")
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        out, asked = row["peer_output_tokens"], row["peer_asked_tokens"]
        note = " (EOS)" if out < asked else ""
        shown = f"{out}/{asked}{note}" if row["peer_completed"] else "no request completed"
        lines.append((_rate_text(row["rate"]), _fmt(row["tokens_per_s_ratio"], ".2f"),
                      _fmt(row["ttft_p99_ratio"], ".2f"), shown))
    return _table(lines)


# ---- output -----------------------------------------------------------------------------------------


def to_json(
    runs: dict[str, SystemRun], capacities: dict[str, float | None], targets: list[Target],
    meta: dict[str, Any],
) -> dict[str, Any]:
    systems = {
        name: {
            "label": _label(name),
            "error": run.error,
            "points": [{"rate": p.rate, "asked_tokens": p.asked_tokens, "cpu_s": p.cpu_s, **p.summary}
                       for p in run.points],
        }
        for name, run in runs.items()
    }
    head, peer = runs.get(HEADLINE), runs.get(PEER)
    return {
        "meta": meta,
        "systems": systems,
        "highest_rate_under_ttft_bound": capacities,
        "peer_ratios": peer_ratios(head, peer) if head and peer else [],
        "targets": [t.__dict__ for t in targets],
    }


def _plot_x(rates: Sequence[float]) -> dict[float, float]:
    """Where each rate sits on the log x axis: finite rates as they are, inf one doubling past the
    highest finite rate (or at 1 when the sweep has no finite rate)."""
    finite = [r for r in rates if math.isfinite(r)]
    inf_x = 2 * max(finite) if finite else 1.0
    return {r: (inf_x if math.isinf(r) else r) for r in rates}


def write_plot(
    path: Path, runs: dict[str, SystemRun], rates: Sequence[float], bound_ms: float, title: str
) -> None:
    """A PNG of two panels against request rate (log scale, inf at the right end, labelled): output
    tokens/s, and p99 TTFT (log scale) with the bound dashed; one line per system."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    xs = _plot_x(rates)
    fig = Figure(figsize=(11, 4.5), dpi=110)
    speed_ax, ttft_ax = fig.subplots(1, 2)
    for run in runs.values():
        points = [p for p in run.points if p.completed]
        x = [xs[p.rate] for p in points]
        style = {"marker": "o", "label": _label(run.name), "linestyle": "--" if run.name == PEER else "-"}
        speed_ax.plot(x, [p.tokens_per_s for p in points], **style)
        ttft_ax.plot(x, [p.ttft_p99_ms for p in points], **style)
    ttft_ax.axhline(bound_ms, color="grey", linestyle=":", label=f"bound {bound_ms:g} ms")
    ttft_ax.set_yscale("log")
    for ax, ylabel in ((speed_ax, "output tokens/s"), (ttft_ax, "p99 TTFT (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(list(xs.values()), [_rate_text(r) for r in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("request rate (req/s; inf = all at once)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def _report(args: argparse.Namespace, runs: dict[str, SystemRun], meta: dict[str, Any]) -> int:
    """Prints the tables, capacities and targets, writes the JSON and the plot; returns the exit status."""
    capacities = {name: highest_rate_under(run, args.ttft_bound_ms, args.num_requests)
                  for name, run in runs.items()}
    targets = evaluate_targets(runs, capacities, args.rates, not args.no_peer)
    print()
    print(format_points(runs, args.num_requests))
    head, peer = runs.get(HEADLINE), runs.get(PEER)
    if peer is not None:
        print()
        if peer.error is not None or not any(p.completed for p in peer.points):
            print(f"{PEER} FAILED: {peer.error or _first_error(peer)}")
        elif head is not None:
            print(f"sluice-{HEADLINE} ÷ {PEER} at each rate:")
            print(format_peer(peer_ratios(head, peer)))
    print()
    print(f"highest request rate with p99 TTFT ≤ {args.ttft_bound_ms:g} ms at it and every lower rate:")
    for name, best in capacities.items():
        shown = "none of the rates tried" if best is None else f"{_rate_text(best)} req/s"
        print(f"  {_label(name):<22} {shown}")
    print("targets:")
    for target in targets:
        print(target.line())
    if args.json is not None:
        write_json_doc(args.json, to_json(runs, capacities, targets, meta))
        print(f"wrote {args.json}")
    if args.plot is not None:
        title = (f"sluice bench compare: {args.num_requests} requests per point, ~{args.input_len} prompt + "
                 f"{args.output_len} output tokens, {Path(meta['model']).name}")
        write_plot(args.plot, runs, args.rates, args.ttft_bound_ms, title)
        print(f"wrote {args.plot}")
    failed = any(run.error is not None or any(not p.completed for p in run.points) for run in runs.values())
    return 1 if failed else 0


def _first_error(run: SystemRun) -> str:
    for point in run.points:
        for error in point.summary["errors"]:
            return f"every request failed, e.g. {error['message']}"
    return "no request completed"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model = resolve_model(args.model)
    requests = synthetic_requests(args.num_requests, args.seed, input_len=args.input_len,
                                  output_len=args.output_len)
    workload = {
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "asked_output_tokens": sum(r.output_len for r in requests),
        "seed": args.seed,
        "api": "openai",
    }
    meta = {
        **run_meta(["compare", *argv]),
        "model": model,
        "workload": workload,
        "rates": list(args.rates),
        "ttft_bound_ms": args.ttft_bound_ms,
    }
    openers: dict[str, Opener] = {policy: partial(sluice_endpoint, model, policy) for policy in args.policies}
    if not args.no_peer:
        openers[PEER] = partial(peer_endpoint, model)
    rates = ", ".join(map(_rate_text, args.rates))
    print(f"model: {model}; {args.num_requests} requests per point; rates {rates} req/s")
    bar = tqdm(total=len(openers) * len(args.rates), desc="points", unit="pt", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    with bar:
        runs = {name: run_system(name, opener, args.rates, requests, args.seed, bar)
                for name, opener in openers.items()}
    return _report(args, runs, meta)
