from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.common.settings import ValidatedSettings, env_name, flag_name, load_settings


@dataclass(frozen=True)
class Example:
    """Example settings."""

    port: int = 1
    ratio: float = 0.5
    name: str = "x"
    on: bool = False
    peers: tuple[str, ...] = ("a:1",)
    limit: int | None = None
    tagged: str = field(default="t", metadata={"help": "a tagged field"})


def test_names() -> None:
    assert env_name("kv_cache_gb") == "SLUICE_KV_CACHE_GB"
    assert flag_name("kv_cache_gb") == "--kv-cache-gb"


def test_defaults_when_nothing_given() -> None:
    assert load_settings(Example, [], environ={}) == Example()


def test_environment_then_flags_take_precedence() -> None:
    env = {"SLUICE_PORT": "7", "SLUICE_NAME": "env", "SLUICE_ON": "yes", "SLUICE_PEERS": "b:2, c:3"}
    settings = load_settings(Example, ["--name", "flag", "--limit", "9"], environ=env)
    assert settings == Example(port=7, name="flag", on=True, peers=("b:2", "c:3"), limit=9)


def test_bad_value_is_a_clear_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(Example, ["--port", "many"], environ={})
    assert "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(Example, [], environ={"SLUICE_ON": "maybe"})
    assert "SLUICE_ON" in capsys.readouterr().err


def test_unknown_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        load_settings(Example, ["--nope", "1"], environ={})


@dataclass(frozen=True)
class Checked(ValidatedSettings):
    """Settings with their own check, run once when built."""

    workers: int = 1

    def validate(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


def test_validate_runs_once_when_built(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings(Checked, ["--workers", "3"], environ={}) == Checked(workers=3)
    with pytest.raises(SystemExit):
        load_settings(Checked, ["--workers", "0"], environ={})
    assert "workers must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="workers must be at least 1"):
        Checked(workers=0)
    calls: list[int] = []
    monkeypatch.setattr(Checked, "validate", lambda self: calls.append(self.workers))
    load_settings(Checked, ["--workers", "2"], environ={})
    assert calls == [2]


@pytest.mark.parametrize(
    ("module", "name", "argv"),
    [
        ("services.tokenizer.settings", "TokenizerSettings", ["--workers", "0"]),
        ("services.detokenizer.settings", "DetokenizerSettings", ["--workers", "0"]),
        ("services.engine.settings", "EngineSettings", ["--batching", "sometimes"]),
        ("gateway.settings", "GatewaySettings", ["--routing", "random"]),
    ],
)
def test_every_service_refuses_bad_settings(module: str, name: str, argv: list[str]) -> None:
    import importlib

    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit):
        load_settings(cls, argv, environ={})
