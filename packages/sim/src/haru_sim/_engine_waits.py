"""How the emulated engine waits: change broadcasts, bounded waits, shutdown, detached calls.

Every request and admin call inside the engine waits for a condition on its state; any state
change wakes all waiters to re-check theirs. Shutdown releases them all with
:class:`ServerClosingError`; admin calls run detached, so a client that leaves does not cut a
sleep or wake short.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class ServerClosingError(Exception):
    """The server is shutting down; a request waiting inside it must drop its connection."""


class EngineWaits:
    """The waiting machinery the engine's state changes drive (the base of ``Engine``)."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()
        self._closing = False
        self._detached: set[asyncio.Task[Any]] = set()
        # Runs until close (the engine-step clock); cancelled by close, awaited at shutdown.
        self._background: asyncio.Task[None] | None = None

    @property
    def closing(self) -> bool:
        return self._closing

    def _notify(self) -> None:
        # Broadcast: wake every waiter, which re-checks its own condition.
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(
        self, condition: Callable[[], bool], timeout: float | None = None
    ) -> bool:
        """Wait until ``condition()`` holds (True) or ``timeout`` seconds pass (False).

        Raises:
            ServerClosingError: The server started shutting down.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closing:
                raise ServerClosingError
            if condition():
                return True
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass

    async def delay(self, seconds: float) -> None:
        """Sleep ``seconds`` unless the server shuts down first (then raise)."""
        if seconds > 0:
            await self._wait_until(lambda: False, seconds)
        elif self._closing:
            raise ServerClosingError

    def close(self) -> None:
        """Release every waiting request: the server is shutting down."""
        self._closing = True
        if self._background is not None:
            self._background.cancel()
        self._notify()

    async def run_detached(self, operation: Coroutine[Any, Any, _T]) -> _T:
        """Run ``operation`` to its end even if the caller is cancelled.

        A vLLM sleep or wake goes on when its HTTP client disconnects; the server cancels a
        handler whose client went away (which is what aborts generations), so admin calls
        run in a task the engine holds and awaits at shutdown.
        """
        task = asyncio.create_task(operation)
        self._detached.add(task)
        task.add_done_callback(self._detached_done)
        return await asyncio.shield(task)

    def _detached_done(self, task: asyncio.Task[Any]) -> None:
        self._detached.discard(task)
        # Retrieve the outcome so an operation whose caller left does not warn at exit.
        if not task.cancelled() and task.exception() is not None:
            logger.info("detached admin operation ended with %r", task.exception())

    async def wait_detached(self) -> None:
        """Wait for detached admin operations (they end quickly once :meth:`close` ran)."""
        background = [self._background] if self._background is not None else []
        tasks = [*self._detached, *background]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
