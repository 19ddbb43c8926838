"""Figures of one `sluice bench serve` run: records, summary, table, JSON, plots. Latencies are over the
requests that succeeded; TPOT = (e2e - ttft) / (output tokens - 1) for requests of more than one token;
ITL pools every gap between chunks that carried text.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.bench.common import figure, save_figure, write_json

if TYPE_CHECKING:
    from sluice.bench.serve import ServeConfig

PERCENTILES = (50, 90, 99)
MAX_ERRORS = 5  # distinct error messages kept in the summary
METRICS = (  # summary key, short name, table heading
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; `start` counts from the run's start (when the
    request was sent, after any concurrency limit let it go); `ttft_s` and `e2e_s` from `start`;
    `itl_s` are the gaps between consecutive chunks that carried text or tokens."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None for each when there are no values)."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    values = [float(ms.mean()), *(float(v) for v in np.percentile(ms, PERCENTILES))]
    return dict(zip(keys, values, strict=True))


def meets_slos(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a successful request stayed within every SLO given (a request of one token has no TPOT
    and meets any TPOT SLO)."""
    if not record.ok:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    tpot = record.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


@dataclass
class ServeResult:
    """One measured run: its settings, one record per request (in the workload's order), the time from
    the first send to the last answer, when it started (Unix time), and the load generator's own CPU
    seconds over the run (user + system, this process)."""

    config: ServeConfig
    records: list[RequestRecord]
    duration_s: float
    started_at: float
    client_cpu_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The run's figures as a JSON-ready dict (see the module docstring for the latencies)."""
        ok = [r for r in self.records if r.ok]
        duration = self.duration_s if self.duration_s > 0 else math.nan
        prompt_tokens = sum(r.prompt_tokens for r in ok)
        output_tokens = sum(r.output_tokens for r in ok)
        slo_ttft, slo_tpot = self.config.slo_ttft_ms, self.config.slo_tpot_ms
        goodput = None
        if slo_ttft is not None or slo_tpot is not None:
            goodput = sum(meets_slos(r, slo_ttft, slo_tpot) for r in ok) / duration
        errors = Counter(r.error for r in self.records if not r.ok)
        return {
            "completed": len(ok),
            "failed": len(self.records) - len(ok),
            "duration_s": self.duration_s,
            "total_input_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
            "request_throughput": len(ok) / duration,
            "output_throughput": output_tokens / duration,
            "total_token_throughput": (prompt_tokens + output_tokens) / duration,
            "mean_concurrency": sum(r.e2e_s for r in ok) / duration,
            "ttft_ms": latency_stats([r.ttft_s for r in ok]),
            "tpot_ms": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
            "itl_ms": latency_stats([gap for r in ok for gap in r.itl_s]),
            "e2el_ms": latency_stats([r.e2e_s for r in ok]),
            "goodput": goodput,
            "slo": {"ttft_ms": slo_ttft, "tpot_ms": slo_tpot},
            "client_cpu_s": self.client_cpu_s,
            "errors": [{"message": m, "count": n} for m, n in errors.most_common(MAX_ERRORS)],
        }


def _line(label: str, value: object, spec: str = "") -> str:
    shown = "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
    return f"{label:<40}{shown:>12}"


def format_summary(result: ServeResult) -> str:
    """The summary as a readable table, in the layout of vLLM's serving benchmark."""
    s = result.summary()
    width = 52
    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines += [
        _line("Successful requests:", s["completed"]),
        _line("Failed requests:", s["failed"]),
        _line("Benchmark duration (s):", s["duration_s"], ".2f"),
        _line("Total input tokens:", s["total_input_tokens"]),
        _line("Total generated tokens:", s["total_output_tokens"]),
        _line("Request throughput (req/s):", s["request_throughput"], ".2f"),
        _line("Output token throughput (tok/s):", s["output_throughput"], ".2f"),
        _line("Total token throughput (tok/s):", s["total_token_throughput"], ".2f"),
        _line("Mean concurrency:", s["mean_concurrency"], ".2f"),
        _line("Load generator CPU (s):", s["client_cpu_s"], ".2f"),
    ]
    if s["goodput"] is not None:
        slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in s["slo"].items() if v is not None)
        lines += [_line("Request goodput (req/s):", s["goodput"], ".2f"), f"  (requests within {slo})"]
    for key, short, title in METRICS:
        lines.append(f" {title} ".center(width, "-"))
        stats = s[key]
        lines.append(_line(f"Mean {short} (ms):", stats["mean"], ".2f"))
        lines += [_line(f"P{p} {short} (ms):", stats[f"p{p}"], ".2f") for p in PERCENTILES]
    if s["errors"]:
        lines.append(" Errors ".center(width, "-"))
        lines += [f"{e['count']:>5} × {e['message'][:200]}" for e in s["errors"]]
    lines.append("=" * width)
    return "\n".join(lines)


