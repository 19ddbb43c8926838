"""Module docstrings state contracts and invariants in at most a dozen lines; narrative, history and
measured figures belong in docs/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 12


def _modules() -> list[Path]:
    """Every Python module of the tree but the tests, the generated stubs and the excluded ones."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or any(part.startswith(".") for part in rel.parts):
            continue
        if "pb" in rel.parts[:-1]:
            continue
        found.append(path)
    return found


def _docstring_lines(path: Path) -> int:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return 0 if docstring is None else docstring.count("\n") + 1


def test_the_check_sees_the_packages() -> None:
    assert len(_modules()) > 50


def test_module_docstrings_fit_a_dozen_lines() -> None:
    long = {
        path.relative_to(ROOT).as_posix(): lines
        for path in _modules()
        if (lines := _docstring_lines(path)) > MAX_LINES
    }
    assert not long, f"module docstrings over {MAX_LINES} lines (move narrative to docs/): {long}"
