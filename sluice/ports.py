"""Free ports for services that a process is about to start (`sluice bench`, the tests): one picker.

Services launched together have not bound their ports yet when the next ones are chosen, so a port free
now may be promised already; `free_port_run` never hands out a port twice in one process. Picks lie
below Linux's default range for outgoing connections' local ports (32768-60999), where a client
connection could take the port of a child about to be restarted.
"""

from __future__ import annotations

import random
import socket
import threading

LOW, HIGH = 10000, 32768  # picks lie in [LOW, HIGH)
ATTEMPTS = 2000

_handed_out: set[int] = set()
_lock = threading.Lock()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when `port` can be bound on `host` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(count: int = 1, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports that are free on `host` now and were never handed out
    before in this process (they count as handed out from here on). Raises RuntimeError when no such
    run turns up in ATTEMPTS random tries."""
    assert 1 <= count <= HIGH - LOW
    rng = random.Random()
    with _lock:
        for _ in range(ATTEMPTS):
            first = rng.randrange(LOW, HIGH - count + 1)
            ports = range(first, first + count)
            if _handed_out.isdisjoint(ports) and all(port_free(p, host) for p in ports):
                _handed_out.update(ports)
                return first
    raise RuntimeError(f"no run of {count} free ports found on {host} in {ATTEMPTS} tries")


def free_port(host: str = "127.0.0.1") -> int:
    """One port, as `free_port_run(1, host)`."""
    return free_port_run(1, host)
