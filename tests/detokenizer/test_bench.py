"""`sluice bench detokenizer` runs end to end on a small grid (checking every streamed text against
the full decode) and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from sluice.bench import detokenizer as bench


def test_bench_runs_and_writes_json(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "detok.json"
    assert (
        bench.main(["--model", str(model_dir), "--concurrency", "1,8", "--lengths", "16", "--json", str(out)])
        == 0
    )
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert [(c["length"], c["concurrency"]) for c in cells] == [(16, 1), (16, 8)]
    for c in cells:
        assert c["mux_tokens_per_s"] > 0 and c["per_request_tokens_per_s"] > 0
        assert c["inprocess_tokens_per_s"] > 0
