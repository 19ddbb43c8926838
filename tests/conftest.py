"""Suite-wide fixtures: small model directories made by the project (nothing is downloaded)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# Without a CUDA device the Triton kernels run under Triton's interpreter. Triton reads the variable when
# it is imported (some of the imports below import it), so it is set first; a GPU run compiles for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from sluice.model.families import make_family_model
from sluice.model.tiny import make_tiny_model

if TYPE_CHECKING:
    from tests.e2e.conftest import Pipeline

TinyModelFactory = Callable[..., Path]

# `make test` runs the stack tests and the others side by side, two pytest processes on two cores.
if os.environ.get("SLUICE_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["SLUICE_TEST_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model_dir_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`factory(arch="llama", **overrides) -> Path`: an untrained `test`-preset model directory, made once
    per session for each distinct set of arguments (a few seconds each; the tokenizer is trained once)."""
    made: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def factory(arch: str = "llama", **overrides: Any) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
            made[key] = make_tiny_model(out, preset="test", arch=arch, progress=False, **overrides)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dir_factory: TinyModelFactory) -> Path:
    """An untrained `test`-preset Llama directory (config, safetensors, tokenizer, chat template)."""
    return tiny_model_dir_factory()


FAMILY_VOCAB = 512  # small: the families' tests compare many greedy steps


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`factory(family) -> Path`: a random-weight directory of `family` (sluice/model/families.py, its
    special parts on, the project's tokenizer with FAMILY_VOCAB tokens), made once per session."""
    made: dict[str, Path] = {}

    def factory(family: str) -> Path:
        if family not in made:
            out = tmp_path_factory.mktemp(f"family-{family}") / "model"
            made[family] = make_family_model(out, family, vocab_size=FAMILY_VOCAB)
        return made[family]

    return factory


@pytest.fixture(scope="session")
def pipeline(tiny_model_dir: Path) -> Iterator[Pipeline]:
    """One `sluice up` of the tiny model (tests/e2e/conftest.py) shared by every module that only sends
    it requests; a module that kills or stops stages, or needs other flags, starts its own."""
    from tests.e2e.conftest import start_pipeline

    running = start_pipeline(tiny_model_dir)
    yield running
    code = running.stop()
    assert code == 0, running.output()


@pytest.fixture(autouse=True)
def _no_stack_left_running() -> Iterator[None]:
    """A `sluice up` a test started (tests/e2e/conftest.py) and left running, the test having failed
    before its own stop, is stopped with its whole process group when the test ends."""
    from tests.e2e.conftest import LAUNCHED, stop_left_behind

    before = len(LAUNCHED)
    yield
    stop_left_behind(LAUNCHED[before:])


@pytest.fixture(scope="session", autouse=True)
def _no_stack_left_after_the_suite() -> Iterator[None]:
    """Stops every `sluice up` still running when the suite ends (a module's fixture that failed in
    its teardown, say)."""
    from tests.e2e.conftest import LAUNCHED, stop_left_behind

    yield
    stop_left_behind(LAUNCHED)
