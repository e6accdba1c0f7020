"""Bounded, coalesced async reads: one read per key in flight, shared by everyone who waits.

Generic (nothing here knows what is read). :class:`BoundedReads` runs a read under a bound of
running time and abandons it (cancelled, held until it ends) past the bound;
:class:`SingleFlight` shares reads of one key between concurrent callers without ever answering
a caller from a read that started before it asked. Their bounds are counted by timers armed
with the running loop's ``call_later`` unless another is injected (tests move it by hand).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")

_BOUND_STEPS: Final = 4


class Timer(Protocol):
    """An armed timer (``asyncio.TimerHandle``)."""

    def cancel(self) -> None: ...


CallLater = Callable[[float, Callable[[], object]], Timer]
"""Arms a timer: ``call_later(delay_s, callback)``, as ``loop.call_later``."""


async def wait_running(
    awaited: asyncio.Future[Any], timeout: float, call_later: CallLater | None = None
) -> bool:
    """Wait until ``awaited`` is done or ``timeout`` seconds passed while this process ran.

    Counted in quarters, each as long as it was meant to be however late its timer fired: a
    process that stood still (SIGSTOP, a suspended VM) wakes to overdue timers, and a single
    timer would fail at once a read that had no time to answer. This way a pause costs at most
    one quarter, so a read fails only after three quarters of its bound of running time.

    ``call_later`` arms the quarters' timers (default: the running loop's).

    Returns:
        Whether ``awaited`` is done.
    """
    loop = asyncio.get_running_loop()
    arm = loop.call_later if call_later is None else call_later
    step = timeout / _BOUND_STEPS
    for _ in range(_BOUND_STEPS):
        waiter = loop.create_future()

        def wake(_: object = None, waiter: asyncio.Future[None] = waiter) -> None:
            if not waiter.done():
                waiter.set_result(None)

        awaited.add_done_callback(wake)
        timer = arm(step, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            awaited.remove_done_callback(wake)
        if awaited.done():
            return True
    return False


class BoundedReads:
    """Runs reads under a bound; a read past its bound is abandoned, not waited for.

    Args:
        call_later: Arms the timers counting the bounds (default: the running loop's).
    """

    def __init__(self, *, call_later: CallLater | None = None) -> None:
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._call_later = call_later

    async def run(self, read: Coroutine[Any, Any, R], timeout: float) -> R:
        """Await ``read`` for at most ``timeout`` seconds, or raise :class:`TimeoutError`.

        The read runs in its own task that is abandoned (cancelled, and held until it ends)
        when the bound passes: a driver may take seconds to acknowledge a cancellation (psycopg
        first tries to cancel the query on the server), and a hung store must cost the caller
        the bound, not that.
        """
        task = asyncio.get_running_loop().create_task(read)
        try:
            done = await wait_running(task, timeout, self._call_later)
        except BaseException:
            self._abandon(task)  # the caller itself was cancelled
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError
        return task.result()

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: an abandoned read's outcome is irrelevant
            return
        task.cancel()
        self._abandoned.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()

    def tasks(self) -> list[asyncio.Task[Any]]:
        """The abandoned reads that have not ended yet (cancelled at shutdown)."""
        return list(self._abandoned)


@dataclass(frozen=True, slots=True)
class _Outcome(Generic[V]):
    value: V
    seq: int


@dataclass(frozen=True, slots=True)
class _Failed:
    error: Exception
    seq: int


@dataclass(slots=True)
class _Batch(Generic[V]):
    """One key's read in flight, and the batch waiting for the next one."""

    running: asyncio.Future[_Outcome[V] | _Failed] | None = None
    queued: asyncio.Future[_Outcome[V] | _Failed] | None = None
    driver: asyncio.Task[None] | None = None


class SingleFlight(Generic[K, V]):
    """Coalesced reads per key, each answered only from a read that started after it asked.

    A caller arriving while a read of the same key is in flight waits for the next read, which
    starts when that one ends and serves everyone who queued meanwhile. So a change committed
    before a caller asked is seen by it, while the source sees at most one read per key at a
    time however many callers arrive.

    Args:
        fetch: Performs one read of a key; its second argument is the read's sequence number.
            What it raises (an :class:`Exception`) is raised to every caller of that read.
        next_seq: Numbers reads in the order they start (later numbers carry newer knowledge).
        call_later: Arms the timers counting the callers' bounds (default: the running loop's).
    """

    def __init__(
        self,
        fetch: Callable[[K, int], Awaitable[V]],
        *,
        next_seq: Callable[[], int],
        call_later: CallLater | None = None,
    ) -> None:
        self._fetch = fetch
        self._next_seq = next_seq
        self._call_later = call_later
        self._batches: dict[K, _Batch[V]] = {}

    async def read(self, key: K, timeout: float) -> tuple[V, int]:
        """The value of ``key`` from a read that STARTED after this call, and its number.

        Raises:
            TimeoutError: No answer within ``timeout`` seconds of running time (the read goes
                on for the other callers).
            Exception: Whatever the read raised.
        """
        loop = asyncio.get_running_loop()
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch()
        if batch.driver is None:
            shared = batch.running = loop.create_future()
            batch.driver = loop.create_task(self._drive(key, batch))
        else:
            if batch.queued is None:
                batch.queued = loop.create_future()
            shared = batch.queued
        # Waited for without ever cancelling it for the other callers.
        if not await wait_running(shared, timeout, self._call_later):
            raise TimeoutError
        outcome = shared.result()
        if isinstance(outcome, _Failed):
            raise outcome.error
        return outcome.value, outcome.seq

    async def _drive(self, key: K, batch: _Batch[V]) -> None:
        """Run reads of ``key`` back to back while callers keep queueing for one."""
        try:
            shared = batch.running
            while shared is not None:
                seq = self._next_seq()
                outcome: _Outcome[V] | _Failed
                try:
                    outcome = _Outcome(await self._fetch(key, seq), seq)
                except Exception as exc:  # noqa: BLE001 - handed to the callers, who raise it
                    outcome = _Failed(exc, seq)
                if not shared.done():
                    shared.set_result(outcome)
                shared = batch.running = batch.queued
                batch.queued = None
        finally:
            batch.driver = None
            batch.running = None
            if batch.queued is None and self._batches.get(key) is batch:
                del self._batches[key]

    def tasks(self) -> list[asyncio.Task[None]]:
        """The reads in flight (cancelled at shutdown)."""
        return [b.driver for b in self._batches.values() if b.driver is not None]
