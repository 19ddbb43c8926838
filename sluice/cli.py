from __future__ import annotations


def main() -> None:
    raise SystemExit("sluice: not yet wired")
