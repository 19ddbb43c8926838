"""Every example command of README.md's usage sections ("Running" and "APIs") works as written against
a running `sluice up`: the curl calls, the WebSocket, OpenAI and gRPC snippets, `sluice health` and
`sluice serve ... --help` run (only the ports are changed to the test's free ones, and `.venv/bin/` to
this interpreter's directory); the `sluice up` and `sluice model tiny` lines, which start a pipeline or
train a model for minutes, have their flags parsed. The pipeline serves the model under the name
`sluice up` gives the embedded model, so the examples run as they would under `make up`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice import launcher, plan
from sluice.model import tiny
from tests.e2e.conftest import Pipeline, start_pipeline

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USAGE_SECTIONS = ("Running", "APIs")
COMMAND_TIMEOUT_S = 180.0
PORTS = re.compile(r"(?<=:)(8000|5005[0-3])\b")


@dataclass(frozen=True)
class Example:
    """One example: a command line of a bash block (`argv`) or a whole python block (`code`)."""

    section: str
    argv: tuple[str, ...] = ()
    code: str = ""

    @property
    def kind(self) -> str:
        if self.code:
            return "python"
        name = Path(self.argv[0]).name
        return f"sluice {self.argv[1]}" if name == "sluice" else name

    def __str__(self) -> str:
        return f"{self.section}: {self.kind}: {' '.join(self.argv) or self.code.splitlines()[-1]}"[:100]


def sections(text: str) -> dict[str, str]:
    """`## ` headings → the text under each."""
    parts = re.split(r"^## +(.+)$", text, flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def examples() -> list[Example]:
    found: list[Example] = []
    bodies = sections(README.read_text())
    for section in USAGE_SECTIONS:
        for lang, block in re.findall(
            r"^```(\w*)\n(.*?)^```", bodies[section], flags=re.MULTILINE | re.DOTALL
        ):
            if lang == "python":
                found.append(Example(section, code=block))
                continue
            assert lang == "bash", f"a {lang or 'plain'} block in {section}: say how to check it"
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if argv:
                    found.append(Example(section, argv=tuple(argv)))
    return found


EXAMPLES = examples()


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Pipeline]:
    running = start_pipeline(tiny_model_dir, "--served-model-name", plan.EMBEDDED_MODEL_NAME)
    yield running
    assert running.stop() == 0, running.output()


def localize(text: str, pipeline: Pipeline) -> str:
    """The README's default ports replaced by the running pipeline's."""
    ports = {"8000": pipeline.http_port, **{f"5005{i}": pipeline.grpc_base_port + i for i in range(4)}}
    return PORTS.sub(lambda m: str(ports[m.group(1)]), text)


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def check_curl_output(out: str) -> None:
    """An SSE stream: JSON events without an error, then [DONE]; else one JSON body without one."""
    events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
    if not events:
        assert "error" not in json.loads(out), out
        return
    assert events[-1] == "[DONE]", out
    for event in events[:-1]:
        assert "error" not in json.loads(event), out


def test_the_readme_has_examples_of_every_kind() -> None:
    kinds = {example.kind for example in EXAMPLES}
    expected = {
        "sluice up",
        "sluice serve",
        "sluice model",
        "sluice models",
        "sluice health",
        "curl",
        "python",
    }
    assert kinds == expected, kinds
    assert sum(example.kind == "python" for example in EXAMPLES) >= 3


def test_the_readme_sends_the_name_sluice_up_serves() -> None:
    name = plan.EMBEDDED_MODEL_NAME
    assert plan.served_name_flags(launcher.parse_args([])) == ("--served-model-name", name)
    assert f'"model": "{name}"' in README.read_text()


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_readme_example_works(example: Example, served: Pipeline) -> None:
    if example.kind == "sluice up":
        launcher.parse_args(list(example.argv[2:]))  # argparse exits on a bad flag
        return
    if example.kind == "sluice model":
        assert example.argv[2] == "tiny"
        tiny._parser().parse_args(list(example.argv[3:]))
        return
    if example.code:
        result = run([sys.executable, "-c", localize(example.code, served)])
    elif example.kind.startswith("sluice"):
        sluice = str(Path(sys.executable).parent / "sluice")
        result = run([sluice, *(localize(arg, served) for arg in example.argv[1:])])
    else:
        result = run([localize(arg, served) for arg in example.argv])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output and "'type': 'error'" not in output, output
    if example.kind == "curl":
        check_curl_output(result.stdout)
