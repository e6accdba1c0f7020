"""The route lease's bookkeeping: a kept pointer, the store's record of the lease, move waiters.

With a route lease (``lease_ms`` > 0, ``HARU_ROUTE_LEASE_MS``) requests stop reading the
pointer: each fleet's pointer is kept in memory (:class:`Lease`) with the clock reading at
which the read that confirmed it started. A process keeps a fleet's lease only once the store
holds its lease length (:class:`LeaseRecords`): the promotion that flips the pointer reads the
stored lease after the flip and waits it out (``haru_core.lease_guard_ms``) before it drains
the old active. Requests held for a move wait on :class:`MoveWaiters`. The rules for routing
on a lease live with the cache that applies them (``_route_cache``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from uuid import UUID

from haru_protocol import FleetRoutePointer

from haru_server._single_flight import BoundedReads

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Lease:
    """One fleet's pointer as this process routes it without reading."""

    pointer: FleetRoutePointer
    confirmed_at: float
    """Monotonic reading at which the read that last confirmed the pointer started."""
    seq: int
    used_at: float
    refresher: asyncio.Task[None] | None = None
    unanswered_until: float = 0.0
    """Once expired, fail open without a read until then (a read of it failed just before)."""


class LeaseStore(Protocol):
    """What recording a lease needs of the store (``haru_db.StateStore`` provides it)."""

    async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool: ...


class LeaseRecords:
    """When the store came to hold this process's lease of each fleet (written once per fleet).

    Args:
        store: Where the lease is recorded.
        reads: Runs the bounded write.
        lease_ms: The lease length recorded.
        timeout_s: Bound on one write.
        retry_s: After a failed write, how long before the next one.
        max_fleets: Records kept before they start over (recording again is only a write).
        monotonic: Monotonic seconds.
    """

    def __init__(
        self,
        store: LeaseStore,
        reads: BoundedReads,
        *,
        lease_ms: int,
        timeout_s: float,
        retry_s: float,
        max_fleets: int,
        monotonic: Callable[[], float],
    ) -> None:
        self._store = store
        self._reads = reads
        self._lease_ms = lease_ms
        self._timeout = timeout_s
        self._retry = retry_s
        self._max_fleets = max_fleets
        self._monotonic = monotonic
        self._recorded: dict[UUID, float] = {}
        """fleet id -> monotonic reading once the store held this process's lease."""
        self._recording: dict[UUID, asyncio.Task[None]] = {}
        self._retry_at: dict[UUID, float] = {}

    def held_since(self, fleet_id: UUID) -> float | None:
        """Monotonic reading once the store held the lease, or None (then recording starts)."""
        recorded = self._recorded.get(fleet_id)
        if recorded is None:
            self._start(fleet_id)
        return recorded

    def tasks(self) -> list[asyncio.Task[None]]:
        """The writes in flight (cancelled at shutdown)."""
        return list(self._recording.values())

    def _start(self, fleet_id: UUID) -> None:
        if fleet_id in self._recording or self._monotonic() < self._retry_at.get(fleet_id, 0):
            return
        self._recording[fleet_id] = asyncio.get_running_loop().create_task(
            self._record(fleet_id), name=f"route-lease-record-{fleet_id}"
        )

    async def _record(self, fleet_id: UUID) -> None:
        try:
            await self._reads.run(
                self._store.record_route_lease(fleet_id, self._lease_ms), self._timeout
            )
        except Exception as exc:  # noqa: BLE001 - any failure only means: no lease yet
            self._retry_at[fleet_id] = self._monotonic() + self._retry
            logger.warning(
                "route cache: could not record the route lease of fleet %s (%s); routing "
                "on fresh reads until it is recorded",
                fleet_id,
                exc,
            )
            return
        finally:
            self._recording.pop(fleet_id, None)
        if len(self._recorded) > 4 * self._max_fleets:
            self._recorded.clear()
            self._retry_at.clear()
        self._recorded[fleet_id] = self._monotonic()
        self._retry_at.pop(fleet_id, None)


def _settle(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class MoveWaiters:
    """Requests waiting until this process learns that a fleet's route moved."""

    def __init__(self) -> None:
        self._waiters: dict[UUID, list[asyncio.Future[None]]] = {}

    async def wait(self, fleet_id: UUID, timeout: float) -> None:
        """Wait until :meth:`wake` for ``fleet_id``, or ``timeout`` seconds at the latest."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.setdefault(fleet_id, []).append(waiter)
        timer = loop.call_later(timeout, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            waiters = self._waiters.get(fleet_id)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[fleet_id]

    def wake(self, fleet_id: UUID) -> None:
        """A newer revision of ``fleet_id`` is known: release its waiters."""
        # In arrival order: the futures' callbacks run FIFO, so held requests resume in order.
        for waiter in self._waiters.pop(fleet_id, ()):
            _settle(waiter)
