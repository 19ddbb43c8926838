"""Figures of one `sluice bench latency` run (ratios to speculation off, tables, JSON, plot): pure functions
of the measured figures."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.bench.common import Column, column_table, figure, fmt, ratio, save_figure
from sluice.bench.latency_run import OFF, RunFigures
from sluice.bench.perplexity import QualityResult


@dataclass
class Cell:
    """One variant on one workload: its batch-1 run and its concurrent run (None when not run), and the
    share of its outputs that copies the prompt / that prompt lookup can find."""

    variant: str
    workload: str
    batch1: RunFigures | None = None
    concurrent: RunFigures | None = None
    copy_fraction: float | None = None
    lookup_fraction: float | None = None


@dataclass
class ShapeRun:
    """Batch-1 decode on a larger model shape (random weights), per variant."""

    model: str
    dtype: str
    runs: dict[str, RunFigures] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class KvBlocks:
    """KV pool blocks at one budget with the model's dtype and with fp8 (CUDA only)."""

    budget_gb: float
    blocks: dict[str, int] = field(default_factory=dict)  # kv_cache_dtype -> num_blocks
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return ratio(self.blocks.get("fp8"), self.blocks.get("auto"))


@dataclass
class Report:
    model: str
    concurrency: int
    cells: list[Cell]
    errors: dict[str, str] = field(default_factory=dict)  # variant -> why it has no figures
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> description
    shape: ShapeRun | None = None
    kv: KvBlocks | None = None
    quality: list[QualityResult] = field(default_factory=list)
    quality_model: str = ""

    def cell(self, variant: str, workload: str) -> Cell | None:
        return next((c for c in self.cells if c.variant == variant and c.workload == workload), None)


def _b1(cell: Cell | None) -> float | None:
    return None if cell is None or cell.batch1 is None else cell.batch1.decode_tok_s


def _conc(cell: Cell | None) -> float | None:
    return None if cell is None or cell.concurrent is None else cell.concurrent.output_tok_s


def batch1_ratio(report: Report, variant: str, workload: str) -> float | None:
    return ratio(_b1(report.cell(variant, workload)), _b1(report.cell(OFF, workload)))


def concurrent_ratio(report: Report, variant: str, workload: str) -> float | None:
    return ratio(_conc(report.cell(variant, workload)), _conc(report.cell(OFF, workload)))


def shape_ratio(shape: ShapeRun | None, variant: str) -> float | None:
    if shape is None or variant not in shape.runs or OFF not in shape.runs:
        return None
    return ratio(shape.runs[variant].decode_tok_s, shape.runs[OFF].decode_tok_s)


def quality_ratio(quality: Sequence[QualityResult], variant: str) -> float | None:
    base = next((q.perplexity for q in quality if q.variant == "none"), None)
    mine = next((q for q in quality if q.variant == variant), None)
    return None if mine is None else mine.ratio_to(base)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _spec_cell(variant: str, run: RunFigures | None) -> str:
    if variant != "ngram" or run is None or not run.spec:
        return "-"
    rate = run.spec.get("spec_acceptance_rate")
    length = run.spec.get("spec_mean_accepted_length")
    if rate is None and length is None:
        return "-"
    return f"{fmt(rate, '.0%')} / {fmt(length, '.2f')}"


def format_main(report: Report) -> str:
    """Per workload and variant: batch-1 decode tok/s, its ratio to off, TTFT p50; the concurrent run's
    tok/s, ratio, TTFT p50 / p99; speculation's acceptance rate / mean accepted length (batch 1, concurrent);
    the share of output tokens copied from the prompt."""
    c = report.concurrency
    columns: list[Column] = [
        ("workload", lambda cell: cell.workload),
        ("variant", lambda cell: cell.variant),
        ("b1 dec tok/s", lambda cell: fmt(_b1(cell), ",.1f")),
        ("x off", lambda cell: _x(batch1_ratio(report, cell.variant, cell.workload))),
        ("b1 TTFT p50 ms", lambda cell: _ms(cell.batch1 and cell.batch1.ttft(0.5))),
        (f"{c} tok/s", lambda cell: fmt(_conc(cell), ",.1f")),
        ("x off", lambda cell: _x(concurrent_ratio(report, cell.variant, cell.workload))),
        (f"{c} TTFT p50 ms", lambda cell: _ms(cell.concurrent and cell.concurrent.ttft(0.5))),
        ("p99 ms", lambda cell: _ms(cell.concurrent and cell.concurrent.ttft(0.99))),
        ("accept/len b1", lambda cell: _spec_cell(cell.variant, cell.batch1)),
        (f"accept/len {c}", lambda cell: _spec_cell(cell.variant, cell.concurrent)),
        ("copy", lambda cell: fmt(cell.copy_fraction, ".0%")),
        ("lookup", lambda cell: fmt(cell.lookup_fraction, ".0%")),
    ]
    text = column_table(columns, report.cells, right_from=2)
    for variant, why in report.errors.items():
        text += f"\n{variant}: no figures ({why})"
    return text


