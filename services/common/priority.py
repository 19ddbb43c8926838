"""A service's CPU priority once its server starts: `sluice up` starts a light stage (tokenizer,
detokenizer, gateway) at its own priority and names in NICE_ENV how much lower it is to run, so that the
imports and loading of a start or a restart compete as equals with busy engines (at nice +10 a cold
tokenizer took 30 s to start beside two loaded engines on 2 cores), and the serving process yields to them.

On Linux a nice value belongs to a thread and a new thread starts with its creator's, so the change is
made on every thread the process has (`set_every_thread_nice`); lowering a priority needs no privilege.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

log = logging.getLogger(__name__)

NICE_ENV = "SLUICE_NICE_WHEN_SERVING"  # how much the service adds to its nice value once it serves


def set_every_thread_nice(nice: int) -> None:
    """Sets the nice value of every thread of this process (Linux: /proc/self/task lists them), again
    for threads that a thread still at the old value started meanwhile, until no new one appears."""
    done: set[str] = set()
    while new := set(os.listdir("/proc/self/task")) - done:
        for task in new:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(task), nice)
        done |= new


def lower_when_serving() -> int:
    """Adds NICE_ENV's increment (when set and positive) to every thread's nice value, capped at 19 by
    the kernel; returns the nice value the process runs at. A value that is not an integer is logged
    and ignored (the launcher writes it; a person setting it by hand gets told)."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    raw = os.environ.get(NICE_ENV, "")
    try:
        increment = int(raw or 0)
    except ValueError:
        log.warning("%s=%r is not an integer: the priority stays at nice %d", NICE_ENV, raw, current)
        return current
    if increment <= 0:
        return current
    target = min(19, current + increment)
    if sys.platform == "linux":
        set_every_thread_nice(target)
    else:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    return target
