"""Figures of one engine-benchmark run (one block per concurrency, and the decode steps): the greedy
comparison with the reference, the memory roofline of a decode step, ratios, tables, JSON and plot.

The roofline: (weight bytes + KV bytes read) ÷ memory bandwidth. A step of batch B reads every weight the
forward multiplies by (a tied embedding whole, as the output projection; an untied input embedding only at
B rows) and B × context × layers × 2 × KV heads × head_dim KV elements.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from sluice.bench.common import Column, column_rows, figure, fmt, format_table, ratio, save_figure
from sluice.bench.engine_driver import kv_bytes_per_token
from sluice.bench.engine_methods import (
    HF_METHODS,
    NOT_ON_CPU,
    SLUICE_METHODS,
    DecodeStep,
    MethodResult,
    Workload,
)
from sluice.model.presets import meta_model

REFERENCE = "hf-sequential"  # greedy outputs are compared with this method's
BASELINE = "hf-continuous"  # tokens/s ratios are taken against this method
HEADLINE = "sluice-continuous"  # the method whose tokens/s is set against each transformers method's
# Logit gap under which two correct greedy paths may pick different tokens by float noise alone, per dtype.
# Measured on the benchmark model on CPU (logits within ±1.7): the largest logit difference between
# hf-sequential and hf-static or a teacher-forced forward, up to their first differing token, is 1.7e-6 in
# float32, 1.2e-2 in bfloat16 and 1.5e-3 in float16 (1.5 units in the last place at 1). Each threshold is
# at least five times that (8 units in the last place at 1 for the 16-bit types).
NEAR_TIE_THRESHOLD = {torch.float32: 1e-4, torch.bfloat16: 6.25e-2, torch.float16: 7.8e-3}
GREEDY_RULE = (
    "token by token up to each request's first difference, which is a near-tie when the reference's logits "
    "score the other token within the near-tie threshold of its own"
)


# Peak memory bandwidth in GB/s (10^9 bytes/s) by torch.cuda.get_device_name, first match wins.
HBM_GBPS: tuple[tuple[str, float], ...] = (
    (r"H200", 4800.0),
    (r"H100.*PCIe", 2000.0),
    (r"H100", 3350.0),  # SXM (HBM3)
    (r"A100.*80\s*GB", 2039.0),
    (r"A100", 1555.0),  # 40 GB
    (r"L40S", 864.0),
    (r"\bL4\b", 300.0),
)


def hbm_gbps(device_name: str) -> float | None:
    """The bandwidth of a known GPU by its name, None for any other device."""
    for pattern, gbps in HBM_GBPS:
        if re.search(pattern, device_name):
            return gbps
    return None


def device_bandwidth(device: str, override: float | None) -> tuple[float | None, str]:
    """(GB/s, where the figure comes from): `override` when given, else the table for a CUDA device, else
    None (a CPU has no entry)."""
    if override is not None:
        return override, "--hbm-gbps"
    if not device.startswith("cuda"):
        return None, "a CPU has no entry; give --hbm-gbps"
    name = torch.cuda.get_device_name(torch.device(device))
    gbps = hbm_gbps(name)
    return gbps, (name if gbps is not None else f"{name} not in the table; give --hbm-gbps")


def weight_bytes_per_step(config: transformers.PretrainedConfig, element_size: int) -> int:
    """Bytes of weights one decode step reads: every parameter but an untied input embedding."""
    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if not config.tie_word_embeddings:
        total -= embedding.numel()
    return total * element_size


@dataclass(frozen=True)
class Roofline:
    """The bytes one decode step reads and, given a bandwidth, the least time it takes."""

    weight_bytes: int
    kv_bytes: int
    gbps: float | None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def seconds(self) -> float | None:
        return None if not self.gbps else self.total_bytes / (self.gbps * 1e9)


def decode_roofline(
    config: transformers.PretrainedConfig, element_size: int, batch: int, context: float, gbps: float | None
) -> Roofline:
    """The roofline of a decode step of `batch` rows with `context` tokens each (mean, new token included)."""
    kv = round(batch * context * kv_bytes_per_token(config, element_size))
    return Roofline(weight_bytes_per_step(config, element_size), kv, gbps)


@dataclass(frozen=True)
class Measured:
    """One ratio of the run as printed and written: `value` None when the run could not measure it."""

    name: str
    value: float | None

    def line(self) -> str:
        return f"  {self.name}: {fmt(self.value, '.3g') if self.value is not None else 'n/a'}"


@dataclass(frozen=True)
class GreedyMatch:
    """One method's greedy outputs against REFERENCE's, each request compared up to its first differing
    token: *equal* without one, *equal up to a near-tie* when the reference's logits there score the method's
    token within the threshold of its own (float noise can flip such a choice between two correct paths),
    else *differing* (a token the reference clearly ranks lower, or an output of another length)."""

    differing: int  # requests with a real difference
    near_ties: int  # requests equal up to a near-tie
    tokens_compared: int  # every position of an equal request; of another, up to its first difference

    @property
    def equal(self) -> bool:
        """Equal to the reference up to near-ties: no request differs."""
        return self.differing == 0


@dataclass(frozen=True)
class GreedyCheck:
    """The greedy comparison of every method with REFERENCE, and the reference margins it rested on."""

    threshold: float  # logit gap below which a first difference is a near-tie
    reference_tokens: int  # output positions of the reference, all requests
    close_calls: int  # of those, positions whose top-two logit margin is below the threshold
    min_margin: float  # smallest top-two logit margin of the reference over all its output positions
    methods: dict[str, GreedyMatch]

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": REFERENCE,
            "rule": GREEDY_RULE,
            "near_tie_threshold": self.threshold,
            "reference_tokens": self.reference_tokens,
            "reference_close_calls": self.close_calls,
            "reference_min_top2_margin": self.min_margin,
        }


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the two token lists differ (a missing token counts); None when equal."""
    for pos, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return pos
    return None if len(got) == len(want) else min(len(got), len(want))


