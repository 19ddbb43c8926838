"""`sluice bench latency`: its workloads differ as they claim on the embedded chat model, and a `--quick` run
of every CPU variant writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sluice.bench import latency
from sluice.bench.engine_driver import release_memory
from sluice.bench.engine_methods import BenchContext
from sluice.bench.latency import (
    build_engine,
    greedy_continuations,
    make_encoder,
    mean_copy_fraction,
    non_repetitive,
    repetitive,
    run_requests,
)


def test_repetitive_outputs_copy_the_prompt_and_non_repetitive_ones_do_not() -> None:
    """On the embedded chat model (built once and cached on first use), with the plain engine: the
    repetitive workload's outputs copy 4-token spans of their prompts for most of their tokens, the
    non-repetitive one's for few."""
    from services.common.models import resolve_model_dir

    model_dir = resolve_model_dir("")
    spec = BenchContext(model_dir, "cpu", "float32", threads=1)
    encode = make_encoder(model_dir, 4096)
    n, length = 8, 64
    works = [
        repetitive(encode, lambda p, k: greedy_continuations(spec, p, k, n), n, length, seed=0),
        non_repetitive(encode, n, length, seed=0),
    ]
    engine = build_engine(spec, "off", [len(r.prompt) + length for w in works for r in w.requests], n)
    copied = []
    for work in works:
        outputs = run_requests(engine, work, "cpu", lambda _: None, at_once=True).outputs
        assert [len(o) for o in outputs] == [length] * n
        prompts = [r.prompt for r in work.requests]
        copied.append(mean_copy_fraction(prompts, outputs))
    del engine
    release_memory("cpu")
    assert copied[0] >= 0.5 and copied[1] <= 0.35, copied
    assert copied[0] - copied[1] >= 0.3


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[int, dict[str, Any]]:
    """One `--quick` run of off, ngram and int8 on the untrained test model, and perplexity on the same test
    model."""
    out = tmp_path_factory.mktemp("latency")
    model = str(tiny_model_dir)
    argv = [
        "--quick", "--device", "cpu", "--no-progress", "--threads", "1", "--model", model,
        "--quality-model", model, "--variants", "off,ngram,int8",
        "--perplexity-tokens", "300", "--json", str(out / "l.json"),
    ]  # fmt: skip
    rc = latency.main(argv)
    return rc, json.loads((out / "l.json").read_text())


def test_quick_run_measures_every_variant_and_workload(quick_run: tuple[int, dict[str, Any]]) -> None:
    rc, doc = quick_run
    assert rc == 0, doc["errors"]
    assert doc["bench"] == "latency" and doc["partial"] is False and doc["errors"] == {}
    cells = {(c["variant"], c["workload"]): c for c in doc["cells"]}
    assert set(cells) == {(v, w) for v in ("off", "ngram", "int8") for w in ("repetitive", "non-repetitive")}
    for cell in cells.values():
        b1, many = cell["batch1"], cell["concurrent"]
        assert b1["requests"] == 2 and b1["output_tokens"] == 2 * 12 and b1["decode_tok_s"] > 0
        assert many["requests"] == 4 and many["output_tokens"] == 4 * 12 and many["output_tok_s"] > 0
        assert many["ttft_p50_s"] <= many["ttft_p99_s"]
        assert 0.0 <= cell["copy_fraction"] <= 1.0
    assert cells["off", "repetitive"]["batch1_ratio_to_off"] == 1.0
    assert "spec_acceptance_rate" in cells["ngram", "repetitive"]["batch1"]["spec"]
    quality = {q["variant"]: q for q in doc["quality"]}
    assert set(quality) == {"none", "int8"} and quality["none"]["tokens"] == 299
    assert abs(quality["int8"]["ratio_to_none"] - 1) < 0.1
    assert "shape" not in doc and "targets" not in doc  # larger shapes: scripts/gpu_latency_extras.py


def test_fp8_is_skipped_on_cpu_and_bad_arguments_exit_2(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        latency.main(["--variants", "off,nope"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        latency.main(["--quick", "--concurrency", "0"])
    assert exit_info.value.code == 2
    argv = [
        "--quick", "--device", "cpu", "--no-progress", "--threads", "1", "--model", str(tiny_model_dir),
        "--variants", "off,fp8", "--workloads", "non-repetitive", "--perplexity-tokens", "0",
        "--json", str(tmp_path / "l.json"),
    ]  # fmt: skip
    assert latency.main(argv) == 0
    doc = json.loads((tmp_path / "l.json").read_text())
    assert doc["errors"] == {"fp8": "skipped: CUDA only"}
    assert [(c["variant"], c["workload"]) for c in doc["cells"]] == [("off", "non-repetitive")]
