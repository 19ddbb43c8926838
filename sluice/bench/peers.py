"""`sluice bench sweep peers`: sluice and the servers a CPU user would pick instead — vLLM's CPU server and
llama.cpp's `llama-server`, started by the start scripts of the peers folder (`start-vllm.sh`,
`start-llamacpp.sh`: MODEL_DIR PORT) on what `setup.sh` built under PEERS_DIR — each started alone in its turn
on the same model directory and driven by the same load: N concurrent streaming completions (default 64,
prompts 12-200 words, outputs 8-256 tokens, fixed lengths), then M requests one at a time (default 8). Each
server starts once the host's load average has settled (--settle-load). Prints one row per server: output
tok/s and p99 TTFT of the concurrent run, tok/s and ITL p50 of the batch-1 run, the load at its start. A peer
whose build or start script is missing gets a row "not installed at PATH"; one that fails to start or to serve
a row with its error. Exit status 0 when every installed server was measured, 1 when one failed, 2 on bad
arguments. Tokens are counted from the servers' usage (llama.cpp sends an empty last chunk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from sluice.bench import sweep as sw
from sluice.bench.common import int_range, names, positive_float, positive_int
from sluice.bench.report import format_peers, peers_json, write_json
from sluice.bench.serve_data import BenchRequest, uniform_requests
from sluice.bench.stack import POLL_S, process_cpu_s, tail
from sluice.ports import free_port

SLUICE = "sluice"
# name → (label in the table, start script, the build the script needs under PEERS_DIR)
PEERS = {
    "vllm": ("vLLM CPU", "start-vllm.sh", "vllm-venv/bin/python"),
    "llama.cpp": ("llama.cpp server", "start-llamacpp.sh", "llama.cpp/build/bin/llama-server"),
}
SERVERS = (SLUICE, *PEERS)
WARMUP_REQUESTS = 4  # sent and awaited before the concurrent run (first compiles, caches)
REQUEST_TIMEOUT_S = 900.0
NOT_INSTALLED = "not installed at"
SETTLE_LOAD = 0.5  # load average below which the next server starts (--settle-load)
SETTLE_TIMEOUT_S = 300.0


def default_peers_dir() -> Path:
    return Path(os.environ.get("PEERS_DIR") or "/tmp/peers")


def default_scripts_dir() -> Path:
    """$PEER_SCRIPTS, else the first `shared/peers` folder beside the repository's root or one level up (a
    worktree of it), where the start scripts live; the first candidate when neither exists."""
    if os.environ.get("PEER_SCRIPTS"):
        return Path(os.environ["PEER_SCRIPTS"])
    root = Path(__file__).resolve().parents[2]
    candidates = [root.parent / "shared" / "peers", root.parent.parent / "shared" / "peers"]
    return next((c for c in candidates if c.is_dir()), candidates[0])


@dataclass(frozen=True)
class PeerLayout:
    """Where a peer's start script and build are; `missing` names the first that is not there."""

    script: Path
    build: Path

    @property
    def missing(self) -> Path | None:
        if not self.script.is_file():
            return self.script
        if not os.access(self.build, os.X_OK):
            return self.build
        return None


def peer_layout(args: argparse.Namespace, name: str) -> PeerLayout:
    """The layout of peer `name` by the flags (a script flag overrides the scripts folder)."""
    _, script, build = PEERS[name]
    override = getattr(args, f"{name.replace('.', '')}_script")
    return PeerLayout(override or args.peer_scripts / script, args.peers_dir / build)