def compare_request(
    got: list[int], want: list[int], logits: torch.Tensor, threshold: float
) -> tuple[str, int]:
    """Classifies one request as "equal", "near-tie" or "differs" (see GreedyMatch); returns the verdict and
    the positions compared. `logits` (len(want), vocab) are the reference's at each of its output positions.
    """
    pos = first_difference(got, want)
    if pos is None:
        return "equal", len(want)
    if pos == len(got) or pos == len(want) or not 0 <= got[pos] < logits.shape[-1]:
        return "differs", pos + 1
    gap = (logits[pos, want[pos]] - logits[pos, got[pos]]).item()
    return ("near-tie" if gap < threshold else "differs"), pos + 1


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """(n, vocab) logits → (n,) gap between the largest and the second largest logit of each row."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def check_greedy(
    results: dict[str, MethodResult], reference_logits: Iterable[torch.Tensor], threshold: float
) -> GreedyCheck:
    """Compares every method's outputs with REFERENCE's (which must be in `results`).

    `reference_logits` yields, in workload order, each request's (len(output), vocab) reference logits.
    """
    want = results[REFERENCE].outputs
    verdicts: dict[str, list[tuple[str, int]]] = {name: [] for name in results}
    min_margin, close_calls = math.inf, 0
    for i, logits in enumerate(reference_logits):
        margins = top2_margins(logits)
        min_margin = min(min_margin, margins.min().item())
        close_calls += int((margins < threshold).sum())
        for name, result in results.items():
            verdicts[name].append(compare_request(result.outputs[i], want[i], logits, threshold))
    methods = {name: _match(v) for name, v in verdicts.items()}
    return GreedyCheck(threshold, sum(len(w) for w in want), close_calls, min_margin, methods)


def _match(verdicts: list[tuple[str, int]]) -> GreedyMatch:
    return GreedyMatch(
        differing=sum(v == "differs" for v, _ in verdicts),
        near_ties=sum(v == "near-tie" for v, _ in verdicts),
        tokens_compared=sum(n for _, n in verdicts),
    )


@dataclass(frozen=True)
class Row:
    """One method's figures as printed and written to JSON."""

    result: MethodResult
    ratio: float | None  # tokens/s over BASELINE's
    greedy: GreedyMatch | None  # against REFERENCE; None without a reference


def build_rows(results: dict[str, MethodResult], check: GreedyCheck | None) -> list[Row]:
    base = results.get(BASELINE)
    rows = []
    for result in results.values():
        ratio = result.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s > 0 else None
        rows.append(Row(result, ratio, check.methods[result.name] if check else None))
    return rows


def headline_ratios(results: dict[str, MethodResult], label: str = "") -> list[Measured]:
    """HEADLINE's tokens/s over each transformers method's (names prefixed with `[label]` when given)."""
    head = results.get(HEADLINE)
    prefix = f"[{label}] " if label else ""
    return [
        Measured(f"{prefix}{HEADLINE} tokens/s ÷ {other}",
                 ratio(head and head.tokens_per_s, (base := results.get(other)) and base.tokens_per_s))
        for other in HF_METHODS[::-1]
    ]  # fmt: skip


