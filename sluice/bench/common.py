"""What every benchmark shares besides its report (report.py): the shared flags and their argparse types
(a bad value exits with status 2 and a usage line), torch's settings, progress bars, error text and the
run's metadata (command, date, machine, git commit).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm


def positive_list(text: str, kind: Callable[[str], Any] = int, what: str = "integers") -> tuple[Any, ...]:
    """`1,64,256` → (1, 64, 256), integers by default (`kind` float: numbers, inf too); every value
    positive."""
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from exc
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive {what}, got {text!r}")
    return values


def int_range(text: str) -> tuple[int, int]:
    """`MIN,MAX` with 1 <= MIN <= MAX."""
    values = positive_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return values[0], values[1]


def positive_int(text: str) -> int:
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    if not (value := float(text)) > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def names(choices: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse type for a comma list of `choices` (duplicates dropped, order kept)."""

    def parse(text: str) -> tuple[str, ...]:
        picked = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
        unknown = [n for n in picked if n not in choices]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
        return picked

    return parse


_FLAGS: dict[str, dict[str, Any]] = {  # argparse's default is None unless given
    "model": dict(type=Path, metavar="DIR", help="model directory (default: the embedded model)"),
    "json": dict(type=Path, metavar="FILE", help="write the figures as JSON here"),
    "quick": dict(action="store_true", help="tiny counts for smoke tests"),
    "threads": dict(type=positive_int, metavar="N", help="torch CPU threads (default: torch's)"),
    "no-progress": dict(action="store_true", help="hide the progress bars"),
    "device": dict(help="cpu | cuda | cuda:N (default: cuda if available)"),
    "dtype": dict(
        choices=("float32", "bfloat16", "float16"), help="the model's dtype (default float32 on CPU)"
    ),
    "seed": dict(type=int, default=0, metavar="N", help="seed of the workload (and of random weights)"),
    "repeat": dict(type=positive_int, default=1, metavar="N", help="run every measurement N times"),
    "engine-flags": dict(default="", metavar="FLAGS", help='extra engine flags, e.g. "--num-kv-blocks 256"'),
}


def add_count(
    parser: argparse.ArgumentParser | Any, flag: str, default: Any, about: str, type: Any = positive_int
) -> None:
    """Adds `flag`, a number (by default an integer >= 1) with metavar N, to `parser`."""
    parser.add_argument(flag, type=type, default=default, metavar="N", help=about)


def add_flags(parser: argparse.ArgumentParser | Any, *flags: str, **helps: str) -> None:
    """Adds the shared `flags` (names without dashes) to `parser` (or an argument group); `helps` rewords
    one, keyed by its dest (`no_progress=...`)."""
    for flag in flags:
        reworded = {"help": helps[dest]} if (dest := flag.replace("-", "_")) in helps else {}
        parser.add_argument(f"--{flag}", **{**_FLAGS[flag], **reworded})


def resolve_device(args: argparse.Namespace) -> bool:
    """Sets `args.device` (cuda when torch sees one) and returns whether it is CUDA; ValueError when
    CUDA is asked for and absent."""
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if (cuda := args.device.startswith("cuda")) and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return cuda


def quiet_torch(threads: int | None) -> None:
    """torch's CPU threads (None keeps torch's), and transformers without warnings or progress bars."""
    import torch
    from transformers.utils import logging as hf_logging

    if threads is not None:
        torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def progress_bar(show: bool, total: int, desc: str, unit: str = "tok") -> tqdm:
    options = {"file": sys.stderr, "mininterval": 0.5, "dynamic_ncols": True}
    return tqdm(total=total, desc=desc, unit=unit, disable=not show, **options)


def error_text(exc: BaseException) -> str:
    """Prints the traceback to stderr and returns `Type: message` for the report."""
    traceback.print_exc(file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"


def machine_info(device: str | None = None) -> dict[str, Any]:
    """The machine; with a torch `device`, also torch's and transformers' versions, threads and GPU."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.partition(":")[2].strip() for ln in lines if ln.startswith("model name")), cpu)
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cpu_model": cpu}
    info.update(python=platform.python_version(), platform=platform.platform())
    if device is not None:
        import torch
        import transformers

        info.update(device=device, torch=torch.__version__, transformers=transformers.__version__,
                    torch_threads=torch.get_num_threads())  # fmt: skip
        if device.startswith("cuda"):
            info.update(gpu=torch.cuda.get_device_name(torch.device(device)), cuda=torch.version.cuda)
    return info


def run_meta(bench_argv: Sequence[str], device: str | None = None) -> dict[str, Any]:
    """Where and how a run was made: its command (`bench_argv` is what followed `sluice bench`, the
    benchmark's name first), date (UTC), machine (see `machine_info`), git commit (None outside git)."""
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "rev-parse", "HEAD"]
        done = subprocess.run(
            git, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5, check=True
        )
        commit = done.stdout.strip() or None
    return {
        "command": shlex.join(["sluice", "bench", *bench_argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "git_commit": commit,
    }
