"""Figures of one engine-benchmark run: comparison with the reference, targets, table, JSON and plot."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from sluice.bench.engine_methods import SLUICE_METHODS, MethodResult

REFERENCE = "hf-sequential"  # greedy outputs are compared with this method's
BASELINE = "hf-continuous"  # tokens/s ratios are taken against this method
HEADLINE = "sluice-continuous"


@dataclass(frozen=True)
class Target:
    """One goal of the benchmark. `met` is None when the run did not measure it."""

    name: str
    value: float | None
    threshold: float
    met: bool | None

    def line(self) -> str:
        verdict = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[self.met]
        shown = "n/a" if self.value is None else f"{self.value:.3g}"
        return f"  {verdict:<12} {self.name}: {shown} (target {self.threshold:g})"


@dataclass(frozen=True)
class Row:
    """One method's figures as printed and written to JSON."""

    result: MethodResult
    ratio: float | None  # tokens/s over BASELINE's
    mismatches: int | None  # requests whose greedy output differs from REFERENCE's; None without a reference


def mismatching_requests(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """How many requests' token lists differ from the reference's, position by position."""
    assert len(outputs) == len(reference)
    return sum(1 for got, want in zip(outputs, reference, strict=True) if got != want)


def build_rows(results: dict[str, MethodResult]) -> list[Row]:
    base = results.get(BASELINE)
    ref = results.get(REFERENCE)
    rows = []
    for result in results.values():
        ratio = result.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s > 0 else None
        mismatches = mismatching_requests(result.outputs, ref.outputs) if ref else None
        rows.append(Row(result, ratio, mismatches))
    return rows


def _at_least(name: str, value: float | None, threshold: float) -> Target:
    return Target(name, value, threshold, None if value is None else value >= threshold)


def _speed_target(results: dict[str, MethodResult], other: str, threshold: float) -> Target:
    head, base = results.get(HEADLINE), results.get(other)
    value = head.tokens_per_s / base.tokens_per_s if head and base and base.tokens_per_s > 0 else None
    return _at_least(f"{HEADLINE} tokens/s ÷ {other}", value, threshold)


def evaluate_targets(
    results: dict[str, MethodResult], rows: list[Row], errors: dict[str, str]
) -> list[Target]:
    """The issue's targets. Never relaxed: a target the run could not measure is reported as such."""
    head = results.get(HEADLINE)
    sluice_rows = [r for r in rows if r.result.name in SLUICE_METHODS]
    compared = [r for r in sluice_rows if r.mismatches is not None]
    all_ran = not any(m in errors for m in SLUICE_METHODS) and len(sluice_rows) == len(SLUICE_METHODS)
    mismatches = sum(r.mismatches or 0 for r in compared)
    equal = None if not compared or not all_ran or REFERENCE not in results else mismatches == 0
    return [
        _speed_target(results, "hf-continuous", 2.5),
        _speed_target(results, "hf-static", 2.0),
        _speed_target(results, "hf-sequential", 5.0),
        _at_least(
            f"{HEADLINE} share of step time in the model forward, at the largest batch",
            head and head.forward_share_max_batch,
            0.90,
        ),
        _at_least(f"{HEADLINE} peak KV efficiency", head and head.kv_efficiency, 0.95),
        Target(
            f"requests where a sluice method's greedy output differs from {REFERENCE} (all methods)",
            float(mismatches) if compared else None,
            0,
            equal,
        ),
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row], errors: dict[str, str], num_requests: int) -> str:
    header = (
        "method", "out tok/s", "wall s", f"× {BASELINE}", f"= {REFERENCE}",
        "fwd share", "@max batch", "KV eff", "setting",
    )
    lines = [header]
    for row in rows:
        r = row.result
        same = "-" if row.mismatches is None else ("yes" if row.mismatches == 0 else f"no ({row.mismatches})")
        lines.append(
            (
                r.name,
                f"{r.tokens_per_s:.1f}",
                f"{r.wall_s:.2f}",
                _fmt(row.ratio, ".2f"),
                same,
                _fmt(r.forward_share, ".1%"),
                "-" if r.max_batch is None else f"{_fmt(r.forward_share_max_batch, '.1%')} ({r.max_batch})",
                _fmt(r.kv_efficiency, ".3f"),
                r.setting,
            )
        )
    lines.extend((name, "FAILED", "", "", "", "", "", "", msg[:80]) for name, msg in errors.items())
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(
        f"(= {REFERENCE}: 'no (k)' means k of {num_requests} requests differ; fwd share: time in the model "
        "forward / step time, overall and over the steps with the largest batch (its size))"
    )
    return "\n".join(text)


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def to_json(
    rows: list[Row], errors: dict[str, str], targets: list[Target], meta: dict[str, Any]
) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for row in rows:
        r = row.result
        methods[r.name] = {
            "tokens_per_s": r.tokens_per_s,
            "wall_s": r.wall_s,
            "output_tokens": r.output_tokens,
            f"ratio_to_{BASELINE}": row.ratio,
            f"greedy_equals_{REFERENCE}": None if row.mismatches is None else row.mismatches == 0,
            "mismatching_requests": row.mismatches,
            "forward_share": r.forward_share,
            "forward_share_max_batch": r.forward_share_max_batch,
            "max_batch": r.max_batch,
            "kv_efficiency": r.kv_efficiency,
            "preemptions": r.preemptions,
            "setting": r.setting,
            "sweep": r.sweep,
            "runs_tokens_per_s": r.runs_tokens_per_s,
            "error": None,
        }
    for name, msg in errors.items():
        methods[name] = {"error": msg}
    return {
        **meta,
        "reference": REFERENCE,
        "baseline": BASELINE,
        "methods": methods,
        "targets": [t.__dict__ for t in targets],
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def write_plot(path: Path, rows: list[Row], title: str) -> None:
    """A PNG bar chart of output tokens/s per method (transformers grey, sluice blue)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [r.result.name for r in rows]
    speeds = [r.result.tokens_per_s for r in rows]
    colors = ["#1f77b4" if n in SLUICE_METHODS else "#9a9a9a" for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    bars = ax.bar(names, speeds, color=colors)
    for bar, row in zip(bars, rows, strict=True):
        label = f"{bar.get_height():.0f}" + ("" if row.ratio is None else f"\n{row.ratio:.2f}×")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.2)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
