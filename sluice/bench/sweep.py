"""`sluice bench sweep PRESET`: the load generator (`serve`) over systems started one at a time, a load swept
over each, start-up failures recorded rather than raised. The presets: `compare` (batching policies against
request rate), `pipeline` (the four services against the engine alone), `routing`
(routing policies across engine replicas) and `peers` (sluice, vLLM's CPU server and llama.cpp side by side);
each is also `sluice bench PRESET` for the first three.

Here: what the presets share (an `Opener` yields an `Endpoint`) and the command's dispatch.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import uvloop
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from sluice.bench.common import add_flags, positive_int, run_meta
from sluice.bench.serve import ServeConfig, ServeResult, run_serve
from sluice.bench.serve_data import BenchRequest
from sluice.bench.stack import Stack, StackOptions
from sluice.launcher import resolve_model
from sluice.plan import host_load

P = TypeVar("P")  # a point of the load
R = TypeVar("R")  # what measuring one point gives

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) → value


@dataclass(frozen=True)
class Endpoint:
    """A started system as a load drives it."""

    url: str  # its OpenAI API, "http://host:port/v1"
    model: str | None  # the OpenAI "model" field; None = the first of GET /models
    cpu_seconds: Callable[[], dict[str, float]]  # CPU seconds per process so far ({} when unknown)
    metrics_urls: Mapping[str, str] = field(default_factory=dict)  # process → its /metrics URL
    setup: str = ""  # how it runs, where the system says (sluice: its engines, threads and dtype)


Opener = Callable[[], AbstractContextManager[Endpoint]]


@dataclass
class SystemRun(Generic[R]):
    """A system's measured points in order, or why it could not be started."""

    name: str
    points: list[R] = field(default_factory=list)
    error: str | None = None
    load_at_start: float | None = None  # the host's 1-minute load average as the system started
    setup: str = ""  # its Endpoint's setup


@dataclass(frozen=True)
class Settle:
    """Before each system starts, wait until the host's 1-minute load average is below `max_load` (what
    the system before it, or other work, left), at most `timeout_s`; `max_load` 0 = do not wait. Each
    server then starts on a host as quiet as the last one did, and `sluice up`'s engine threads (which
    follow the load average, sluice/plan.py) see the host as idle when it is."""

    max_load: float = 0.0
    timeout_s: float = 300.0
    poll_s: float = 5.0
    load: Callable[[], float] = host_load
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def __call__(self, name: str) -> float:
        """Waits as above and returns the load average when the wait ends (announced on stderr when there
        was a wait)."""
        start = self.clock()
        first = load = self.load()
        while self.max_load > 0 and load >= self.max_load and self.clock() - start < self.timeout_s:
            self.sleep(self.poll_s)
            load = self.load()
        if load != first or load >= self.max_load > 0:
            waited = self.clock() - start
            print(f"{name}: host load {first:.2f} -> {load:.2f} after {waited:.0f} s", file=sys.stderr)
        return load


@contextmanager
def stack_endpoint(model: str, engine_flags: Sequence[str] = (), **options: Any) -> Iterator[Endpoint]:
    """The whole sluice pipeline on `model` (`options`: other StackOptions fields), for the context's life."""
    with Stack(StackOptions(model, engine_flags=tuple(engine_flags), **options)) as stack:
        yield Endpoint(stack.openai_url, None, stack.cpu_seconds, stack.metrics_urls, stack.setup)


def sweep(
    systems: Mapping[str, Opener],
    points: Sequence[P],
    measure: Callable[[str, Endpoint, P, int], R],
    bar: tqdm | None = None,
    settle: Settle | None = None,
) -> dict[str, SystemRun[R]]:
    """Starts each system in turn and calls `measure(system, endpoint, point, index)` for every point on it
    (index 0 first: the place to warm up). A start-up failure (RuntimeError, OSError) is recorded in the
    system's run; `bar` advances by one per point, skipped ones included. `settle` (default: no wait) runs
    before each start; the load average it returns is the run's `load_at_start`."""
    runs: dict[str, SystemRun[R]] = {}
    bar = bar or tqdm(disable=True)
    settle = settle or Settle()
    for name, opener in systems.items():
        run = runs[name] = SystemRun(name)
        run.load_at_start = settle(name)
        try:
            with opener() as endpoint:
                run.setup = endpoint.setup
                for k, point in enumerate(points):
                    bar.set_postfix_str(f"{name} @ {point}")
                    run.points.append(measure(name, endpoint, point, k))
                    bar.update()
        except (RuntimeError, OSError) as exc:
            run.error = str(exc)
            bar.update(len(points) - len(run.points))
    return runs


def serve_load(endpoint: Endpoint, requests: Sequence[BenchRequest], **config: Any) -> ServeResult:
    """One run of the load generator's OpenAI completions against `endpoint` (`config`: other ServeConfig
    fields)."""
    settings = ServeConfig(api="openai", url=endpoint.url, model=endpoint.model, **config)
    return uvloop.run(run_serve(settings, requests))


def cpu_used(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each process spent between two readings of `Endpoint.cpu_seconds`."""
    return {name: after[name] - before.get(name, 0.0) for name in after}


def scrape_metrics(url: str, timeout_s: float = 5.0) -> Samples:
    """Every sample a Prometheus endpoint serves now: (sample name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def counter(samples: Samples, name: str) -> float:
    """The sum of a counter's samples over all label sets (0 when absent)."""
    return sum(v for (sample, _), v in samples.items() if sample in (name, f"{name}_total"))


def add_sweep_flags(parser: argparse.ArgumentParser, requests: int, *flags: str, **helps: str) -> None:
    """The flags every sweep has (--model, --num-requests with default `requests`, --seed, --engine-flags,
    --json, --no-progress), then the shared `flags` asked for ("repeat")."""
    add_flags(parser, "model", "seed")
    about = helps.pop("num_requests", f"requests per point (default {requests})")
    parser.add_argument("--num-requests", type=positive_int, default=requests, metavar="N", help=about)
    add_flags(parser, "engine-flags", "json", "no-progress", *flags, **helps)


def model_and_flags(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The model directory every system serves (the embedded model when none is given) and the engine
    flags as a list."""
    return resolve_model(str(args.model or "")), shlex.split(args.engine_flags)


def sweep_meta(name: str, argv: Sequence[str], model: str, **more: Any) -> dict[str, Any]:
    """The run's metadata (common.run_meta), the model and `more`."""
    return {**run_meta([name, *argv]), "model": model, **more}


PRESETS = {  # preset → the module whose main(argv) runs it
    "compare": "sluice.bench.compare",
    "pipeline": "sluice.bench.pipeline",
    "routing": "sluice.bench.routing",
    "peers": "sluice.bench.peers",
}


def main(argv: list[str], prog: str = "sluice bench sweep") -> int:
    """`sluice bench sweep PRESET [FLAGS]`: hands FLAGS to the preset (`PRESET --help` lists them); each
    preset names itself `sluice bench PRESET` in its usage line and recorded command."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("preset", choices=sorted(PRESETS), help="what to sweep (PRESET --help: its flags)")
    args, rest = parser.parse_known_args(argv[:1])
    return int(importlib.import_module(PRESETS[args.preset]).main([*rest, *argv[1:]]) or 0)