@dataclass
class Block:
    """Every method on the workload of one concurrency: results, failures, skipped methods, greedy check."""

    model: str
    concurrency: int
    work: Workload
    workload: dict[str, Any]  # Workload.describe
    results: dict[str, MethodResult]
    errors: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)  # method → why it did not run (NOT_ON_CPU)
    check: GreedyCheck | None = None

    @property
    def label(self) -> str:
        return f"{self.model}, {self.concurrency} requests"

    @property
    def rows(self) -> list[Row]:
        return build_rows(self.results, self.check)

    def ratios(self) -> list[Measured]:
        return headline_ratios(self.results, self.label)


@dataclass(frozen=True)
class DecodeFigure:
    """Decode-only steps as measured, and the memory roofline of the same steps."""

    step: DecodeStep
    roofline: Roofline
    bandwidth_source: str  # the GPU's name, "--hbm-gbps", or why there is no figure

    @property
    def ratio(self) -> float | None:
        """Measured step time ÷ roofline time (1 = as fast as memory allows); None without a bandwidth."""
        seconds = self.roofline.seconds
        return self.step.step_s / seconds if seconds else None


def graphs_ratio(figures: list[DecodeFigure], model: str, batch: int) -> Measured:
    """Decode tokens/s with CUDA graphs over eager (CUDA only: None elsewhere)."""
    main = next((f for f in figures if f.step.cuda_graphs in ("on", NOT_ON_CPU)), None)
    eager = next((f for f in figures if f.step.cuda_graphs == "off"), None)
    return Measured(
        f"[{model}] decode tokens/s with CUDA graphs ÷ eager (decode-only steps, batch {batch})",
        ratio(main and main.step.tokens_per_s, eager and eager.step.tokens_per_s),
    )


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
    lines.extend((name, "FAILED", "", "", "", "", "", "", "", msg[:80]) for name, msg in errors.items())
    lines.extend((name, why, "", "", "", "", "", "", why, "") for name, why in (skipped or {}).items())
    return format_table(lines) + (
        f"\n(= {REFERENCE}: 'no (k)' means k of {num_requests} requests differ, 'k near-tie' that k are "
        "equal up to a near-tie (see the greedy check); fwd share: time in the model forward / step time, "
        "overall and over the steps with the largest batch (its size); graphs: CUDA graphs for decode-only "
        "steps)"
    )


def format_block(block: Block) -> str:
    """One concurrency's table, its greedy check and hf-continuous's sweep."""
    rows = block.rows
    parts = [f"-- {block.label} at once", format_methods(rows, block.errors, len(block.work), block.skipped)]
    if block.check is not None:
        parts.append(format_greedy_check(block.check, rows))
    hf_cb = block.results.get("hf-continuous")
    if hf_cb is not None:
        tried = ", ".join(f"{s['max_batch_tokens']}: {s['tokens_per_s']:.1f} tok/s" for s in hf_cb.sweep)
        parts.append(f"hf-continuous max_batch_tokens tried ({tried}); best {hf_cb.setting}")
    return "\n".join(parts)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def format_decode(figures: list[DecodeFigure], error: str | None) -> str:
    """The decode-step measurement: step time, tokens/s and the roofline, per CUDA graphs setting."""
    if not figures and error is None:
        return "decode-only steps: not measured (--decode-batch 0)"
    lines = []
    for f in figures:
        s, roof = f.step, f.roofline
        bound = (
            f"roofline {roof.seconds * 1e3:.3f} ms ({_gb(roof.weight_bytes)} weights + {_gb(roof.kv_bytes)} "
            f"KV at {roof.gbps:g} GB/s, {f.bandwidth_source}): {f.ratio:.2f}× the roofline"
            if roof.seconds
            else f"roofline n/a: {_gb(roof.weight_bytes)} weights + {_gb(roof.kv_bytes)} KV read per step, "
            f"no bandwidth: {f.bandwidth_source}"
        )
        lines.append(
            f"decode-only steps, batch {s.batch}, context ~{s.mean_context:.0f}, CUDA graphs "
            f"{s.cuda_graphs}: {s.step_s * 1e3:.2f} ms a step over {s.steps} steps, "
            f"{s.tokens_per_s:.1f} tok/s; {bound}"
        )
    if error is not None:
        lines.append(f"decode-only steps FAILED: {error}")
    return "\n".join(lines)


