"""Admin actions, one at a time per GPU, with identical concurrent requests joined.

Sleep, wake, training start and training stop all change what holds a GPU's memory. Run
concurrently they collide: a wake racing a training start fills the GPU twice, and a sleep
racing a wake leaves whichever ran last. So every action holds the lock of each GPU it
touches (taken in index order, so two multi-GPU actions cannot deadlock), and its checks run
under those locks, against the state the previous action left.

A request identical to one already queued or running (same action, same parameters) does not
run again: it joins, and every caller gets that one action's result (or error). The action
runs in a task owned here, so a caller that disconnects neither cancels it for the others nor
leaves it untracked at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import TypeVar

_T = TypeVar("_T")


class AdminActions:
    """Per-GPU serialization and joining of admin actions."""

    def __init__(self) -> None:
        self._locks: dict[int, asyncio.Lock] = {}
        self._pending: dict[Hashable, asyncio.Task[object]] = {}
        self._callers = 0

    @property
    def callers(self) -> int:
        """Requests waiting on an action right now (joined ones included)."""
        return self._callers

    @property
    def actions(self) -> int:
        """Distinct actions queued or running right now."""
        return len(self._pending)

    async def run(
        self,
        key: Hashable,
        gpus: Iterable[int],
        action: Callable[[], Awaitable[_T]],
    ) -> _T:
        """Run ``action`` holding the locks of ``gpus``, or join the pending one with ``key``.

        Args:
            key: Identifies the action and its parameters; equal keys join.
            gpus: The GPU indexes the action touches.
            action: The work; it runs once per distinct pending key.

        Returns:
            The action's result (the same for every caller that joined it).
        """
        task = self._pending.get(key)
        if task is None:
            task = asyncio.create_task(self._locked(sorted(set(gpus)), action), name=f"{key}")
            self._pending[key] = task
            task.add_done_callback(lambda done: self._forget(key, done))
        self._callers += 1
        try:
            # shield: one caller's cancellation (a client gone) must not cancel the others'.
            result: _T = await asyncio.shield(task)  # type: ignore[arg-type]  # task of _T
        finally:
            self._callers -= 1
        return result

    def _forget(self, key: Hashable, task: asyncio.Task[object]) -> None:
        if self._pending.get(key) is task:
            del self._pending[key]
        if not task.cancelled():
            task.exception()  # retrieved: a failure nobody awaited any more is not logged

    async def _locked(self, gpus: list[int], action: Callable[[], Awaitable[_T]]) -> _T:
        async with contextlib.AsyncExitStack() as stack:
            for gpu in gpus:
                await stack.enter_async_context(self._locks.setdefault(gpu, asyncio.Lock()))
            return await action()

    async def close(self) -> None:
        """Cancel every pending action and wait for it (application cleanup)."""
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
