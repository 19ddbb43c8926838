"""Figures of one `sluice bench latency` run: ratios against speculation off, the issue's targets, the
tables, the JSON and the plot. Pure functions of the measured figures (tests feed synthetic ones)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.bench.engine_report import Target, write_json
from sluice.bench.latency_run import OFF, RunFigures
from sluice.bench.latency_workload import NON_REPETITIVE, REPETITIVE
from sluice.bench.perplexity import PPL_TARGET, QualityResult

NGRAM_BATCH1_TARGET = 1.5  # n-gram: batch-1 output tokens/s on the repetitive workload over off
NGRAM_LOADED_TARGET = 0.95  # n-gram at the concurrent load: no more than 5% below off, on both workloads
INT8_TARGET = 1.5  # int8 weight-only: batch-1 decode tokens/s on the 0.5B shape over unquantized
FP8_TARGET = 1.3  # fp8 weights (GPU): the same
KV_FP8_TARGET = 2.0  # fp8 KV: blocks at the same budget over the model dtype's


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
        auto, fp8 = self.blocks.get("auto"), self.blocks.get("fp8")
        return fp8 / auto if auto and fp8 is not None else None


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


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


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


def _target(name: str, value: float | None, threshold: float, at_most: bool = False) -> Target:
    met = None if value is None else (value <= threshold if at_most else value >= threshold)
    return Target(name, value, threshold, met, at_most)


def targets(report: Report) -> list[Target]:
    """The issue's targets, each MET / NOT MET, or NOT MEASURED when this run lacks a figure for it."""
    c = report.concurrency
    shape = report.shape.model if report.shape else "0.5B shape"
    return [
        _target(
            f"ngram batch-1 decode tok/s on {REPETITIVE} / off",
            batch1_ratio(report, "ngram", REPETITIVE),
            NGRAM_BATCH1_TARGET,
        ),
        _target(
            f"ngram at {c} concurrent tok/s on {REPETITIVE} / off",
            concurrent_ratio(report, "ngram", REPETITIVE),
            NGRAM_LOADED_TARGET,
        ),
        _target(
            f"ngram at {c} concurrent tok/s on {NON_REPETITIVE} / off",
            concurrent_ratio(report, "ngram", NON_REPETITIVE),
            NGRAM_LOADED_TARGET,
        ),
        _target(
            f"int8 batch-1 decode tok/s on {shape} / off", shape_ratio(report.shape, "int8"), INT8_TARGET
        ),
        _target(
            f"int8 perplexity / unquantized ({report.quality_model or 'embedded model'})",
            quality_ratio(report.quality, "int8"),
            1 + PPL_TARGET,
            at_most=True,
        ),
        _target(
            f"fp8 batch-1 decode tok/s on {shape} / off (GPU)", shape_ratio(report.shape, "fp8"), FP8_TARGET
        ),
        _target(
            "fp8 KV blocks / model-dtype KV blocks at one budget (GPU)",
            report.kv.ratio if report.kv else None,
            KV_FP8_TARGET,
        ),
    ]


# ---------------------------------------------------------------- tables


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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
    return f"{_f(rate, '.0%')} / {_f(length, '.2f')}"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            str(c).rjust(w) if i > 1 else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def format_main(report: Report) -> str:
    """Per workload and variant: batch-1 decode tok/s, its ratio to off, TTFT p50; the concurrent run's
    tok/s, ratio, TTFT p50 / p99; speculation's acceptance rate / mean accepted length (batch 1, concurrent);
    the share of output tokens copied from the prompt."""
    c = report.concurrency
    header = (
        "workload",
        "variant",
        "b1 dec tok/s",
        "x off",
        "b1 TTFT p50 ms",
        f"{c} tok/s",
        "x off",
        f"{c} TTFT p50 ms",
        "p99 ms",
        "accept/len b1",
        f"accept/len {c}",
        "copy",
        "lookup",
    )
    rows = []
    for cell in report.cells:
        b, k = cell.batch1, cell.concurrent
        rows.append(
            (
                cell.workload,
                cell.variant,
                _f(_b1(cell), ",.1f"),
                _x(batch1_ratio(report, cell.variant, cell.workload)),
                _ms(b.ttft(0.5) if b else None),
                _f(_conc(cell), ",.1f"),
                _x(concurrent_ratio(report, cell.variant, cell.workload)),
                _ms(k.ttft(0.5) if k else None),
                _ms(k.ttft(0.99) if k else None),
                _spec_cell(cell.variant, b),
                _spec_cell(cell.variant, k),
                _f(cell.copy_fraction, ".0%"),
                _f(cell.lookup_fraction, ".0%"),
            )
        )
    text = _table(header, rows)
    for variant, why in report.errors.items():
        text += f"\n{variant}: no figures ({why})"
    return text


