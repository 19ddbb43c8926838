"""`sluice bench sweep peers` with fake peers: start scripts in the real ones' layout (MODEL_DIR PORT, a build
under PEERS_DIR) that start a small fake OpenAI server. Each server runs alone in its turn and is stopped
before the next starts; the concurrent run sends every request at once and the batch-1 run one at a time,
under the model name the server lists, with ignore_eos; a peer without its build or script gets a "not
installed at PATH" row (never left out); one that fails to start gets a row with its error and exit 1."""

from __future__ import annotations

import contextlib
import json
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.bench import peers
from sluice.bench import sweep as sw
from sluice.bench.report import format_peers
from sluice.cli import main as cli_main

FAKES = Path(__file__).parent / "fake_peers"
LOAD = ["--num-requests", "6", "--batch1-requests", "3", "--output-len", "2,5", "--prompt-words", "3,9"]
LOAD += ["--settle-load", "0"]  # a test host is never quiet: start each server at once


def _install(peers_dir: Path, *names: str) -> None:
    """Fake builds of the peers named, where the real start scripts look for them."""
    for name in names:
        build = peers_dir / peers.PEERS[name][2]
        build.parent.mkdir(parents=True, exist_ok=True)
        build.write_text("#!/bin/sh\n")
        build.chmod(build.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "events.txt"
    monkeypatch.setenv("FAKE_EVENTS", str(path))
    monkeypatch.setenv("FAKE_PYTHON", sys.executable)
    return path


def _run(tmp_path: Path, peers_dir: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "peers.json"
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")  # the fakes never read it
    flags = ["--servers", "vllm,llama.cpp", "--peers-dir", str(peers_dir), "--peer-scripts", str(FAKES)]
    flags += [
        "--model",
        str(tmp_path / "model"),
        "--json",
        str(out),
        "--no-progress",
        "--startup-timeout",
        "60",
    ]
    code = peers.main([*flags, *LOAD, *extra])
    return code, json.loads(out.read_text())


def test_each_peer_alone_in_turn_with_the_same_load(
    tmp_path: Path, events: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peers_dir = tmp_path / "peers"
    _install(peers_dir, "vllm", "llama.cpp")
    code, doc = _run(tmp_path, peers_dir)
    assert code == 0
    lines = events.read_text().splitlines()
    starts_stops = [line for line in lines if not line.startswith("request")]
    assert starts_stops == [
        "start vllm",
        "stop vllm",
        "args llama.cpp ctx=49152 -kvu",
        "start llama.cpp",
        "stop llama.cpp",
    ]
    for name in ("vllm", "llama.cpp"):
        requests = [line.split() for line in lines if line.startswith(f"request {name} ")]
        # warm-up, the concurrent run, then the batch-1 run one at a time
        assert len(requests) == peers.WARMUP_REQUESTS + 6 + 3
        assert all(r[3] == str(tmp_path / "model") and r[4] == "True" for r in requests)
        assert [int(r[2]) for r in requests[-3:]] == [1, 1, 1]
        assert max(int(r[2]) for r in requests[peers.WARMUP_REQUESTS : -3]) > 1
        server = doc["servers"][name]
        assert server["error"] is None and server["not_installed"] is False
        assert server["concurrent"]["completed"] == 6 and server["batch1"]["completed"] == 3
        assert server["streams_tok_s"] == server["concurrent"]["output_throughput"] > 0
        assert server["batch1_tok_s"] == server["batch1"]["output_throughput"] > 0
        assert server["ttft_p99_ms"] == server["concurrent"]["ttft_ms"]["p99"]
        assert server["batch1_itl_p50_ms"] == server["batch1"]["itl_ms"]["p50"]
        assert server["load_at_start"] >= 0.0
    table = capsys.readouterr().out.split("\n\n")[-1]
    header = table.splitlines()[0]
    for column in ("server", "6 streams tok/s", "p99 TTFT", "batch-1 tok/s", "batch-1 ITL p50", "load"):
        assert column in header
    assert [row.split("  ")[0] for row in table.splitlines()[2:4]] == ["vLLM CPU", "llama.cpp server"]


def test_a_peer_not_installed_gets_its_row(
    tmp_path: Path, events: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peers_dir = tmp_path / "peers"
    _install(peers_dir, "vllm")
    code, doc = _run(tmp_path, peers_dir)
    assert code == 0
    missing = peers_dir / peers.PEERS["llama.cpp"][2]
    assert doc["servers"]["llama.cpp"]["error"] == f"not installed at {missing}"
    assert doc["servers"]["llama.cpp"]["not_installed"] is True
    assert doc["servers"]["llama.cpp"]["streams_tok_s"] is None
    assert doc["servers"]["vllm"]["streams_tok_s"] > 0
    assert "llama.cpp" not in events.read_text()
    out = capsys.readouterr().out
    assert any(
        line.startswith("llama.cpp server") and f"not installed at {missing}" in line
        for line in out.splitlines()
    )


def test_a_missing_script_is_not_installed_either(tmp_path: Path, events: Path) -> None:
    peers_dir = tmp_path / "peers"
    _install(peers_dir, "vllm", "llama.cpp")
    gone = tmp_path / "nowhere" / "start-vllm.sh"
    code, doc = _run(tmp_path, peers_dir, "--vllm-script", str(gone))
    assert code == 0
    assert doc["servers"]["vllm"]["error"] == f"not installed at {gone}"
    assert doc["servers"]["llama.cpp"]["streams_tok_s"] > 0
    assert "args llama.cpp ctx=49152 -kvu" in events.read_text()


def test_a_peer_that_fails_to_start_is_reported(tmp_path: Path, events: Path) -> None:
    peers_dir = tmp_path / "peers"
    _install(peers_dir, "vllm", "llama.cpp")
    extra = [
        "--vllm-script",
        str(FAKES / "start-broken.sh"),
        "--llamacpp-args",
        "-np 4",
        "--llamacpp-ctx",
        "0",
    ]
    code, doc = _run(tmp_path, peers_dir, *extra)
    assert code == 1
    error = doc["servers"]["vllm"]["error"]
    assert "exited with code 3" in error and "broken peer: cannot load" in error
    assert doc["servers"]["vllm"]["not_installed"] is False
    assert doc["servers"]["llama.cpp"]["streams_tok_s"] > 0
    assert "args llama.cpp ctx= -np 4" in events.read_text()


def test_defaults_follow_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PEERS_DIR", raising=False)
    assert peers.default_peers_dir() == Path("/tmp/peers")
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    monkeypatch.setenv("PEER_SCRIPTS", str(FAKES))
    args = peers.build_parser().parse_args([])
    assert args.peers_dir == tmp_path and args.peer_scripts == FAKES
    assert args.servers == ("sluice", "vllm", "llama.cpp") and args.num_requests == 64
    assert args.batch1_requests == 8 and args.prompt_words == (12, 200) and args.output_len == (8, 256)
    monkeypatch.delenv("PEER_SCRIPTS")
    assert peers.default_scripts_dir().parts[-2:] == ("shared", "peers")
    layout = peers.peer_layout(args, "llama.cpp")
    assert layout.script == FAKES / "start-llamacpp.sh"
    assert layout.build == tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"


def test_the_sweep_command_runs_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "sweep", "peers", "--help"])
    assert exit_.value.code == 0
    assert "usage: sluice bench sweep peers" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "sweep", "nonesuch"])
    assert exit_.value.code == 2


