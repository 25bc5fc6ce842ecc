"""Background tasks of the control plane (discovery, health, leases, ledger sweeps): started
with a name, stopped by cancelling and waiting, so none outlives its owner."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import TypeAlias

#: Work for a task: a coroutine whose result nobody reads.
Work: TypeAlias = Coroutine[object, None, None]


def start(work: Work, name: str) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(work, name=name)


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancels ``task`` and waits until it has finished (a no-op for None)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
