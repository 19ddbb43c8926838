"""sluice.ports: services launched together never share a port (one that found another's port taken
would exit, and its client could reach the other service instead)."""

from __future__ import annotations

import socket

import pytest

from sluice import ports
from tests.e2e.conftest import free_ports


def test_runs_handed_out_in_one_process_never_overlap() -> None:
    """A hundred picks in a row, as a test launching many services makes them before any binds: every
    port of every run appears once, and each is bindable."""
    handed: list[int] = []
    for _ in range(100):
        first = ports.free_port_run(5)
        handed += range(first, first + 5)
    assert len(set(handed)) == len(handed) == 500
    assert all(ports.LOW <= p < ports.HIGH for p in handed)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", handed[-1]))


def test_the_e2e_pairs_come_from_the_same_picker() -> None:
    http, base = free_ports(3)
    first = ports.free_port_run(1)
    assert first not in (http, *range(base, base + 4))
    assert {http, *range(base, base + 4)} <= ports._handed_out


def test_a_port_bound_now_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the range narrowed to one port, bound now: no pick, a RuntimeError that says so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        taken = sock.getsockname()[1]
        monkeypatch.setattr(ports, "LOW", taken)
        monkeypatch.setattr(ports, "HIGH", taken + 1)
        monkeypatch.setattr(ports, "ATTEMPTS", 20)
        with pytest.raises(RuntimeError, match="no run of 1 free ports"):
            ports.free_port_run(1)
