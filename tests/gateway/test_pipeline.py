"""Pieces of the pipeline that need no servers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.events import Delta, Done, EventSlot


async def test_a_lagging_consumer_gets_merged_deltas_then_one_terminal() -> None:
    slot = EventSlot()
    slot.push("a", [1], [])
    slot.push("b", [2], [])
    slot.push("", [3], [])
    slot.push("c", [], [])
    slot.finish(Done("length", 2, 3))
    assert await slot.get() == Delta("abc", [1, 2, 3], [])
    assert await slot.get() == Done("length", 2, 3)
    assert slot.ended
    with pytest.raises(EOFError):
        await slot.get()


async def test_get_waits_for_the_next_push() -> None:
    slot = EventSlot()
    waiter = asyncio.ensure_future(slot.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    slot.push("x", [], [])
    assert await asyncio.wait_for(waiter, 5) == Delta("x")
