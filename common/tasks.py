"""Stopping asyncio tasks: cancel them all, then wait until each has finished."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel every task (None entries are skipped) and wait for each to end."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        with contextlib.suppress(asyncio.CancelledError):
            await t
