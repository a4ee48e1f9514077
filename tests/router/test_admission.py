"""Admission control (router/limits.py): bounded in flight, a bounded FIFO wait, and a capacity
that changes at once when the decode pool grows or shrinks (router/app.py resizes it)."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.router.limits import Admission, Overloaded


async def settle() -> None:
    """Let every woken task run (a future's result reaches its waiter over a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_raised_capacity_admits_the_waiters_at_once():
    """Before the fix a new capacity was used only once the queue had emptied: with waiters in line,
    each release handed its one slot on and the new room stayed unused."""
    async def go() -> None:
        adm = Admission(capacity=2, max_queued=10, timeout_s=5)
        await adm.acquire()
        await adm.acquire()
        waiters = [asyncio.create_task(adm.acquire()) for _ in range(4)]
        await settle()
        assert adm.queued == 4 and adm.inflight == 2
        adm.resize(5)                                   # three decode nodes joined mid-overload
        await settle()
        assert adm.inflight == 5 and adm.queued == 1
        assert sum(w.done() for w in waiters) == 3
        adm.release()                                   # the slot passes to the last waiter
        await settle()
        assert all(w.done() for w in waiters) and adm.inflight == 5 and adm.queued == 0
    asyncio.run(go())


def test_a_lowered_capacity_admits_nobody_until_there_is_room():
    async def go() -> None:
        adm = Admission(capacity=3, max_queued=10, timeout_s=5)
        for _ in range(3):
            await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await settle()
        adm.resize(1)                                   # two decode nodes left
        adm.release()
        adm.release()
        await settle()
        assert not waiter.done() and adm.inflight == 1
        adm.release()
        await settle()
        assert waiter.done() and adm.inflight == 1
    asyncio.run(go())


def test_a_waiter_that_gives_up_is_skipped_and_a_full_line_is_refused():
    async def go() -> None:
        adm = Admission(capacity=1, max_queued=1, timeout_s=0.05)
        await adm.acquire()
        with pytest.raises(Overloaded, match="no capacity within"):
            await adm.acquire()                         # timed out in line
        assert adm.queued == 0
        waiter = asyncio.create_task(adm.acquire())
        await settle()
        with pytest.raises(Overloaded, match="at capacity"):
            await adm.acquire()                         # the line (1) is full
        waiter.cancel()
        await settle()
        adm.release()
        await settle()
        assert adm.inflight == 0 and adm.queued == 0
    asyncio.run(go())
