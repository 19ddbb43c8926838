"""A service's priority once it serves (services/common/priority.py): NICE_ENV lowers every thread of the
process, threads started before included; nothing else changes it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.common.priority import NICE_ENV

CODE = (
    "import os, threading, time; from services.common import priority; "
    "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
    "after = priority.lower_when_serving(); "
    "tasks = os.listdir('/proc/self/task'); "
    "print(after, len(tasks), *sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in tasks}))"
)


def _run(env_value: str | None) -> tuple[list[int], str]:
    env = {k: v for k, v in os.environ.items() if k != NICE_ENV}
    if env_value is not None:
        env[NICE_ENV] = env_value
    done = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True)
    return [int(word) for word in done.stdout.split()], done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")
def test_the_increment_lowers_every_thread_and_caps_at_19() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    (after, threads, *values), _ = _run("3")
    assert after == min(19, before + 3) and threads >= 2 and values == [after]
    (after, _, *values), _ = _run("40")
    assert after == 19 and values == [19]


@pytest.mark.parametrize("value", [None, "0", "-5"])
def test_no_positive_increment_leaves_the_priority_alone(value: str | None) -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    (after, _, *values), _ = _run(value)
    assert after == before and values == [before]


def test_a_value_that_is_not_a_number_is_said_and_ignored() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    (after, _, *values), err = _run("ten")
    assert after == before and values == [before]
    assert f"{NICE_ENV}='ten' is not an integer" in err
