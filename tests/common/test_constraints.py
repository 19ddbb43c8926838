"""constraints.txt pins exactly what is installed: every pin names a package in the environment at
that version, so no pin outlives the dependency it was for."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"


def pins() -> dict[str, str]:
    """Package name → pinned version, from constraints.txt (comments and blank lines skipped)."""
    found: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[name.strip()] = version.strip()
    return found


def test_every_pin_is_installed_at_its_version() -> None:
    wrong: list[str] = []
    for name, version in pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"{name}=={version}: not installed")
            continue
        if installed.split("+", 1)[0] != version:  # a local label such as torch's +cpu aside
            wrong.append(f"{name}=={version}: {installed} installed")
    assert not wrong, wrong