def format_shape(shape: ShapeRun | None) -> str:
    if shape is None:
        return "larger shape: not run"
    columns: list[Column] = [
        ("model", lambda _: shape.model),
        ("variant", lambda item: item[0]),
        ("b1 dec tok/s", lambda item: fmt(item[1].decode_tok_s, ",.2f")),
        ("x off", lambda item: _x(shape_ratio(shape, item[0]))),
        ("b1 TTFT p50 ms", lambda item: _ms(item[1].ttft(0.5))),
        ("tokens", lambda item: item[1].output_tokens),
    ]
    text = f"batch-1 decode on {shape.model} ({shape.dtype}, random weights):\n"
    text += column_table(columns, shape.runs.items(), right_from=2)
    for variant, why in shape.errors.items():
        text += f"\n{shape.model} {variant}: no figures ({why})"
    return text


def format_quality(report: Report) -> str:
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


def format_kv(kv: KvBlocks | None) -> str:
    if kv is None:
        return "fp8 KV blocks: not measured (CUDA only)"
    if kv.error:
        return f"fp8 KV blocks: FAILED: {kv.error}"
    shown = ", ".join(f"{k}: {n:,}" for k, n in kv.blocks.items())
    return f"KV blocks at {kv.budget_gb:g} GiB: {shown} ({_x(kv.ratio)})"


def run_json(run: RunFigures | None) -> dict[str, Any] | None:
    """A run's figures (its TTFTs as p50 and p99, its outputs left out)."""
    if run is None:
        return None
    figures = {k: v for k, v in dataclasses.asdict(run).items() if k not in ("ttft_s", "outputs")}
    return {**figures, "output_tok_s": run.output_tok_s, "decode_tok_s": run.decode_tok_s,
            "ttft_p50_s": run.ttft(0.5), "ttft_p99_s": run.ttft(0.99)}  # fmt: skip


def to_json(report: Report, meta: dict[str, Any]) -> dict[str, Any]:
    cells = [
        {
            **vars(c),
            "batch1": run_json(c.batch1),
            "concurrent": run_json(c.concurrent),
            "batch1_ratio_to_off": batch1_ratio(report, c.variant, c.workload),
            "concurrent_ratio_to_off": concurrent_ratio(report, c.variant, c.workload),
        }
        for c in report.cells
    ]
    shape, kv, quality = report.shape, report.kv, report.quality
    if shape is not None:
        runs = {v: run_json(r) for v, r in shape.runs.items()}
        shape_doc = {**vars(shape), "runs": runs, "ratios_to_off": {v: shape_ratio(shape, v) for v in runs}}
    return {
        **meta,
        "bench": "latency",
        "model": report.model,
        "concurrency": report.concurrency,
        "workloads": report.workloads,
        "cells": cells,
        "errors": report.errors,
        "shape": shape_doc if shape is not None else None,
        "kv_blocks": kv and {**vars(kv), "ratio": kv.ratio},
        "quality_model": report.quality_model,
        "quality": [{**vars(q), "ratio_to_none": quality_ratio(quality, q.variant)} for q in quality],
    }


VARIANT_COLORS = {"off": "#9a9a9a", "ngram": "#1f77b4", "int8": "#2ca02c", "fp8": "#d62728"}


def write_plot(path: Path, report: Report, title: str) -> None:
    """One PNG, two panels (batch 1: decode tok/s; N at once: output tok/s), bars per workload and variant,
    each labelled with its ratio to off."""
    workloads = list(dict.fromkeys(c.workload for c in report.cells))
    variants = list(dict.fromkeys(c.variant for c in report.cells))
    fig = figure(11, 4.5)
    axes = fig.subplots(1, 2)
    panels = (
        ("batch 1: decode tokens/s", _b1, batch1_ratio),
        (f"{report.concurrency} at once: output tokens/s", _conc, concurrent_ratio),
    )
    width = 0.8 / max(1, len(variants))
    for ax, (label, value_of, ratio_of) in zip(axes, panels, strict=True):
        for k, variant in enumerate(variants):
            xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(workloads))]
            values = [value_of(report.cell(variant, w)) or 0.0 for w in workloads]
            bars = ax.bar(xs, values, width, label=variant, color=VARIANT_COLORS.get(variant, "#8c564b"))
            ratios = [ratio_of(report, variant, w) for w in workloads]
            shown = [
                f"{v:.0f}" + ("" if r is None or variant == OFF else f"\n{r:.2f}x")
                for v, r in zip(values, ratios, strict=True)
            ]
            ax.bar_label(bars, labels=shown, fontsize=7)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.35)
    axes[0].legend(fontsize=8, loc="upper left", ncol=len(variants))
    save_figure(fig, path, title)
