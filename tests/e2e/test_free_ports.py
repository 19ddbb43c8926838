"""The e2e port picker: services launched together never share a port (one that found another's port
taken would exit, and its client could reach the other service instead)."""

from __future__ import annotations

from tests.e2e.conftest import free_ports


def test_ports_handed_out_in_one_process_never_repeat() -> None:
    """A hundred picks in a row, as a test launching many services makes them before any binds: every
    port of every pick (the HTTP port, the base and the stage ports after it) appears once."""
    ports: list[int] = []
    for _ in range(100):
        http, base = free_ports(3)
        ports += [http, *range(base, base + 4)]
    assert len(set(ports)) == len(ports) == 500