def write_result(path: Path, result: ServeResult, meta: dict[str, Any]) -> None:
    """Writes `{"meta", "config", "summary", "started_at", "records"}`: the summary and every request."""
    doc = {
        "meta": meta,
        "config": dataclasses.asdict(result.config),
        "summary": result.summary(),
        "started_at": result.started_at,
        "records": [dataclasses.asdict(r) for r in result.records],
    }
    write_json(path, doc)


def chunk_times(record: RequestRecord) -> np.ndarray:
    """When each text-carrying chunk of a successful request arrived, in seconds from the run's start.
    Shape (len(itl_s) + 1,), or (0,) for a request that produced no chunk."""
    if not record.ok or record.output_tokens == 0:
        return np.zeros(0)
    return record.start + record.ttft_s + np.concatenate(([0.0], np.cumsum(record.itl_s)))


def tokens_per_second(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s in bins of `bin_s` from the run's start: (bin starts, rates), each shape (bins,).
    A request's tokens are spread evenly over its chunks (a chunk may carry several)."""
    times, weights = [], []
    for record in records:
        at = chunk_times(record)
        if at.size:
            times.append(at)
            weights.append(np.full(at.size, record.output_tokens / at.size))
    if not times:
        return np.zeros(0), np.zeros(0)
    all_times = np.concatenate(times)
    bins = int(all_times.max() // bin_s) + 1
    index = (all_times // bin_s).astype(np.int64)
    counts = np.bincount(index, weights=np.concatenate(weights), minlength=bins)
    return np.arange(bins) * bin_s, counts / bin_s


def _latency_series(result: ServeResult) -> dict[str, list[float]]:
    ok = [r for r in result.records if r.ok]
    return {
        "TTFT": [r.ttft_s for r in ok],
        "TPOT": [t for r in ok if (t := r.tpot_s) is not None],
        "ITL": [gap for r in ok for gap in r.itl_s],
        "E2E": [r.e2e_s for r in ok],
    }


def _plot_cdfs(path: Path, result: ServeResult, title: str) -> None:
    fig = figure(10, 7, dpi=110)
    for ax, (name, values) in zip(fig.subplots(2, 2).flat, _latency_series(result).items(), strict=True):
        ms = np.sort(np.asarray(values, dtype=np.float64)) * 1000.0
        if ms.size:
            ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of gaps" if name == "ITL" else "fraction of requests")
        ax.grid(alpha=0.3)
    save_figure(fig, path, title)


def _plot_throughput(path: Path, result: ServeResult, title: str) -> None:
    starts, rates = tokens_per_second(result.records)
    fig = figure(8, 4.5, dpi=110)
    ax = fig.subplots()
    if starts.size:
        ax.stairs(rates, np.append(starts, starts[-1] + 1.0), baseline=0.0)
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("output tokens/s (1 s bins)")
    ax.grid(alpha=0.3)
    save_figure(fig, path, title)


def write_plots(directory: Path, result: ServeResult, prefix: str = "serve") -> list[Path]:
    """Writes two PNGs into `directory` (matplotlib's Agg canvas, no pyplot state):
    `{prefix}-latency-cdf.png` (CDFs of TTFT, TPOT, ITL, E2E over the successful requests) and
    `{prefix}-throughput.png` (output tokens/s over time, 1 s bins). Returns their paths."""
    completed = sum(r.ok for r in result.records)
    title = f"sluice bench serve: {result.config.api}, {completed}/{len(result.records)} requests completed"
    cdf, throughput = directory / f"{prefix}-latency-cdf.png", directory / f"{prefix}-throughput.png"
    _plot_cdfs(cdf, result, title)
    _plot_throughput(throughput, result, title)
    return [cdf, throughput]
