"""Settings for every service: one frozen dataclass each, filled from defaults, `SLUICE_*`
environment variables and command-line flags, in that order of precedence.

A field `kv_cache_gb` becomes the flag `--kv-cache-gb` and the variable `SLUICE_KV_CACHE_GB`.
Argument parsing happens only here, called from the `sluice` entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "SLUICE_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _convert(kind: Any, raw: str) -> Any:
    """Converts one string to the field's type (bool, int, float, str, optional and tuple forms)."""
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        inner = [a for a in args if a is not type(None)]
        if raw == "" or raw.lower() == "none":
            return None
        return _convert(inner[0], raw)
    if origin is tuple:
        items = [s.strip() for s in raw.split(",") if s.strip()]
        return tuple(_convert(args[0], s) for s in items)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return kind(raw)


def add_arguments(cls: type, parser: argparse.ArgumentParser) -> None:
    """Adds one flag per dataclass field; the field's metadata `help` becomes the flag's help."""
    for field in dataclasses.fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = field.metadata.get("help", "")
        help_text = f"{help_text} (default: {default!r}; env {env_name(field.name)})".strip()
        parser.add_argument(flag_name(field.name), dest=field.name, type=str, default=None, help=help_text)


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Builds `cls` from its defaults, then `SLUICE_*` variables, then flags in `argv`; building it runs its
    `validate()` (`ValidatedSettings`), whose ValueError names the bad value.

    Raises SystemExit with a clear message (argparse's) on an unknown flag or a bad value.
    """
    assert dataclasses.is_dataclass(cls)
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().split("\n")[0])
    add_arguments(cls, parser)
    namespace = parser.parse_args(list(argv or []))
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(namespace, field.name)
        source = flag_name(field.name)
        if raw is None:
            raw = environ.get(env_name(field.name))
            source = env_name(field.name)
        if raw is None:
            continue
        try:
            values[field.name] = _convert(hints[field.name], raw)
        except ValueError as exc:
            parser.error(f"{source}: {exc}")
    try:
        return cls(**values)
    except ValueError as exc:  # the class's validate(), run once, when it is built
        parser.error(str(exc))


def check_bounds(settings: object, bounds: Iterable[tuple[str, float, Iterable[str]]]) -> None:
    """Raises ValueError naming the first field of `settings` off its bound: each entry of `bounds` is
    (">" or ">=", the bound, the names of the fields it applies to). NaN is off every bound."""
    for op, bound, names in bounds:
        for name in names:
            value = getattr(settings, name)
            if not (value > bound if op == ">" else value >= bound):
                raise ValueError(f"{name} must be {op} {bound:g}")


def check_choices(settings: object, choices: Iterable[tuple[str, Sequence[str]]]) -> None:
    """Raises ValueError naming the first field of `settings` whose value is not among its choices:
    each entry of `choices` is (the field's name, the values it may take)."""
    for name, allowed in choices:
        value = getattr(settings, name)
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ValidatedSettings:
    """Base of every service's settings: `validate()` runs once, when an instance is built (by
    `load_settings`, a test or a benchmark alike), so no holder of settings validates them again."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the bad value; a service's settings override it."""


@dataclasses.dataclass(frozen=True)
class StageTlsSettings(ValidatedSettings):
    """The TLS fields every stage's settings share (the stage's settings class derives from this one):
    a certificate and key turn on TLS; a client CA on top of them turns on mutual TLS (every client must
    present a certificate that CA signed). All empty: plaintext, as before."""

    tls_cert_file: str = dataclasses.field(
        default="", metadata={"help": "PEM certificate (chain) this server presents (set = TLS)"}
    )
    tls_key_file: str = dataclasses.field(default="", metadata={"help": "PEM private key of --tls-cert-file"})
    tls_client_ca_file: str = dataclasses.field(
        default="",
        metadata={"help": "PEM CA that must sign every client's certificate (set = mutual TLS)"},
    )

    def validate_tls(self) -> None:
        """Raises ValueError when the TLS fields do not fit together."""
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (mutual TLS is TLS)")


@dataclasses.dataclass(frozen=True)
class TextStageSettings(StageTlsSettings):
    """The fields the tokenizer's and the detokenizer's settings share (each gives `port` its own
    default): the model, the address, the drain, the worker processes and their metrics ports."""

    model: str = dataclasses.field(
        default="",
        metadata={
            "help": "model directory or Hugging Face Hub id (ORG/NAME, from the cache or downloaded); "
            "empty = the embedded tiny model"
        },
    )
    revision: str = dataclasses.field(
        default="", metadata={"help": "branch, tag or commit of a Hub id in --model (empty = main)"}
    )
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port (0 = any free port)"})
    grace_s: float = dataclasses.field(
        default=5.0, metadata={"help": "seconds calls in flight get to finish on SIGTERM"}
    )
    workers: int = dataclasses.field(
        default=1, metadata={"help": "processes sharing the port (SO_REUSEPORT)"}
    )
    metrics_port: int = dataclasses.field(
        default=0,
        metadata={
            "help": "Prometheus /metrics HTTP port (0 = none); worker i of --workers serves on this port + i"
        },
    )

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        self.validate_tls()
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