class ScriptServer:
    """`bash SCRIPT MODEL_DIR PORT [extra]` in its own process group (PEERS_DIR in its environment), its
    output in a file; ready once `GET /v1/models` answers, whose first model is the one requests name.
    Leaving stops the whole group (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        name: str,
        script: Path,
        model: str,
        peers_dir: Path,
        extra: Sequence[str],
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.script, self.model = name, script, model
        self.port = free_port()
        self.openai_url = f"http://127.0.0.1:{self.port}/v1"
        self.command = ["bash", str(script), model, str(self.port), *extra]
        self.env = {**os.environ, **(env or {}), "PEERS_DIR": str(peers_dir), "PYTHONUNBUFFERED": "1"}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None

    def __enter__(self) -> ScriptServer:
        fd, log = _log_file(self.name)
        self.log = log
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None and self.log is not None
        deadline = time.monotonic() + self.timeout_s
        while (listed := _first_model(self.openai_url)) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {tail(self.log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer in {self.timeout_s:g} s: {tail(self.log)}")
            time.sleep(POLL_S)
        self.model = listed

    def cpu_seconds(self) -> dict[str, float]:
        return {self.name: process_cpu_s(self.proc.pid)} if self.proc is not None else {}

    def __exit__(self, *exc_info: object) -> None:
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None
        if self.log is not None:
            self.log.unlink(missing_ok=True)
            self.log = None


def _log_file(name: str) -> tuple[int, Path]:
    fd, path = tempfile.mkstemp(prefix=f"sluice-peer-{name}-", suffix=".log")
    return fd, Path(path)


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM to the process group of `proc`, SIGKILL after `grace_s`; then SIGKILL to whatever of the
    group outlived its leader (a server's workers)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _first_model(url: str) -> str | None:
    """The first model `GET {url}/models` lists, or None while nothing answers."""
    errors = (OSError, TimeoutError, ValueError, KeyError, IndexError)
    with contextlib.suppress(*errors), urllib.request.urlopen(f"{url}/models", timeout=2.0) as resp:
        return str(json.load(resp)["data"][0]["id"])
    return None


@contextmanager
def peer_endpoint(
    name: str, layout: PeerLayout, model: str, args: argparse.Namespace
) -> Iterator[sw.Endpoint]:
    """Peer `name` started by its script on `model`, for the life of the context; RuntimeError
    "not installed at PATH" when its script or build is missing."""
    missing = layout.missing
    if missing is not None:
        raise RuntimeError(f"{NOT_INSTALLED} {missing}")
    extra = shlex.split(getattr(args, f"{name.replace('.', '')}_args"))
    env = {"LLAMACPP_CTX": str(args.llamacpp_ctx)} if name == "llama.cpp" and args.llamacpp_ctx else {}
    timeout = args.startup_timeout
    with ScriptServer(name, layout.script, model, args.peers_dir, extra, timeout, env) as server:
        yield sw.Endpoint(server.openai_url, server.model, server.cpu_seconds)


@dataclass(frozen=True)
class PeerFigures:
    """One server's two runs: the concurrent one and the batch-1 one (each ServeResult.summary())."""

    concurrent: dict[str, Any]
    batch1: dict[str, Any]

    @property
    def streams_tok_s(self) -> float | None:
        return _throughput(self.concurrent)

    @property
    def ttft_p99_ms(self) -> float | None:
        return self.concurrent["ttft_ms"]["p99"]

    @property
    def batch1_tok_s(self) -> float | None:
        return _throughput(self.batch1)

    @property
    def batch1_itl_p50_ms(self) -> float | None:
        return self.batch1["itl_ms"]["p50"]

    @property
    def failed(self) -> int:
        return int(self.concurrent["failed"]) + int(self.batch1["failed"])


def _throughput(summary: dict[str, Any]) -> float | None:
    return float(summary["output_throughput"]) if summary["completed"] else None


def measure(
    endpoint: sw.Endpoint, streams: list[BenchRequest], batch1: list[BenchRequest], progress: bool
) -> PeerFigures:
    """A warm-up, the concurrent run (all at once, fixed lengths), then the batch-1 run (one at a time)."""
    load = {"ignore_eos": True, "request_timeout_s": REQUEST_TIMEOUT_S}
    many = sw.serve_load(endpoint, streams, num_warmup=WARMUP_REQUESTS, progress=progress, **load)
    one = sw.serve_load(endpoint, batch1, max_concurrency=1, progress=progress, **load)
    return PeerFigures(many.summary(), one.summary())