def test_sluice_and_a_peer_on_one_model_directory(tiny_model_dir: Path, tmp_path: Path, events: Path) -> None:
    """sluice's whole pipeline and a (fake) peer started on the same directory; the peer lists that
    directory as its model, as the real start scripts do."""
    peers_dir = tmp_path / "peers"
    _install(peers_dir, "vllm")
    out = tmp_path / "peers.json"
    flags = ["--servers", "sluice,vllm", "--peers-dir", str(peers_dir), "--peer-scripts", str(FAKES)]
    flags += ["--model", str(tiny_model_dir), "--json", str(out), "--no-progress"]
    assert peers.main([*flags, *LOAD]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["servers"]) == ["sluice", "vllm"]
    sluice = doc["servers"]["sluice"]
    assert sluice["error"] is None and sluice["concurrent"]["completed"] == 6
    assert sluice["batch1"]["completed"] == 3 and sluice["batch1_tok_s"] > 0
    # ignore_eos: every request produced exactly the tokens it asked for
    assert (
        sluice["concurrent"]["total_output_tokens"]
        == doc["servers"]["vllm"]["concurrent"]["total_output_tokens"]
    )
    requests = [line.split() for line in events.read_text().splitlines() if line.startswith("request")]
    assert {r[3] for r in requests} == {str(tiny_model_dir.resolve())}


