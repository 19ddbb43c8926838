"""`sluice up --engines auto` (the default): how many engines a host gets, and their threads."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice import plan
from sluice.launcher import parse_args
from sluice.plan import plan_children, policy_line

GiB = 1 << 30


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, object]:
    """A 4-core idle CPU host with 64 GiB available and no GPU; the test changes what it needs."""
    state: dict[str, object] = {"cores": {0, 1, 2, 3}, "load": 0.1, "memory": 64 * GiB}
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid: state["cores"], raising=False)
    monkeypatch.setattr(plan.os, "getloadavg", lambda: (state["load"], 0.0, 0.0))
    monkeypatch.setattr(plan, "available_memory", lambda: state["memory"])
    monkeypatch.setattr(plan, "GPU_DEVICE_FILE", tmp_path / "no-nvidiactl")
    return state


def _model(tmp_path: Path, weight_bytes: int) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)  # sparse: its size is what counts
    return str(model)


def _engine_threads(args) -> list[int]:  # type: ignore[no-untyped-def]
    engines = [c for c in plan_children(args, "/m", load=args.start_load) if c.kind == "engine"]
    return [int(c.flags[c.flags.index("--threads") + 1]) for c in engines]


def test_a_cpu_host_gets_one_single_thread_engine_per_core(host: dict[str, object]) -> None:
    args = parse_args([])
    assert args.engines == 4 and _engine_threads(args) == [1, 1, 1, 1]
    line = policy_line(args, args.start_load)
    assert "1 torch thread(s) each" in line and "4 engines (one per usable core)" in line


def test_a_busy_host_leaves_a_core(host: dict[str, object]) -> None:
    host["load"] = 2.5
    args = parse_args([])
    assert args.engines == 3 and _engine_threads(args) == [1, 1, 1]
    assert "load average 2.50 >= 1" in args.engines_why
    host["cores"] = {0}
    assert parse_args([]).engines == 1


def test_engines_fit_in_memory(host: dict[str, object], tmp_path: Path) -> None:
    """An engine counts as twice its weights plus ENGINE_OVERHEAD_BYTES; at most MEMORY_SHARE of the
    available memory is planned."""
    model = _model(tmp_path, 32 << 20)  # 1.5625 GiB an engine
    host["memory"] = 5 * GiB  # 4 GiB usable: two fit
    args = parse_args(["--model", model])
    assert args.engines == 2 and _engine_threads(args) == [2, 2]
    assert "as many as fit in memory, 1.6 GiB each" in args.engines_why
    host["memory"] = GiB // 2  # none fits: still one
    assert parse_args(["--model", model]).engines == 1


def test_a_larger_model_gets_one_engine_on_every_core(host: dict[str, object], tmp_path: Path) -> None:
    model = _model(tmp_path, plan.SMALL_MODEL_BYTES + 1)
    args = parse_args(["--model", model])
    assert args.engines == 1 and _engine_threads(args) == [4]
    assert "one: 64 MB of weights, over 64 MB" in args.engines_why


def test_a_gpu_or_an_unresolved_hub_id_gets_one(host: dict[str, object], tmp_path: Path) -> None:
    assert parse_args(["--device", "cuda"]).engines == 1
    (tmp_path / "nvidiactl").touch()
    plan.GPU_DEVICE_FILE = tmp_path / "nvidiactl"  # restored by the fixture's monkeypatch
    assert parse_args([]).engines == 1
    assert parse_args(["--device", "cpu"]).engines == 4  # a CPU engine asked for on a GPU host
    hub = parse_args(["--device", "cpu", "--model", "Qwen/Qwen3-0.6B"])
    assert hub.engines == 1 and "unknown before it is resolved" in hub.engines_why


def test_a_count_given_stays_and_threads_share_the_cores(host: dict[str, object]) -> None:
    args = parse_args(["--engines", "2"])
    assert args.engines == 2 and args.engines_why == "--engines" and _engine_threads(args) == [2, 2]
    assert _engine_threads(parse_args(["--engines", "1"])) == [4]
    assert _engine_threads(parse_args(["--engines", "3", "--engine-threads", "2"])) == [2, 2, 2]
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit):
            parse_args(["--engines", bad])
