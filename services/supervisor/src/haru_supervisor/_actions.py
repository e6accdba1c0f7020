"""Admin actions, serialised per GPU and per lane, with identical concurrent requests joined.

Sleep, wake, training start and training stop all change what holds a GPU's memory. Run
concurrently some collide: a wake racing a training start fills the GPU twice, a sleep
racing a wake leaves whichever ran last, a stop racing a start may miss the trainer being
spawned. So each GPU has two locks, one per lane: sleep and wake hold the ``vllm`` lane, a
training stop the ``training`` lane, and a training start both (it must not race a wake nor
a stop). A stop thus never waits behind a sleep or wake of its GPU, which can take up to the
admin bound when vLLM hangs: a promotion's first step frees the GPU at once. Every action
takes its locks in one global order (every ``vllm`` lock, then every ``training`` lock, each
by GPU index), so no two actions can deadlock, and its checks run under those locks, against
the state the previous action left.

A request identical to one already queued or running (same action, same parameters) does not
run again: it joins, and every caller gets that one action's result (or error). The action
runs in a task owned here, so a caller that disconnects neither cancels it for the others nor
leaves it untracked at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable
from typing import Final, Literal, TypeVar

_T = TypeVar("_T")

Lane = Literal["vllm", "training"]
"""What of a GPU an action changes: its vLLM servers or its trainers."""

VLLM: Final[tuple[Lane, ...]] = ("vllm",)
TRAINING: Final[tuple[Lane, ...]] = ("training",)
BOTH: Final[tuple[Lane, ...]] = ("vllm", "training")
_LANE_ORDER: Final[dict[Lane, int]] = {"vllm": 0, "training": 1}


class AdminActions:
    """Per-GPU serialization and joining of admin actions."""

    def __init__(self) -> None:
        self._locks: dict[tuple[Lane, int], asyncio.Lock] = {}
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
        *,
        lanes: Collection[Lane],
    ) -> _T:
        """Run ``action`` holding the ``lanes`` locks of ``gpus``, or join the pending ``key``.

        Args:
            key: Identifies the action and its parameters; equal keys join.
            gpus: The GPU indexes the action touches.
            action: The work; it runs once per distinct pending key.
            lanes: What of those GPUs it changes (:data:`VLLM`, :data:`TRAINING`, :data:`BOTH`).

        Returns:
            The action's result (the same for every caller that joined it).
        """
        task = self._pending.get(key)
        if task is None:
            indexes = set(gpus)
            locks = sorted(
                {(lane, gpu) for lane in lanes for gpu in indexes},
                key=lambda lock: (_LANE_ORDER[lock[0]], lock[1]),
            )
            task = asyncio.create_task(self._locked(locks, action), name=f"{key}")
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

    async def _locked(
        self, locks: list[tuple[Lane, int]], action: Callable[[], Awaitable[_T]]
    ) -> _T:
        async with contextlib.AsyncExitStack() as stack:
            for lock in locks:
                await stack.enter_async_context(self._locks.setdefault(lock, asyncio.Lock()))
            return await action()

    async def close(self) -> None:
        """Cancel every pending action and wait for it (application cleanup)."""
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