def label(name: str, up_flags: str = "") -> str:
    if name in PEERS:
        return PEERS[name][0]
    return f"{SLUICE} (`sluice up{' ' + up_flags if up_flags else ''}`)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench sweep peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    about = f"comma list of {','.join(SERVERS)}, measured in this order (default: all)"
    add("--servers", type=names(SERVERS, "server"), default=SERVERS, metavar="LIST", help=about)
    add("--batch1-requests", type=positive_int, default=8, metavar="N", help="batch-1 requests (default 8)")
    add("--prompt-words", type=int_range, default=(12, 200), metavar="MIN,MAX", help="prompt words (12,200)")
    add("--output-len", type=int_range, default=(8, 256), metavar="MIN,MAX", help="output tokens (8,256)")
    about = "where setup.sh built the peers (default $PEERS_DIR, else /tmp/peers)"
    add("--peers-dir", type=Path, default=default_peers_dir(), metavar="DIR", help=about)
    about = "the folder of start-vllm.sh and start-llamacpp.sh (default $PEER_SCRIPTS, else ../shared/peers "
    about += "beside the repository)"
    add("--peer-scripts", type=Path, default=default_scripts_dir(), metavar="DIR", help=about)
    add("--vllm-script", type=Path, metavar="FILE", help="vLLM's start script (overrides --peer-scripts)")
    add("--llamacpp-script", type=Path, metavar="FILE", help="llama.cpp's start script (likewise)")
    add("--vllm-args", default="", metavar="ARGS", help='extra arguments of start-vllm.sh, e.g. "--seed 0"')
    about = "extra arguments of start-llamacpp.sh (default -kvu: the slots share one KV cache)"
    add("--llamacpp-args", default="-kvu", metavar="ARGS", help=about)
    about = "llama.cpp's whole KV context (default $LLAMACPP_CTX, else 49152: 64 slots of prompts up to "
    about += "~300 tokens and 256 out; 0 = the script's own, 256 a slot)"
    ctx = int(os.environ.get("LLAMACPP_CTX") or 49152)
    add("--llamacpp-ctx", type=int, default=ctx, metavar="TOKENS", help=about)
    about = "seconds a server may take to answer (default 900; vLLM compiles at its first start)"
    add("--startup-timeout", type=positive_float, default=900.0, metavar="S", help=about)
    about = "before each server starts, wait until the host's 1-minute load average is below LOAD (default "
    about += f"{SETTLE_LOAD:g}; 0 = start at once), so that each starts on an equally quiet host"
    add("--settle-load", type=float, default=SETTLE_LOAD, metavar="LOAD", help=about)
    about = f"at most this long (default {SETTLE_TIMEOUT_S:g})"
    add("--settle-timeout", type=positive_float, default=SETTLE_TIMEOUT_S, metavar="S", help=about)
    about = 'more `sluice up` flags for sluice\'s row, e.g. "--engines 2 --engine-threads 1"'
    add("--up-flags", default="", metavar="FLAGS", help=about)
    helps = {"num_requests": "concurrent streaming requests of the first run (default 64)"}
    sw.add_sweep_flags(parser, 64, **helps)
    return parser


def openers(args: argparse.Namespace, model: str, engine_flags: list[str]) -> dict[str, sw.Opener]:
    """Each server asked for, in order: sluice's whole pipeline, or a peer by its start script."""
    systems: dict[str, sw.Opener] = {}
    for name in args.servers:
        if name == SLUICE:
            up_flags = tuple(shlex.split(args.up_flags))  # none: `sluice up`'s defaults, --engines auto
            opener = partial(sw.stack_endpoint, model, engine_flags, engines=0, up_flags=up_flags)
            systems[name] = opener
        else:
            systems[name] = partial(peer_endpoint, name, peer_layout(args, name), model, args)
    return systems


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model, engine_flags = sw.model_and_flags(args)
    words, out = args.prompt_words, args.output_len
    streams = uniform_requests(args.num_requests, args.seed, prompt_words=words, output_len=out)
    batch1 = uniform_requests(args.batch1_requests, args.seed + 1, prompt_words=words, output_len=out)
    print(
        f"model {model}; {len(streams)} streams at once, then {len(batch1)} one at a time; prompts "
        f"{words[0]}-{words[1]} words, outputs {out[0]}-{out[1]} tokens; servers {','.join(args.servers)}"
    )
    progress = not args.no_progress
    settle = sw.Settle(args.settle_load, args.settle_timeout)
    runs = sw.sweep(
        openers(args, model, engine_flags),
        [0],
        lambda _s, e, _p, _k: measure(e, streams, batch1, progress),
        settle=settle,
    )
    labels = {name: label(name, args.up_flags) for name in runs}
    print("\n" + format_peers(runs, len(streams), labels))
    meta = sw.sweep_meta("sweep peers", argv, model, peers_dir=str(args.peers_dir))
    write_json(args.json, peers_json(runs, meta, labels, NOT_INSTALLED), announce=True)
    failed = [
        r for r in runs.values() if (r.error and not r.error.startswith(NOT_INSTALLED)) or _has_failures(r)
    ]
    return 1 if failed else 0


def _has_failures(run: sw.SystemRun) -> bool:
    return any(p.failed or p.streams_tok_s is None for p in run.points)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
