"""docs/architecture.md stays true to the tree: every module under services/ and gateway/ is named in it by
its path, and every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("services", "gateway")


def _modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" or "/pb/" in rel:
                continue
            found.append(rel)
    return found


def test_every_module_is_named_in_the_architecture_doc() -> None:
    text = ARCHITECTURE.read_text()
    missing = [module for module in _modules() if f"`{module}`" not in text]
    assert not missing, f"modules not named in docs/architecture.md: {missing}"


def test_every_module_path_the_doc_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`((?:services|gateway|sluice)/[\w/]+\.py)`", text))
    assert named, "the doc names no module paths"
    stale = sorted(path for path in named if not (ROOT / path).is_file())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