def _greedy_cell(greedy: GreedyMatch | None) -> str:
    if greedy is None:
        return "-"
    ties = f"{greedy.near_ties} near-tie" if greedy.near_ties else ""
    if greedy.equal:
        return f"yes ({ties})" if ties else "yes"
    return f"no ({greedy.differing}; {ties})" if ties else f"no ({greedy.differing})"


def format_greedy_check(check: GreedyCheck, rows: list[Row]) -> str:
    """What the greedy comparison compared: its rule, threshold, the reference's margins, tokens compared."""
    compared = ", ".join(
        f"{r.result.name} {r.greedy.tokens_compared}/{check.reference_tokens}"
        for r in rows
        if r.greedy is not None and r.result.name != REFERENCE
    )
    return (
        f"greedy check against {REFERENCE}: {GREEDY_RULE} ({check.threshold:.2g}); the reference's top-two "
        f"margin is below it at {check.close_calls} of {check.reference_tokens} positions, smallest "
        f"{check.min_margin:.3g}; tokens compared: {compared or '-'}"
    )


def to_json(
    rows: list[Row],
    errors: dict[str, str],
    meta: dict[str, Any],
    check: GreedyCheck | None,
    skipped: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One block's figures (`meta` merged in at the top)."""
    methods: dict[str, Any] = {}
    for row in rows:
        r, g = row.result, row.greedy
        figures = {k: v for k, v in dataclasses.asdict(r).items() if k not in ("name", "outputs")}
        methods[r.name] = {
            "tokens_per_s": r.tokens_per_s,
            f"ratio_to_{BASELINE}": row.ratio,
            f"greedy_equals_{REFERENCE}": None if g is None else g.equal,
            "mismatching_requests": None if g is None else g.differing,
            "near_tie_requests": None if g is None else g.near_ties,
            "tokens_compared": None if g is None else g.tokens_compared,
            **figures,
            "error": None,
        }
    for name, msg in errors.items():
        methods[name] = {"error": msg}
    for name, why in (skipped or {}).items():
        methods[name] = {"skipped": why, "error": None}
    return {
        **meta,
        "reference": REFERENCE,
        "baseline": BASELINE,
        "greedy_check": None if check is None else check.to_json(),
        "methods": methods,
    }


def decode_json(figure: DecodeFigure) -> dict[str, Any]:
    s, roof = figure.step, figure.roofline
    return {
        **dataclasses.asdict(s),
        "tokens_per_s": s.tokens_per_s,
        "weight_bytes": roof.weight_bytes,
        "kv_bytes": roof.kv_bytes,
        "hbm_gbps": roof.gbps,
        "bandwidth_source": figure.bandwidth_source,
        "roofline_s": roof.seconds,
        "ratio_to_roofline": figure.ratio,
    }


def to_json_runs(
    blocks: list[Block],
    decode: list[DecodeFigure],
    decode_error: str | None,
    ratios: list[Measured],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The whole run: `runs` holds one block per concurrency; `workload`, `methods` and `greedy_check` at
    the top are the first block's (the layout of a one-block run); `ratios` are all of them."""
    runs = []
    for block in blocks:
        doc = to_json(block.rows, block.errors, {}, block.check, block.skipped)
        runs.append({"concurrency": block.concurrency, "workload": block.workload, **doc})
    first = runs[0]
    return {
        "partial": False,
        **meta,
        **{key: first[key] for key in ("reference", "baseline", "workload", "greedy_check", "methods")},
        "runs": runs,
        "decode_steps": [decode_json(f) for f in decode],
        "decode_error": decode_error,
        "ratios": [r.__dict__ for r in ratios],
    }


def write_plot(path: Path, rows: list[tuple[Block, Row]], title: str) -> None:
    """A PNG bar chart of output tokens/s per method and concurrency (transformers grey, sluice blue)."""
    several = len({b.concurrency for b, _ in rows}) > 1
    names = [r.result.name + (f" @{b.concurrency}" if several else "") for b, r in rows]
    colors = ["#1f77b4" if r.result.name in SLUICE_METHODS else "#9a9a9a" for _, r in rows]
    fig = figure(max(8, 0.8 * len(rows)), 4.5)
    ax = fig.subplots()
    bars = ax.bar(names, [r.result.tokens_per_s for _, r in rows], color=colors)
    labels = [
        f"{r.result.tokens_per_s:.0f}" + ("" if r.ratio is None else f"\n{r.ratio:.2f}×") for _, r in rows
    ]
    ax.bar_label(bars, labels=labels, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.2)
    ax.tick_params(axis="x", labelrotation=20)
    save_figure(fig, path)
