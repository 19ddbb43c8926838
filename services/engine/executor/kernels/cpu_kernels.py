"""The CPU kernels, one C++ module of the sources beside this file: the paged decode attention
(paged_attention_cpu.cpp) and the linear layers' product for a few rows (linear_rows_cpu.cpp). Built with
the machine's C++ compiler at first use through torch.utils.cpp_extension (ninja), for this CPU
(-march=native; the build's name carries a hash of the CPU's flags and the sources, so a cached build never
runs on another CPU), cached in torch's extension directory ($TORCH_EXTENSIONS_DIR) and loaded from there
afterwards. `load()` logs the build or load once and returns the module, or None with the reason logged
when it cannot be built. `paged_decode` runs the attention with the Triton kernel's arguments
(services/engine/executor/kernels/paged_attention.py): every decode row reads its K/V in place through its
block table. `linear_rows` is the custom op `sluice::linear_rows` (executor/cpu_linear.py calls it)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention_cpu.cpp", "linear_rows_cpu.cpp"))
# -fopenmp: at::parallel_for spreads over torch's intra-op threads only in code built with OpenMP; with
# -fopenmp-simd alone (until 2026-12-02) every region ran on the calling thread (`parallel_threads` says
# which). fast-math: compile only.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-std=c++17"]
DISABLE_ENV = "SLUICE_CPU_KERNEL"  # "0": never build nor use the kernel


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_name() -> str:
    text = _cpu_flags() + "".join(source.read_text() for source in SOURCES) + " ".join(CFLAGS)
    return f"sluice_cpu_kernels_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _ninja_on_path() -> bool:
    """ninja where cpp_extension looks for it (PATH); the `ninja` package's binary added when installed."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # the `ninja` distribution (pyproject.toml)

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        return False
    return shutil.which("ninja") is not None


@functools.cache
def status() -> tuple[ModuleType | None, str]:
    """The built module and "", or None and why not (logged once)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None, f"{DISABLE_ENV}=0"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return _unavailable(f"no C++ compiler ({compiler!r} is not on PATH)")
    if not _ninja_on_path():
        return _unavailable("ninja is not installed")
    from torch.utils import cpp_extension

    name = _build_name()
    build_dir = Path(cpp_extension.get_default_build_root()) / name
    start = time.monotonic()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir):
            module = cpp_extension.load(
                name,
                [str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-lmvec"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # a compiler or linker error: the torch path serves instead
        return _unavailable(f"the build failed: {type(exc).__name__}: {str(exc)[-500:]}")
    log.info("CPU kernels ready in %.1f s: %s", time.monotonic() - start, module.__file__)
    return module, ""


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Holds an flock beside `build_dir` (the kernel dies with its holder, unlike cpp_extension's own
    `lock` file, which a process killed mid-build leaves behind for every later build to wait on
    forever); with it held no live process is building, so a leftover `lock` file is removed."""
    with open(build_dir.with_name(build_dir.name + ".flock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unavailable(why: str) -> tuple[None, str]:
    log.warning(
        "CPU kernels unavailable, decode attention gathers K/V and few-row products run on torch's GEMM "
        "instead: %s",
        why,
    )
    return None, why


def load() -> ModuleType | None:
    return status()[0]


def paged_decode(
    query: torch.Tensor,  # (rows, H, D)
    k_pool: torch.Tensor,  # (num_slots, Hkv, D)
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # (rows, max_blocks) int32
    seq_lens: torch.Tensor,  # (rows,) int32, 0 for a padding row
    block_size: int,
    scale: float,
    window: int,
    out: torch.Tensor,  # (rows, H, D) in the query's dtype
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Writes each row's attention into `out`; the module must have loaded (`load()`)."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU paged attention kernel is unavailable: {status()[1]}")
    q = query.to(torch.float32).contiguous()
    res = module.paged_decode(
        q, k_pool, v_pool, block_tables, seq_lens, block_size, scale, window, softcap, sinks
    )
    out.copy_(res)


def main(argv: list[str]) -> int:
    """`python -m services.engine.executor.kernels.cpu_kernels [--require]`: builds the kernel once, so that
    no engine start pays for it (`make install`, the image's build); with `--require`, exits 1 naming why
    when it does not build (the image must carry it; a host without a compiler may do without)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module, why = status()
    if module is None and "--require" in argv:
        print(f"the CPU kernels did not build: {why}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
