"""Where a service finds its model: the `--model` directory, or the embedded model when none is given."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str) -> Path:
    """`model` as a path, or the embedded chat model when empty (built and cached on first use)."""
    if model:
        return Path(model)
    from sluice.model.tiny import default_model_dir

    return default_model_dir()
