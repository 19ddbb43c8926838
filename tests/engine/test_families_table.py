"""`sluice models` and the README's table of model families come from the engine's own check."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from services.engine.executor import families
from services.engine.executor.families import FAMILIES, markdown_table, verdicts
from sluice import cli

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- sluice models --markdown -->\n", "<!-- end sluice models -->"


def test_the_readme_table_is_the_codes() -> None:
    text = README.read_text(encoding="utf-8")
    assert START in text and END in text
    table = text.split(START, 1)[1].split(END, 1)[0]
    assert table == markdown_table(verdicts()), "regenerate it: sluice models --markdown"


def test_verdicts_follow_the_engine_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def check(config: transformers.PretrainedConfig) -> None:
        if config.model_type == "gemma2":
            raise ValueError("soft-capping is missing")

    monkeypatch.setattr(families, "check_config", check)
    by_type = {v.family.model_type: v for v in verdicts()}
    assert set(by_type) == {f.model_type for f in FAMILIES}
    assert not by_type["gemma2"].served and by_type["gemma2"].reason == "soft-capping is missing"
    assert all(v.served and not v.reason for t, v in by_type.items() if t != "gemma2")


def test_sluice_models_prints_served_and_refused_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    served, refused = out.split("refused:\n") if "refused:\n" in out else (out, "")
    for v in verdicts():
        assert v.family.name in (served if v.served else refused)
        assert v.family.features in out
        if not v.served:
            assert f"why: {v.reason}" in refused
    assert cli.main(["models", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown_table(verdicts())
