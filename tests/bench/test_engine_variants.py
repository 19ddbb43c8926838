"""`sluice bench engine [throughput|latency|perplexity]`: the variants of the engine command over one driver.
The perplexity variant runs the perplexity stage of the latency benchmark alone (same JSON shape, no timed
runs); latency is `sluice bench latency` under the engine command; throughput is the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench import engine
from sluice.cli import main as cli_main


def test_perplexity_variant_scores_only_perplexity(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    argv = [
        "perplexity", "--device", "cpu", "--no-progress", "--threads", "1", "--model", str(tiny_model_dir),
        "--quality-model", str(tiny_model_dir), "--variants", "off,int8", "--perplexity-tokens", "200",
        "--json", str(out),
    ]  # fmt: skip
    assert engine.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["cells"] == [] and doc["partial"] is False
    quality = {q["variant"]: q for q in doc["quality"]}
    assert set(quality) == {"none", "int8"} and quality["none"]["tokens"] == 199
    assert quality["none"]["perplexity"] > 1 and abs(quality["int8"]["ratio_to_none"] - 1) < 0.1
    assert list(doc["stage_s"]) == ["perplexity"] and doc["command"].startswith(
        "sluice bench engine perplexity "
    )
    printed = capsys.readouterr().out
    assert "perplexity on held-out text" in printed and "b1 dec tok/s" not in printed


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["bench", "engine", "--help"], "usage: sluice bench engine "),
        (["bench", "engine", "throughput", "--help"], "usage: sluice bench engine "),
        (["bench", "engine", "latency", "--help"], "usage: sluice bench engine latency "),
        (["bench", "engine", "perplexity", "--help"], "usage: sluice bench engine perplexity "),
        (["bench", "latency", "--help"], "usage: sluice bench latency "),
        (["bench", "sweep", "compare", "--help"], "usage: sluice bench compare "),
        (["bench", "sweep", "pipeline", "--help"], "usage: sluice bench pipeline "),
        (["bench", "sweep", "routing", "--help"], "usage: sluice bench routing "),
    ],
)
def test_every_variant_and_preset_has_its_help(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_the_latency_variant_has_the_latency_flags() -> None:
    ours = {a.dest for a in engine.build_parser("latency", "sluice bench engine latency")._actions}
    assert ours == {a.dest for a in engine.build_parser("latency", "sluice bench latency")._actions}
    assert {"variants", "perplexity_tokens", "quality_model"} <= ours
    assert engine.build_parser("perplexity").description == engine.DESCRIPTIONS["perplexity"]