def format_shape(shape: ShapeRun | None) -> str:
    if shape is None:
        return "larger shape: not run"
    header = ("model", "variant", "b1 dec tok/s", "x off", "b1 TTFT p50 ms", "tokens")
    rows = [
        (
            shape.model,
            v,
            _f(r.decode_tok_s, ",.2f"),
            _x(shape_ratio(shape, v)),
            _ms(r.ttft(0.5)),
            str(r.output_tokens),
        )
        for v, r in shape.runs.items()
    ]
    text = f"batch-1 decode on {shape.model} ({shape.dtype}, random weights):\n" + _table(header, rows)
    for variant, why in shape.errors.items():
        text += f"\n{shape.model} {variant}: no figures ({why})"
    return text


def format_quality(report: Report) -> str:
    if not report.quality:
        return "perplexity: not measured"
    base = next((q.perplexity for q in report.quality if q.variant == "none"), None)
    header = ("variant", "weights", "kv", "perplexity", "x none", "tokens")
    rows = [
        (
            q.variant,
            q.quantization,
            q.kv_cache_dtype,
            _f(q.perplexity, ".3f"),
            _f(q.ratio_to(base), ".4f"),
            str(q.tokens) if q.error is None else f"FAILED: {q.error[:60]}",
        )
        for q in report.quality
    ]
    return f"perplexity on held-out text ({report.quality_model}):\n" + _table(header, rows)


def format_kv(kv: KvBlocks | None) -> str:
    if kv is None:
        return "fp8 KV blocks: not measured (CUDA only)"
    if kv.error:
        return f"fp8 KV blocks: FAILED: {kv.error}"
    shown = ", ".join(f"{k}: {n:,}" for k, n in kv.blocks.items())
    return f"KV blocks at {kv.budget_gb:g} GiB: {shown} ({_x(kv.ratio)})"


# ---------------------------------------------------------------- JSON and plot


def run_json(run: RunFigures | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {
        "concurrency": run.concurrency,
        "requests": run.requests,
        "output_tokens": run.output_tokens,
        "wall_s": run.wall_s,
        "output_tok_s": run.output_tok_s,
        "decode_tokens": run.decode_tokens,
        "decode_s": run.decode_s,
        "decode_tok_s": run.decode_tok_s,
        "ttft_p50_s": run.ttft(0.5),
        "ttft_p99_s": run.ttft(0.99),
        "steps": run.steps,
        "spec": run.spec,
        "repeats": run.repeats,
    }


def to_json(report: Report, meta: dict[str, Any]) -> dict[str, Any]:
    cells = [
        {
            "variant": c.variant,
            "workload": c.workload,
            "batch1": run_json(c.batch1),
            "concurrent": run_json(c.concurrent),
            "batch1_ratio_to_off": batch1_ratio(report, c.variant, c.workload),
            "concurrent_ratio_to_off": concurrent_ratio(report, c.variant, c.workload),
            "copy_fraction": c.copy_fraction,
            "lookup_fraction": c.lookup_fraction,
        }
        for c in report.cells
    ]
    shape = None
    if report.shape is not None:
        shape = {
            "model": report.shape.model,
            "dtype": report.shape.dtype,
            "runs": {v: run_json(r) for v, r in report.shape.runs.items()},
            "ratios_to_off": {v: shape_ratio(report.shape, v) for v in report.shape.runs},
            "errors": report.shape.errors,
        }
    kv = None
    if report.kv is not None:
        kv = {
            "budget_gb": report.kv.budget_gb,
            "blocks": report.kv.blocks,
            "ratio": report.kv.ratio,
            "error": report.kv.error,
        }
    quality = [
        {
            "variant": q.variant,
            "quantization": q.quantization,
            "kv_cache_dtype": q.kv_cache_dtype,
            "perplexity": q.perplexity,
            "tokens": q.tokens,
            "ratio_to_none": quality_ratio(report.quality, q.variant),
            "error": q.error,
        }
        for q in report.quality
    ]
    return {
        **meta,
        "bench": "latency",
        "model": report.model,
        "concurrency": report.concurrency,
        "workloads": report.workloads,
        "cells": cells,
        "errors": report.errors,
        "shape": shape,
        "kv_blocks": kv,
        "quality_model": report.quality_model,
        "quality": quality,
        "targets": [
            {"name": t.name, "value": t.value, "threshold": t.threshold, "met": t.met, "at_most": t.at_most}
            for t in targets(report)
        ],
    }


def save_json(path: Path, report: Report, meta: dict[str, Any]) -> None:
    write_json(path, to_json(report, meta))


VARIANT_COLORS = {"off": "#9a9a9a", "ngram": "#1f77b4", "int8": "#2ca02c", "fp8": "#d62728"}


def write_plot(path: Path, report: Report, title: str) -> None:
    """One PNG, two panels (batch 1: decode tok/s; N at once: output tok/s), bars per workload and variant,
    each labelled with its ratio to off."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    workloads = list(dict.fromkeys(c.workload for c in report.cells))
    variants = list(dict.fromkeys(c.variant for c in report.cells))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
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
            for bar, w in zip(bars, workloads, strict=True):
                r = ratio_of(report, variant, w)
                shown = f"{bar.get_height():.0f}" + ("" if r is None or variant == OFF else f"\n{r:.2f}x")
                ax.annotate(
                    shown,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(label, fontsize=10)
        ax.margins(y=0.35)
    axes[0].legend(fontsize=8, loc="upper left", ncol=len(variants))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
