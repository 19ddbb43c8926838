"""One table summarising scripts/gpu_check.sh: the GPU tests' outcome (pytest's JUnit XML) and the figures of
each stage's JSON documents (an engine benchmark and its decode steps, the latency benchmark and its weight
formats on a larger shape); a stage that failed or timed out before writing its main JSON gets one row
saying so, a part it did not reach is left out ("not reached" for the decode steps).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.bench.report import fmt, format_table

TIMED_OUT = (124, 137)  # timeout's status, and a process killed after its grace
HEADER = (
    "stage",
    "conc",
    "method / measure",
    "tok/s",
    "× hf-cont",
    "fwd @max",
    "graphs",
    "vs roofline",
    "result",
)
MARKS = {"passed": ".", "failed": "F", "errors": "E", "skipped": "s"}  # pytest -q's progress marks


@dataclass(frozen=True)
class Stage:
    label: str
    path: Path  # the main document (JUnit XML of the tests, a benchmark's JSON)
    rc: int
    seconds: float
    more: tuple[Path, ...] = ()  # the stage's other JSON documents, merged into the main one


def _line(label: str, measure: str, result: str, conc: str = "-") -> tuple[str, ...]:
    """A row with only a measure and a result (the figures' columns "-")."""
    return (label, conc, measure, "-", "-", "-", "-", "-", result)


def _outcome(stage: Stage) -> str:
    if stage.rc in TIMED_OUT:
        return f"TIMED OUT after {stage.seconds:.0f} s"
    return f"exit {stage.rc}, {stage.seconds:.0f} s"


def junit_counts(junit: Path) -> dict[str, int] | None:
    """passed / failed / errors / skipped from pytest's JUnit XML; None when there is no readable file."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


PROGRESS_LINE = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")


def progress_counts(log: Path) -> dict[str, int] | None:
    """passed / failed / errors / skipped so far, from `pytest -q`'s progress lines (for a run stopped
    before it wrote its JUnit XML); None without a readable log."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    marks = "".join(m[1] for line in text.splitlines() if (m := PROGRESS_LINE.match(line.strip())))
    return {name: marks.count(mark) for name, mark in MARKS.items()}


def tests_row(stage: Stage) -> tuple[str, ...]:
    counts = junit_counts(stage.path)
    if counts is None:
        so_far = progress_counts(stage.path.with_suffix(".log"))
        shown = f"; before it stopped: {', '.join(f'{n} {k}' for k, n in so_far.items())}" if so_far else ""
        result = f"NO RESULTS ({_outcome(stage)}{shown})"
    else:
        verdict = "PASSED" if stage.rc == 0 else "FAILED"
        shown = ", ".join(f"{n} {k}" for k, n in counts.items())
        result = f"{verdict}: {shown} ({_outcome(stage)})"
    return _line(stage.label, "-", result)


