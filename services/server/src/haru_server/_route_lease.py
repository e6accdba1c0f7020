"""The route lease: kept pointers, their background refreshers, the store's record of the lease.

With a route lease (``lease_ms`` > 0, ``HARU_ROUTE_LEASE_MS``) requests stop reading the
pointer: each fleet's pointer is kept in memory (:class:`Lease`) with the monotonic reading at
which the read that confirmed it started, and re-read every lease by a refresher per fleet
while the fleet is used (:class:`RouteLeases`). A process keeps a fleet's lease only once the
store holds its lease length (:class:`LeaseRecords`): the promotion that flips the pointer
reads the stored lease after the flip and waits it out (``haru_core.lease_guard_ms``) before it
drains the old active. Requests held for a move wait on :class:`MoveWaiters`. When a request
may route on a lease is the cache's rule (``_route_cache``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from uuid import UUID

from haru_db import MalformedFleetStateError, StateStoreUnavailableError
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


@dataclass(frozen=True, slots=True)
class LeaseHooks:
    """What a refresher needs of the cache that keeps the leases.

    Attributes:
        read: A shared pointer read (the pointer or None, and the read's sequence number).
        on_outage: A read failed for want of the store.
        on_answer: A read was answered.
        drop: The fleet's routing must go (the store no longer knows it, or it is malformed).
        reload: Reload the fleet's snapshot if its revision moved or its TTL ran out.
        moved: A newer revision of the fleet is known.
    """

    read: Callable[[str], Awaitable[tuple[FleetRoutePointer | None, int]]]
    on_outage: Callable[[BaseException], None]
    on_answer: Callable[[], None]
    drop: Callable[[UUID, str], None]
    reload: Callable[[str, FleetRoutePointer, int], Awaitable[None]]
    moved: Callable[[UUID], None]


class RouteLeases:
    """The fleets this process routes on a kept pointer, each re-read every lease while used.

    Args:
        records: When the store came to hold this process's lease of each fleet.
        hooks: What the refreshers need of the cache.
        lease_s: The lease.
        window_s: Lease plus the pointer bound: past it, a kept pointer has expired.
        idle_s: A fleet without requests for this long stops being refreshed.
        monotonic: Monotonic seconds.
        sleep: The refresher's pause.
    """

    def __init__(
        self,
        records: LeaseRecords,
        hooks: LeaseHooks,
        *,
        lease_s: float,
        window_s: float,
        idle_s: float,
        monotonic: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self._records = records
        self._hooks = hooks
        self._lease = lease_s
        self.window = window_s
        self._idle = idle_s
        self._monotonic = monotonic
        self._sleep = sleep
        self._leases: dict[UUID, Lease] = {}

    def get(self, fleet_id: UUID) -> Lease | None:
        """The lease kept for ``fleet_id``, or None."""
        return self._leases.get(fleet_id)

    def all(self) -> list[Lease]:
        """Every kept lease."""
        return list(self._leases.values())

    def end(self, fleet_id: UUID) -> None:
        """Stop routing ``fleet_id`` on a kept pointer (its refresher sees that and ends)."""
        self._leases.pop(fleet_id, None)

    def tasks(self) -> list[asyncio.Task[Any]]:
        """The refreshers and lease records in flight (cancelled at shutdown)."""
        return [
            *(lease.refresher for lease in self._leases.values() if lease.refresher),
            *self._records.tasks(),
        ]

    def observe(self, pointer: FleetRoutePointer, next_seq: Callable[[], int]) -> None:
        """A pointer move learned without a read (NOTIFY, or a flip made by this process).

        Moves a kept lease forward at once (never backwards) without extending it: only a
        read proves that no later move happened. Fleets without a kept lease are ignored
        (their first request reads).
        """
        lease = self._leases.get(pointer.id)
        if lease is None or pointer.route_revision <= lease.pointer.route_revision:
            return
        lease.pointer = pointer
        lease.seq = next_seq()
        self._hooks.moved(pointer.id)

    def unanswered(self, lease: Lease) -> None:
        """A read of the lease's pointer failed: fail open without reading for a while.

        As long as the lease's own window (lease + read bound): a flip made after this failure
        is still guarded when it runs out (``haru_core.lease_guard_ms``), and the refresher keeps
        probing meanwhile. The clock reading includes any pause before it, never after it.
        """
        lease.unanswered_until = self._monotonic() + self.window

    def keep_from(self, pointer: FleetRoutePointer, started: float, seq: int) -> None:
        """Keep (or confirm) the lease from a read that started at ``started``.

        A process keeps a fleet's lease only from reads that started after the store held its
        lease (``route_lease_ms``): the promotion that flips the pointer reads the stored lease
        after the flip and waits it out before it drains the old active, so every pointer this
        process keeps from before the flip is covered by that wait. Until then (the record is
        written in the background, once per fleet per process), requests route on their own
        fresh reads, as with ``lease_ms`` = 0.
        """
        recorded = self._records.held_since(pointer.id)
        if recorded is not None and started >= recorded:
            self._confirm(pointer, started, seq)

    def _confirm(self, pointer: FleetRoutePointer, started: float, seq: int) -> None:
        lease = self._leases.get(pointer.id)
        if lease is None:
            lease = self._leases[pointer.id] = Lease(pointer, started, seq, used_at=started)
            moved = False
        else:
            moved = pointer.route_revision > lease.pointer.route_revision
            if pointer.route_revision >= lease.pointer.route_revision:
                lease.pointer = pointer
                lease.seq = max(lease.seq, seq)
            # Even an older revision proves nothing moved past the newer one before `started`.
            if started > lease.confirmed_at:
                lease.confirmed_at = started
                lease.unanswered_until = 0.0
        if lease.refresher is None:
            lease.refresher = asyncio.get_running_loop().create_task(
                self._refresh(pointer.id, lease), name=f"route-lease-{pointer.id}"
            )
        if moved:
            self._hooks.moved(pointer.id)

    async def _refresh(self, fleet_id: UUID, lease: Lease) -> None:
        """Re-confirm one fleet's lease every lease interval while the fleet is used."""
        ref = str(fleet_id)
        try:
            started = lease.confirmed_at
            while self._leases.get(fleet_id) is lease:
                await self._sleep(max(0.0, self._lease - (self._monotonic() - started)))
                started = self._monotonic()
                if self._leases.get(fleet_id) is not lease or started - lease.used_at > self._idle:
                    return
                if not await self._refresh_once(ref, lease, started):
                    return
        finally:
            lease.refresher = None
            if self._leases.get(fleet_id) is lease:
                del self._leases[fleet_id]  # dormant: the next request reads

    async def _refresh_once(self, ref: str, lease: Lease, started: float) -> bool:
        """One refresher round; False when the lease must end."""
        fleet_id = lease.pointer.id
        hooks = self._hooks
        try:
            pointer, seq = await hooks.read(ref)
        except (StateStoreUnavailableError, TimeoutError) as exc:
            hooks.on_outage(exc)
            self.unanswered(lease)
            return True  # keep serving (stale once the lease runs out) and keep trying
        except MalformedFleetStateError as exc:
            hooks.drop(fleet_id, f"its stored state is malformed ({exc})")
            return False
        except Exception:
            logger.exception("route cache: refreshing the lease of fleet %s failed", fleet_id)
            return True
        hooks.on_answer()
        if pointer is None or pointer.id != fleet_id:
            hooks.drop(fleet_id, "the store no longer knows it")
            return False
        self._confirm(pointer, started, seq)
        await hooks.reload(ref, pointer, seq)
        return True
