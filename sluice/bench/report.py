"""Every table and JSON document of the benchmarks, as pure functions of measured figures: one table renderer
(`column_table`: a header and a cell function per column) and one JSON writer, then the reports of `serve`
(vLLM's summary layout), `engine` (a block of methods per concurrency, ratios), its
`latency` variant and the `sweep` presets. No torch here: `sluice bench serve` reports without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.bench.compare import Point
    from sluice.bench.engine_methods import MethodResult, Workload
    from sluice.bench.latency import RunFigures
    from sluice.bench.peers import PeerFigures
    from sluice.bench.perplexity import QualityResult
    from sluice.bench.pipeline import Comparison
    from sluice.bench.serve import RequestRecord, ServeResult
    from sluice.bench.sweep import SystemRun

REFERENCE = "hf-sequential"  # greedy outputs are compared with this method's
BASELINE = "hf-static"  # tokens/s ratios are taken against this method
HEADLINE = "sluice-continuous"  # the method whose tokens/s is set against each transformers method's
ROUTING_BASELINE = "round_robin"  # sweep routing's policies are set against this one
OFF = "off"  # the latency variant every other is set against
HF_METHODS = ("hf-sequential", "hf-static")
EAGER = "sluice-continuous-eager"  # continuous batching with CUDA graphs off (only differs on CUDA)
SLUICE_METHODS = ("sluice-static", "sluice-dynamic", "sluice-continuous", EAGER)
NOT_ON_CPU = "n/a (CPU)"  # CUDA graphs' state, and the eager method's figures, on a CPU


def ratio(value: float | None, base: float | None) -> float | None:
    """value ÷ base; None when either is missing or base is not positive."""
    return None if value is None or base is None or not base > 0 else value / base


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(rows: Iterable[Sequence[object]], right_from: int | None = None) -> str:
    """Rows (the first is the header) in columns two spaces apart, a rule under the header; columns from
    `right_from` on aligned right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    right = len(widths) if right_from is None else right_from
    lines = [
        "  ".join(
            c.rjust(w) if i >= right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


Column = tuple[str, Callable[[Any], object]]  # header, the cell of one item


def column_rows(columns: Sequence[Column], items: Iterable[Any]) -> list[Sequence[object]]:
    """The columns' headers, then a row per item: each column's cell of it."""
    return [[header for header, _ in columns], *([cell(item) for _, cell in columns] for item in items)]


def column_table(columns: Sequence[Column], items: Iterable[Any], right_from: int | None = None) -> str:
    return format_table(column_rows(columns, items), right_from)


def json_safe(value: Any) -> Any:
    """`value` as JSON can hold it: dataclasses as dicts, every non-finite float as "inf", "-inf" or "nan"."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path | None, doc: dict[str, Any], announce: bool = False) -> None:
    """Writes `doc` to `path` (nothing when None) as `json_safe` JSON, making the folder if needed;
    `announce` prints where."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False, default=str) + "\n", "utf-8")
    if announce:
        print(f"wrote {path}")


# serve

PERCENTILES = (50, 90, 99)
METRICS = (  # summary key, short name, table heading
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)
SUMMARY_LINES = (  # label, summary key, format
    ("Successful requests:", "completed", ""),
    ("Failed requests:", "failed", ""),
    ("Benchmark duration (s):", "duration_s", ".2f"),
    ("Total input tokens:", "total_input_tokens", ""),
    ("Total generated tokens:", "total_output_tokens", ""),
    ("Request throughput (req/s):", "request_throughput", ".2f"),
    ("Output token throughput (tok/s):", "output_throughput", ".2f"),
    ("Total token throughput (tok/s):", "total_token_throughput", ".2f"),
    ("Mean concurrency:", "mean_concurrency", ".2f"),
    ("Load generator CPU (s):", "client_cpu_s", ".2f"),
)


def latency_series(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The latencies in seconds of the successful requests, by summary key (METRICS' order)."""
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": [r.ttft_s for r in ok],
        "tpot_ms": [t for r in ok if (t := r.tpot_s) is not None],
        "itl_ms": [gap for r in ok for gap in r.itl_s],
        "e2el_ms": [r.e2e_s for r in ok],
    }


def _line(label: str, value: object, spec: str = "") -> str:
    shown = "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
    return f"{label:<40}{shown:>12}"


def format_summary(result: ServeResult) -> str:
    """The summary as a readable table, in the layout of vLLM's serving benchmark."""
    s, width = result.summary(), 52
    lines = [
        " Serving Benchmark Result ".center(width, "="),
        *(_line(a, s[k], f) for a, k, f in SUMMARY_LINES),
    ]
    if s["goodput"] is not None:
        slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in s["slo"].items() if v is not None)
        lines += [_line("Request goodput (req/s):", s["goodput"], ".2f"), f"  (requests within {slo})"]
    for key, short, title in METRICS:
        lines += [f" {title} ".center(width, "-"), _line(f"Mean {short} (ms):", s[key]["mean"], ".2f")]
        lines += [_line(f"P{p} {short} (ms):", s[key][f"p{p}"], ".2f") for p in PERCENTILES]
    if s["errors"]:
        lines += [
            " Errors ".center(width, "-"),
            *(f"{e['count']:>5} × {e['message'][:200]}" for e in s["errors"]),
        ]
    return "\n".join([*lines, "=" * width])


def write_result(path: Path, result: ServeResult, meta: dict[str, Any]) -> None:
    """Writes `{"meta", "config", "summary", "started_at", "records"}`: the summary and every request."""
    doc = {"meta": meta, "config": result.config, "summary": result.summary()}
    write_json(path, {**doc, "started_at": result.started_at, "records": result.records})


# engine


@dataclass(frozen=True)
class Measured:
    """One ratio of the run as printed and written: `value` None when the run could not measure it."""

    name: str
    value: float | None

    def line(self) -> str:
        return f"  {self.name}: {fmt(self.value, '.3g', 'n/a')}"


@dataclass(frozen=True)
class GreedyMatch:
    """One method's greedy outputs against REFERENCE's, each request compared token by token up to its first
    difference (a missing or an extra token is one)."""

    differing: int  # requests whose output differs
    tokens_compared: int  # every position of an equal request; of another, up to its first difference

    @property
    def equal(self) -> bool:
        return self.differing == 0


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the two token lists differ (a missing token counts); None when equal."""
    for pos, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return pos
    return None if len(got) == len(want) else min(len(got), len(want))


def greedy_match(outputs: list[list[int]], reference: list[list[int]]) -> GreedyMatch:
    firsts = [first_difference(got, want) for got, want in zip(outputs, reference, strict=True)]
    compared = sum(len(want) if f is None else f + 1 for f, want in zip(firsts, reference, strict=True))
    return GreedyMatch(sum(f is not None for f in firsts), compared)


@dataclass(frozen=True)
class Row:
    """One method's figures as printed and written to JSON."""

    result: MethodResult
    ratio: float | None  # tokens/s over BASELINE's
    greedy: GreedyMatch | None  # against REFERENCE; None without a reference


def build_rows(results: dict[str, MethodResult]) -> list[Row]:
    base, ref = results.get(BASELINE), results.get(REFERENCE)
    return [
        Row(
            r, ratio(r.tokens_per_s, base and base.tokens_per_s), ref and greedy_match(r.outputs, ref.outputs)
        )
        for r in results.values()
    ]


def headline_ratios(results: dict[str, MethodResult], label: str = "") -> list[Measured]:
    """HEADLINE's tokens/s over each transformers method's (names prefixed with `[label]` when given)."""
    speed = {name: r.tokens_per_s for name, r in results.items()}
    prefix = f"[{label}] " if label else ""
    return [
        Measured(f"{prefix}{HEADLINE} tokens/s ÷ {o}", ratio(speed.get(HEADLINE), speed.get(o)))
        for o in HF_METHODS[::-1]
    ]


@dataclass
class Block:
    """Every method on the workload of one concurrency: results, failures and skipped methods."""

    model: str
    concurrency: int
    work: Workload
    workload: dict[str, Any]  # Workload.describe
    results: dict[str, MethodResult]
    errors: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)  # method → why it did not run (NOT_ON_CPU)

    @property
    def label(self) -> str:
        return f"{self.model}, {self.concurrency} requests"

    @property
    def rows(self) -> list[Row]:
        return build_rows(self.results)

    def ratios(self) -> list[Measured]:
        return headline_ratios(self.results, self.label)


def _greedy_cell(greedy: GreedyMatch | None) -> str:
    return "-" if greedy is None else "yes" if greedy.equal else f"no ({greedy.differing})"


def format_methods(
    rows: list[Row], errors: dict[str, str], num_requests: int, skipped: dict[str, str] | None = None
) -> str:
    def at_max_batch(r: MethodResult) -> str:
        return "-" if r.max_batch is None else f"{fmt(r.forward_share_max_batch, '.1%')} ({r.max_batch})"

    columns: list[Column] = [
        ("method", lambda row: row.result.name),
        ("out tok/s", lambda row: f"{row.result.tokens_per_s:.1f}"),
        ("wall s", lambda row: f"{row.result.wall_s:.2f}"),
        (f"× {BASELINE}", lambda row: fmt(row.ratio, ".2f")),
        (f"= {REFERENCE}", lambda row: _greedy_cell(row.greedy)),
        ("fwd share", lambda row: fmt(row.result.forward_share, ".1%")),
        ("@max batch", lambda row: at_max_batch(row.result)),
        ("KV eff", lambda row: fmt(row.result.kv_efficiency, ".3f")),
        ("graphs", lambda row: row.result.cuda_graphs or "-"),
        ("setting", lambda row: row.result.setting),
    ]
    lines = column_rows(columns, rows)
    lines += [(name, "FAILED", *[""] * 7, msg[:80]) for name, msg in errors.items()]
    lines += [(name, why, *[""] * 6, why, "") for name, why in (skipped or {}).items()]
    return format_table(lines) + (
        f"\n(= {REFERENCE}: 'no (k)' means k of {num_requests} requests differ; fwd share: time in the model "
        "forward / step time, overall and over the steps with the largest batch (its size); graphs: CUDA "
        "graphs for decode-only steps)"
    )


def format_block(block: Block) -> str:
    """One concurrency's table under its label."""
    return f"-- {block.label} at once\n" + format_methods(
        block.rows, block.errors, len(block.work), block.skipped
    )


def engine_methods_json(block: Block) -> dict[str, Any]:
    """Per method of one block: its figures, its greedy comparison and its error, or why it was skipped."""
    methods: dict[str, Any] = {}
    for row in block.rows:
        r, g = row.result, row.greedy
        methods[r.name] = {
            "tokens_per_s": r.tokens_per_s,
            f"ratio_to_{BASELINE}": row.ratio,
            f"greedy_equals_{REFERENCE}": g and g.equal,
            "mismatching_requests": g and g.differing,
            "tokens_compared": g and g.tokens_compared,
            **{k: v for k, v in dataclasses.asdict(r).items() if k not in ("name", "outputs")},
            "error": None,
        }
    methods.update({name: {"error": msg} for name, msg in block.errors.items()})
    methods.update({name: {"skipped": why, "error": None} for name, why in block.skipped.items()})
    return methods


def engine_json_runs(blocks: list[Block], meta: dict[str, Any]) -> dict[str, Any]:
    """The whole run: `runs` holds one block per concurrency; `workload` and `methods` at the top are the
    first block's (the layout of a one-block run); `ratios` are every block's."""
    runs = [
        {"concurrency": b.concurrency, "workload": b.workload, "methods": engine_methods_json(b)}
        for b in blocks
    ]
    top = {"reference": REFERENCE, "baseline": BASELINE, "workload": runs[0]["workload"]}
    ratios_doc = [dataclasses.asdict(r) for b in blocks for r in b.ratios()]
    return {
        "partial": False,
        **meta,
        **top,
        "methods": runs[0]["methods"],
        "runs": runs,
        "ratios": ratios_doc,
    }


# engine latency


@dataclass
class Cell:
    """One variant on one workload: its batch-1 run and its concurrent run (None when not run), and the
    share of its outputs that copies the prompt."""

    variant: str
    workload: str
    batch1: RunFigures | None = None
    concurrent: RunFigures | None = None
    copy_fraction: float | None = None


@dataclass
class LatencyReport:
    model: str
    concurrency: int
    cells: list[Cell]
    errors: dict[str, str] = field(default_factory=dict)  # variant -> why it has no figures
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> description
    quality: list[QualityResult] = field(default_factory=list)
    quality_model: str = ""

    def cell(self, variant: str, workload: str) -> Cell | None:
        return next((c for c in self.cells if c.variant == variant and c.workload == workload), None)


def _rate(cell: Cell | None, run: str) -> float | None:
    """A cell's headline figure of its `run`: "batch1" decode tok/s or "concurrent" output tok/s."""
    figures = None if cell is None else getattr(cell, run)
    return None if figures is None else figures.decode_tok_s if run == "batch1" else figures.output_tok_s


def ratio_to_off(report: LatencyReport, cell: Cell, run: str) -> float | None:
    """A cell's headline figure of `run` over the off variant's on the same workload."""
    return ratio(_rate(cell, run), _rate(report.cell(OFF, cell.workload), run))


def quality_ratio(quality: Sequence[QualityResult], variant: str) -> float | None:
    base = next((q.perplexity for q in quality if q.variant == "none"), None)
    mine = next((q for q in quality if q.variant == variant), None)
    return None if mine is None else ratio(mine.perplexity, base)


def _ms(value: float | None) -> str:
    return fmt(value and value * 1e3, ".1f")


def _x(value: float | None) -> str:
    return fmt(value, ".2f") + ("x" if value is not None else "")


def _spec_cell(variant: str, run: RunFigures | None) -> str:
    spec = run.spec if variant == "ngram" and run is not None else {}
    rate, length = spec.get("spec_acceptance_rate"), spec.get("spec_mean_accepted_length")
    return "-" if rate is None and length is None else f"{fmt(rate, '.0%')} / {fmt(length, '.2f')}"


def format_latency(report: LatencyReport) -> str:
    """Per workload and variant: batch-1 decode tok/s, its ratio to off, TTFT p50; the concurrent run's
    tok/s, ratio, TTFT p50 / p99; speculation's acceptance rate / mean accepted length (batch 1, concurrent);
    the share of output tokens copied from the prompt."""
    c = report.concurrency
    columns: list[Column] = [
        ("workload", lambda cell: cell.workload),
        ("variant", lambda cell: cell.variant),
        ("b1 dec tok/s", lambda cell: fmt(_rate(cell, "batch1"), ",.1f")),
        ("x off", lambda cell: _x(ratio_to_off(report, cell, "batch1"))),
        ("b1 TTFT p50 ms", lambda cell: _ms(cell.batch1 and cell.batch1.ttft(0.5))),
        (f"{c} tok/s", lambda cell: fmt(_rate(cell, "concurrent"), ",.1f")),
        ("x off", lambda cell: _x(ratio_to_off(report, cell, "concurrent"))),
        (f"{c} TTFT p50 ms", lambda cell: _ms(cell.concurrent and cell.concurrent.ttft(0.5))),
        ("p99 ms", lambda cell: _ms(cell.concurrent and cell.concurrent.ttft(0.99))),
        ("accept/len b1", lambda cell: _spec_cell(cell.variant, cell.batch1)),
        (f"accept/len {c}", lambda cell: _spec_cell(cell.variant, cell.concurrent)),
        ("copy", lambda cell: fmt(cell.copy_fraction, ".0%")),
    ]
    errors = "".join(f"\n{variant}: no figures ({why})" for variant, why in report.errors.items())
    return column_table(columns, report.cells, right_from=2) + errors


def format_quality(report: LatencyReport) -> str:
    if not report.quality:
        return "perplexity: not measured"
    columns: list[Column] = [
        ("variant", lambda q: q.variant),
        ("weights", lambda q: q.quantization),
        ("kv", lambda q: q.kv_cache_dtype),
        ("perplexity", lambda q: fmt(q.perplexity, ".3f")),
        ("x none", lambda q: fmt(quality_ratio(report.quality, q.variant), ".4f")),
        ("tokens", lambda q: q.tokens if q.error is None else f"FAILED: {q.error[:60]}"),
    ]
    title = f"perplexity on held-out text ({report.quality_model}):\n"
    return title + column_table(columns, report.quality, right_from=2)


def run_json(run: RunFigures | None) -> dict[str, Any] | None:
    """A run's figures (its TTFTs as p50 and p99, its outputs left out)."""
    if run is None:
        return None
    figures = {k: v for k, v in dataclasses.asdict(run).items() if k not in ("ttft_s", "outputs")}
    return {**figures, "output_tok_s": run.output_tok_s, "decode_tok_s": run.decode_tok_s,
            "ttft_p50_s": run.ttft(0.5), "ttft_p99_s": run.ttft(0.99)}  # fmt: skip


def latency_json(report: LatencyReport, meta: dict[str, Any]) -> dict[str, Any]:
    cells = [
        {**vars(c), "batch1": run_json(c.batch1), "concurrent": run_json(c.concurrent),
         "batch1_ratio_to_off": ratio_to_off(report, c, "batch1"),
         "concurrent_ratio_to_off": ratio_to_off(report, c, "concurrent")}
        for c in report.cells
    ]  # fmt: skip
    quality = [{**vars(q), "ratio_to_none": quality_ratio(report.quality, q.variant)} for q in report.quality]
    return {**meta, "bench": "latency", "model": report.model, "concurrency": report.concurrency,
            "workloads": report.workloads, "cells": cells, "errors": report.errors,
            "quality_model": report.quality_model, "quality": quality}  # fmt: skip


# sweep presets: pipeline, compare, routing, peers


def format_pipeline(best: Comparison) -> str:
    """`sweep pipeline`'s report: both runs' rates and steps, the raw and scaled ratios, the CPU each
    process used over the end-to-end run and the services' stage histograms."""
    inp, e2e, cores = best.in_process, best.end_to_end, os.cpu_count() or 1
    steps, step_s = e2e.stages.get("engine step", (0, 0.0))
    out = [
        f"in-process engine : {inp.tokens_per_s:9.1f} tok/s  ({inp.output_tokens} tokens in "
        f"{inp.wall_s:.2f} s; {inp.steps} steps, mean step {inp.mean_step_ms:.1f} ms; "
        f"{inp.cpu_s / inp.wall_s:.2f} cores)",
        f"end to end        : {e2e.tokens_per_s:9.1f} tok/s  ({e2e.summary['total_output_tokens']} tokens in "
        f"{e2e.wall_s:.2f} s; {steps} steps, mean step {1000 * step_s / max(1, steps):.1f} ms; "
        f"{e2e.summary['failed']} failed)",
        f"ratio, raw        : {best.raw_ratio:.3f}",
        f"load generator    : {e2e.generator_share:.1%} of the machine ({cores} cores)",
        f"ratio, scaled     : {best.scaled_ratio:.3f}",
        "",
        "CPU over the end-to-end run   seconds   cores",
    ]
    for name, seconds in sorted(e2e.cpu_s.items(), key=lambda kv: -kv[1]):
        out.append(f"  {name:<27} {seconds:8.2f}   {seconds / e2e.wall_s:5.2f}")
    out += [f"  {'(not used by these)':<27} {'':8}   {cores - sum(e2e.cpu_s.values()) / e2e.wall_s:5.2f}", ""]
    out.append("stage times (services' histograms)   count   mean ms   total s")
    for name, (count, total) in e2e.stages.items():
        mean = 1000 * total / count if count else math.nan
        out.append(f"  {name:<34} {count:6d}  {mean:8.2f}  {total:8.2f}")
    return "\n".join(out)


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_points(runs: dict[str, SystemRun], num_requests: int) -> str:
    def tokens(p: Point) -> str:
        return f"{p.summary['total_output_tokens']}/{p.asked_tokens}" + (
            " (EOS)" if p.short_of_tokens else ""
        )

    columns: list[Column] = [
        ("system", lambda p: f"sluice-{p.system}"),
        ("rate req/s", lambda p: rate_text(p.rate)),
        ("done", lambda p: f"{p.completed}/{num_requests}"),
        ("out tok/s", lambda p: fmt(p.tokens_per_s, ".1f")),
        ("p50 TTFT ms", lambda p: fmt(p.summary["ttft_ms"]["p50"], ".0f")),
        ("p99 TTFT ms", lambda p: fmt(p.ttft_p99_ms, ".0f")),
        ("p50 TPOT ms", lambda p: fmt(p.summary["tpot_ms"]["p50"], ".1f")),
        ("tokens out/asked", tokens),
    ]
    rows = column_rows(columns, [])
    for run in runs.values():
        if run.error is not None:
            rows.append((f"sluice-{run.name}", "FAILED", *[""] * 5, run.error.splitlines()[0][:80]))
        rows += column_rows(columns, run.points)[1:]
    return format_table(rows)


def compare_json(
    runs: dict[str, SystemRun],
    capacities: dict[str, float | None],
    capacity: tuple[float | None, str],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """`sluice bench compare`'s document: every policy's points, the capacities and their ratio."""
    systems = {
        name: {"label": f"sluice-{name}", "error": run.error,
               "points": [{"rate": p.rate, "asked_tokens": p.asked_tokens, "cpu_s": p.cpu_s, **p.summary}
                          for p in run.points]}
        for name, run in runs.items()
    }  # fmt: skip
    value, note = capacity
    return {"meta": meta, "systems": systems, "highest_rate_under_ttft_bound": capacities,
            "capacity_ratio": {"value": value, "note": note}}  # fmt: skip


def format_rows(rows: list[dict[str, Any]]) -> str:
    """One line per routing policy: its figures and its tokens/s and p90 TTFT over round_robin's."""
    base = next((r for r in rows if r["policy"] == ROUTING_BASELINE), None)

    def over_base(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: fmt(ratio(r[key], base and base[key]), ".2f", missing="nan")

    columns: list[Column] = [
        ("policy", lambda r: r["policy"]),
        ("out tok/s", lambda r: f"{r['output_throughput']:.1f}"),
        ("p90 TTFT ms", lambda r: f"{r['ttft_p90_ms']:.0f}"),
        ("prefix hits", lambda r: f"{r['prefix_hit_rate']:.2f}"),
        ("x tok/s", over_base("output_throughput")),
        ("x p90", over_base("ttft_p90_ms")),
        ("prompt-token share", lambda r: " ".join(f"{v:.2f}" for v in r["prompt_token_share"].values())),
    ]
    return column_table(columns, rows, right_from=1)


def format_medians(medians: dict[str, dict[str, float]], num_rounds: int) -> str:
    lines = [f"median over {num_rounds} rounds, relative to {ROUTING_BASELINE} in the same round:"]
    lines += [
        f"  {p:<16} x tok/s {m['tok_s']:.2f}   x p90 TTFT {m['ttft_p90']:.2f}" for p, m in medians.items()
    ]
    return "\n".join(lines)


def format_peers(runs: dict[str, SystemRun], streams: int, labels: dict[str, str]) -> str:
    """`sweep peers`' side-by-side table: a row per server (`labels`: its name as shown), its figures, or
    dashes and why it has none, the host's load average as it started, and its setup (the note, with any
    failed requests)."""
    rows: list[Sequence[object]] = [
        ("server", f"{streams} streams tok/s", "p99 TTFT", "batch-1 tok/s", "batch-1 ITL p50", "load", "note")
    ]
    for name, run in runs.items():
        load = fmt(run.load_at_start, ".2f")
        if run.error is not None or not run.points:
            why = (run.error or "no figures").splitlines()[0][:160]
            rows.append((labels[name], "-", "-", "-", "-", load, why))
            continue
        f: PeerFigures = run.points[0]
        ttft = f"{fmt(f.ttft_p99_ms and f.ttft_p99_ms / 1000, '.2f')} s"
        cells = (
            fmt(f.streams_tok_s, ",.0f"),
            ttft,
            fmt(f.batch1_tok_s, ",.0f"),
            f"{fmt(f.batch1_itl_p50_ms, '.1f')} ms",
        )
        failed = f"{f.failed} requests failed" if f.failed else ""
        rows.append((labels[name], *cells, load, "; ".join(n for n in (run.setup, failed) if n)))
    return format_table(rows)


def peers_json(
    runs: dict[str, SystemRun], meta: dict[str, Any], labels: dict[str, str], not_installed: str
) -> dict[str, Any]:
    """`sweep peers`' document: per server its label, error (`not_installed` starts the error of a server
    that is not installed), headline figures and both runs' summaries."""
    servers = {}
    for name, run in runs.items():
        f: PeerFigures | None = run.points[0] if run.points else None
        heads = ("streams_tok_s", "ttft_p99_ms", "batch1_tok_s", "batch1_itl_p50_ms")
        servers[name] = {
            "label": labels[name],
            "error": run.error,
            "not_installed": bool(run.error and run.error.startswith(not_installed)),
            "load_at_start": run.load_at_start,
            "setup": run.setup,
            **{key: f and getattr(f, key) for key in heads},
            **(dataclasses.asdict(f) if f else {}),
        }
    return {"meta": meta, "servers": servers}
