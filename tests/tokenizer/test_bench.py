"""`sluice bench tokenizer` runs end to end on a small grid and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from sluice.bench import tokenizer as bench


def test_bench_runs_and_writes_json(model_dir: Path, tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "tok.json"
    assert (
        bench.main(
            [
                "--model",
                str(model_dir),
                "--concurrency",
                "1,4",
                "--lengths",
                "16",
                "--seconds",
                "0.2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert [(c["length"], c["concurrency"]) for c in cells] == [(16, 1), (16, 4)]
    for c in cells:
        assert c["service_tokens_per_s"] > 0 and c["inprocess_tokens_per_s"] > 0
        assert abs(c["ratio"] - c["service_tokens_per_s"] / c["inprocess_tokens_per_s"]) < 1e-9
    assert data["target"]["ratio"] is None  # 1024 x 64 not in this grid
