"""Service processes for the observability tests: `sluice serve NAME` on a free port, its output
collected, stopped with SIGTERM (a graceful drain, which also flushes its spans)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on port (\d+)")
START_DEADLINE_S = 120.0


def otel_env(endpoint: str) -> dict[str, str]:
    """The environment of a traced child: export to `endpoint` over OTLP/gRPC, flush within 100 ms."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {
        **env,
        "PYTHONUNBUFFERED": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


@dataclass
class Service:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    port: int = 0
    bound: threading.Event = field(default_factory=threading.Event)

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)


def _pump(service: Service) -> None:
    assert service.proc.stdout is not None
    for line in service.proc.stdout:
        service.lines.append(line)
        match = LISTENING.search(line)
        if match and not service.bound.is_set():
            service.port = int(match.group(1))
            service.bound.set()
    service.bound.set()


def start_service(name: str, model_dir: Path, env: Mapping[str, str], *flags: str) -> Service:
    """`sluice serve NAME --model DIR --port 0 FLAGS`; returns once it is serving (its port known)."""
    cmd = [
        sys.executable,
        "-m",
        "sluice.cli",
        "serve",
        name,
        "--model",
        str(model_dir),
        "--port",
        "0",
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env))
    service = Service(proc)
    threading.Thread(target=_pump, args=(service,), daemon=True).start()
    if not service.bound.wait(START_DEADLINE_S) or not service.port:
        service.stop()
        raise RuntimeError(f"{name} did not start:\n{service.output()}")
    return service


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {sample name with labels: value} (e.g. 'sluice_requests_total{finish_reason="stop"}')."""
    return parse_metrics(httpx.get(url, timeout=10.0).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text as {sample name with labels: value}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