class _Host:
    """A host whose load average falls by `step` at each poll; the clock moves on as the sweep sleeps."""

    def __init__(self, load: float, step: float) -> None:
        self.value, self.step, self.now, self.polls = load, step, 0.0, 0

    def load(self) -> float:
        self.polls += 1
        value, self.value = self.value, max(0.0, self.value - self.step)
        return value

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _settle(host: _Host, max_load: float, timeout_s: float = 300.0) -> sw.Settle:
    return sw.Settle(max_load, timeout_s, 5.0, host.load, host.sleep, lambda: host.now)


def test_each_server_starts_once_the_load_has_settled(capsys: pytest.CaptureFixture[str]) -> None:
    host = _Host(2.0, 0.5)  # 2.0, 1.5, 1.0, 0.5, 0.0
    assert _settle(host, 0.6)("vllm") == 0.5 and host.now == 15.0 and host.polls == 4
    assert "vllm: host load 2.00 -> 0.50 after 15 s" in capsys.readouterr().err
    host = _Host(3.0, 0.0)  # never settles: starts after the timeout with the load it has
    assert _settle(host, 0.5, timeout_s=20.0)("sluice") == 3.0 and host.now == 20.0
    assert "sluice: host load 3.00 -> 3.00 after 20 s" in capsys.readouterr().err
    host = _Host(3.0, 1.0)  # 0 = no wait: the load is read once and recorded
    assert _settle(host, 0.0)("llama.cpp") == 3.0 and host.polls == 1 and host.now == 0.0
    assert capsys.readouterr().err == ""


def test_the_load_at_each_start_is_recorded_and_shown(capsys: pytest.CaptureFixture[str]) -> None:
    host = _Host(1.0, 0.25)

    @contextlib.contextmanager
    def system() -> Iterator[sw.Endpoint]:
        yield sw.Endpoint("http://127.0.0.1:1/v1", None, dict, setup="1 engine, 2 threads")

    runs = sw.sweep({"a": system, "b": system}, [0], lambda *_: None, settle=_settle(host, 0.0))
    assert [run.load_at_start for run in runs.values()] == [1.0, 0.75]
    assert [run.setup for run in runs.values()] == ["1 engine, 2 threads"] * 2
    runs["a"].error, runs["b"].error = "not installed at /x", "failed"
    table = format_peers(runs, 6, {"a": "A", "b": "B"})
    rows = [re.split(r"\s{2,}", line) for line in table.splitlines()[2:]]
    assert [row[5] for row in rows] == ["1.00", "0.75"] and rows[1][6] == "failed"
    summary = {"output_throughput": 10.0, "completed": 4, "failed": 2}
    summary |= {"ttft_ms": {"p99": 5.0}, "itl_ms": {"p50": 1.0}}
    runs["a"].error, runs["a"].points = None, [peers.PeerFigures(summary, summary)]
    lines = format_peers(runs, 6, {"a": "A", "b": "B"}).splitlines()
    assert re.split(r"\s{2,}", lines[2])[6] == "1 engine, 2 threads; 4 requests failed"


def test_up_flags_reach_sluices_stack_and_its_label() -> None:
    """`--up-flags` go to `sluice up` for sluice's row only, and the row's label names them."""
    args = peers.build_parser().parse_args(
        ["--servers", "sluice", "--up-flags", "--engines 2 --engine-threads 1"]
    )
    opener = peers.openers(args, "/m", [])["sluice"]
    assert opener.keywords == {"engines": 0, "up_flags": ("--engines", "2", "--engine-threads", "1")}  # type: ignore[attr-defined]
    assert peers.label("sluice", args.up_flags) == "sluice (`sluice up --engines 2 --engine-threads 1`)"
    assert peers.label("sluice") == "sluice (`sluice up`)"