def method_rows(label: str, run: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for name, fig in run["methods"].items():
        conc = str(run["concurrency"])
        if fig.get("skipped"):
            rows.append((label, conc, name, "-", "-", "-", fig["skipped"], "-", "skipped"))
        elif fig.get("error"):
            rows.append(_line(label, name, f"FAILED: {fig['error'][:60]}", conc))
        else:
            speed, ratio = fmt(fig["tokens_per_s"], ",.0f"), fmt(fig["ratio_to_hf-static"], ".2f")
            share = fmt(fig["forward_share_max_batch"], ".1%")
            rows.append(
                (label, conc, name, speed, ratio, share, fig["cuda_graphs"] or "-", "-", fig["setting"])
            )
    return rows


def decode_rows(label: str, doc: dict[str, Any]) -> list[tuple[str, ...]]:
    if doc.get("partial") or "decode_steps" not in doc:
        return [_line(label, "decode steps", "not reached: the stage stopped first")]
    rows = []
    for d in doc.get("decode_steps", []):
        roofline = "n/a" if d["ratio_to_roofline"] is None else f"{d['ratio_to_roofline']:.2f}×"
        note = f"{d['step_s'] * 1e3:.2f} ms a step, context ~{d['mean_context']:.0f}"
        if d["roofline_s"]:
            note += f"; roofline {d['roofline_s'] * 1e3:.3f} ms at {d['hbm_gbps']:g} GB/s"
        measure = f"decode steps, batch {d['batch']}"
        rows.append(
            (label, "-", measure, f"{d['tokens_per_s']:,.0f}", "-", "-", d["cuda_graphs"], roofline, note)
        )
    if doc.get("decode_error"):
        rows.append(_line(label, "decode steps", f"FAILED: {doc['decode_error'][:60]}"))
    return rows


def ratio_rows(label: str, doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """The engine benchmark's ratios that it measured (those it could not are left out)."""
    return [
        _line(label, "ratio", f"{r['name']}: {r['value']:.3g}")
        for r in doc.get("ratios", [])
        if r["value"] is not None
    ]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _latency_run_row(label: str, name: str, run: dict[str, Any], ratio: float | None) -> tuple[str, ...]:
    """One timed run of `sluice bench latency`: batch 1 shows decode tok/s, a concurrent run output tok/s."""
    batch1 = run["concurrency"] == 1
    speed = run["decode_tok_s"] if batch1 else run["output_tok_s"]
    note = f"{fmt(ratio, '.2f')}x off; TTFT p50 {_ms(run['ttft_p50_s'])}"
    if not batch1:
        note += f", p99 {_ms(run['ttft_p99_s'])}"
    spec = run.get("spec") or {}
    if name.startswith("ngram") and "spec_acceptance_rate" in spec:
        accepted = spec.get("spec_mean_accepted_length")
        note += f"; accepted {spec['spec_acceptance_rate']:.0%}, mean length {fmt(accepted, '.2f')}"
    measure = f"{name} ({'decode' if batch1 else 'output'})"
    return (label, str(run["concurrency"]), measure, fmt(speed, ",.0f"), "-", "-", "-", "-", note)


def latency_rows(label: str, doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """`sluice bench latency`'s figures: each variant and workload at batch 1 and at once, the larger shape's
    batch-1 decode, perplexity against unquantized, the fp8 KV blocks."""
    rows = []
    for cell in doc["cells"]:
        name = f"{cell['variant']} {cell['workload']}"
        for key, ratio in (("batch1", "batch1_ratio_to_off"), ("concurrent", "concurrent_ratio_to_off")):
            if cell.get(key):
                rows.append(_latency_run_row(label, name, cell[key], cell[ratio]))
    for variant, why in doc["errors"].items():
        result = why if why.startswith("skipped") else f"FAILED: {why[:60]}"
        rows.append(_line(label, variant, result))
    shape = doc.get("shape")
    if shape:
        for variant, run in shape["runs"].items():
            name = f"{variant} {shape['model']}"
            rows.append(_latency_run_row(label, name, run, shape["ratios_to_off"].get(variant)))
        for variant, why in shape["errors"].items():
            result = why if why.startswith("skipped") else f"FAILED: {why[:60]}"
            rows.append(_line(label, f"{variant} {shape['model']}", result))
    for q in doc.get("quality", []):
        if q["error"]:
            result = f"FAILED: {q['error'][:60]}"
        else:
            result = f"{q['perplexity']:.3f} ({fmt(q['ratio_to_none'], '.4f')}x none, {q['tokens']} tokens)"
        rows.append(_line(label, f"perplexity {q['variant']}", result))
    kv = doc.get("kv_blocks")
    if kv:
        shown = kv["error"] or ", ".join(f"{k}: {n:,}" for k, n in kv["blocks"].items())
        rows.append(_line(label, f"KV blocks at {kv['budget_gb']:g} GiB", shown))
    return rows


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def merged(stage: Stage) -> dict[str, Any] | None:
    """The stage's main document with the figures of each other one that was written merged in (their
    `ratios` appended, `partial` when any is); None without a readable main document."""
    doc = _read(stage.path)
    for part in filter(None, map(_read, stage.more if doc is not None else ())):
        ratios = doc.get("ratios", []) + part.get("ratios", [])
        doc.update({**part, "bench": doc.get("bench"), "ratios": ratios})
        doc["partial"] = doc.get("partial") or part.get("partial")
    return doc


def bench_rows(stage: Stage) -> list[tuple[str, ...]]:
    """A benchmark's rows, or one row saying why there are none."""
    doc = merged(stage)
    if doc is None:
        return [_line(stage.label, "-", f"NO RESULTS ({_outcome(stage)})")]
    if doc.get("bench") == "latency":
        rows = latency_rows(stage.label, doc)
    else:
        rows = [r for run in doc["runs"] for r in method_rows(stage.label, run)]
        rows += decode_rows(stage.label, doc) if stage.more else []
        rows += ratio_rows(stage.label, doc)
    verdict = "ok" if stage.rc == 0 else "FAILED"
    if doc.get("partial"):
        verdict += ", figures of the concurrencies finished before it stopped"
    rows.append(_line(stage.label, "stage", f"{verdict} ({_outcome(stage)})"))
    return rows


def format_summary(tests: Stage | None, benches: list[Stage]) -> str:
    rows: list[tuple[str, ...]] = [HEADER]
    if tests is not None:
        rows.append(tests_row(tests))
    for stage in benches:
        rows.extend(bench_rows(stage))
    return format_table(rows)


def _stage(values: list[str]) -> Stage:
    """LABEL PATH[:PATH...] RC SECONDS: the first path the main document, the others merged into it."""
    label, paths, rc, seconds = values
    first, *more = (Path(p) for p in paths.split(":"))
    return Stage(label, first, int(rc), float(seconds), tuple(more))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_summary.py", description=__doc__.split("\n")[0])
    parser.add_argument("--tests", nargs=4, metavar=("LABEL", "JUNIT_XML", "RC", "SECONDS"))
    parser.add_argument(
        "--bench", nargs=4, action="append", default=[], metavar=("LABEL", "JSON[:JSON]", "RC", "SECONDS")
    )
    args = parser.parse_args(argv)
    tests = _stage(args.tests) if args.tests else None
    print(format_summary(tests, [_stage(b) for b in args.bench]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
