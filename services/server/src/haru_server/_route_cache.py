"""The proxy's routing cache: fresh when the store answers, fail-open only when it cannot.

Every request reads the fleet's narrow route pointer (one small SELECT). A cached snapshot is
reused while its ``routeRevision`` matches the pointer and its TTL (non-routing state such as
slot health) has not run out; otherwise a fresh snapshot is loaded. The failure rules
(DESIGN 7.5):

- the pointer read FAILS (store unreachable or slower than its bound): serve the last snapshot
  this process cached for the fleet, marked stale; nothing cached means 503. This is safe
  because the pointer cannot move while the store is down: moving it needs the very
  compare-and-swap that is failing.
- the pointer read succeeds but the snapshot load fails: serve the cache (stale) only when it
  is at the pointer's revision; otherwise 503, and the entry is dropped so a later outage can
  never resurrect routing known to be superseded. Malformed state is never served.
- the pointer read returns nothing: 404, and the spelling's index (and the entry it named) is
  forgotten. A read that throws is never confused with one that returns nothing.

With a route lease (``lease_ms`` > 0, ``HARU_ROUTE_LEASE_MS``) requests stop reading the
pointer: each fleet's pointer is kept in memory with the clock reading at which the read that
confirmed it started. Requests route with it at once; a background refresher per fleet
(single-flight, only while the fleet had a request within ``idle_ms``) re-reads it every lease
and reloads the snapshot when the revision moved or its TTL ran out. A notified move
(:meth:`RouteCache.observe`: PostgreSQL NOTIFY, or a flip made by this process) replaces the
pointer at once but never extends the lease. A pointer not confirmed for longer than the
lease plus the read bound has expired and is never routed on before a read was tried: the
request reads (shared, bounded), and serves the old pointer marked stale only when that read,
or one of the fleet's reads within the last lease window, failed (the store does not answer,
so the pointer cannot move). A process that stood still (SIGSTOP: the monotonic clock runs
on) thus reads before it routes again. Read bounds count time the process ran, so a read in
flight across a pause is not failed at once. A fleet that went idle is dormant: its next
request reads the pointer like a cold start. A request waits on the store only then, or to
load the snapshot of a revision it has not seen. ``lease_ms`` = 0 keeps one coalesced pointer
read per request.

Entries are keyed by fleet id; each accepted spelling (slug, id in any case) is indexed onto
the id with the database's id-first rule, and a slug that looks like a UUID is never an alias.
Newer knowledge always wins: loads of one fleet are serialised, a load whose fleet received a
verdict (drop, forget) while it was in flight is served but not cached, a lower revision never
replaces a higher one, and an index change only applies when its pointer read started after
the last one recorded for that spelling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar
from uuid import UUID

from haru_core import ROUTE_READ_BOUND_MS
from haru_db import MalformedFleetStateError, StateStoreUnavailableError
from haru_protocol import ErrorCode, FleetRoutePointer, FleetSnapshot, parse_fleet_ref
from haru_web import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_POINTER_TIMEOUT_MS = ROUTE_READ_BOUND_MS
"""Bound on the pointer read (``haru_core.ROUTE_READ_BOUND_MS``): the route guard counts on it."""
DEFAULT_SNAPSHOT_TIMEOUT_MS = 2_000
"""Bound on a snapshot load (several statements on a cold connection)."""
DEFAULT_OUTAGE_MEMO_MS = 1_000
"""After a failed pointer read, serve stale without asking the store for this long (one probe
at a time afterwards), so an outage costs one bounded wait per second, not one per request."""
DEFAULT_MAX_FLEETS = 1_024
"""Entries kept (least recently used evicted first)."""
DEFAULT_ROUTE_LEASE_MS = 300
"""``HARU_ROUTE_LEASE_MS``: how often a process re-confirms a routed fleet's pointer. A few
hundred ms: a flip missed by NOTIFY is seen within it, the old active's drain waits it out
(``haru_core.lease_guard_ms``), and the store sees about three pointer reads per second per
fleet per process whatever the request rate."""
DEFAULT_LEASE_IDLE_MS = 30_000
"""A fleet without a request for this long stops being refreshed (its next request reads)."""
RETRY_AFTER_S: Final = 1
"""``Retry-After`` (seconds) of a request failed for want of a route (503): a failover or a
store outage is over in seconds, and a client that waits one second does not add to a storm."""
_RETRY_AFTER: Final = {"Retry-After": str(RETRY_AFTER_S)}


class RouteSource(Protocol):
    """What the cache needs of the store (``haru_db.StateStore`` provides it)."""

    async def get_fleet_route_pointer(self, ref: str) -> FleetRoutePointer | None: ...

    async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None: ...

    async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class RouteLookup(Generic[T]):
    """What the cache answers for one request.

    Attributes:
        fleet_id: The fleet the reference resolved to.
        snapshot: The snapshot to route with.
        routes: What the cache's ``build`` callable derived from ``snapshot`` (built once per
            cached snapshot, not per request).
        stale: The store could not confirm this routing (answer with ``X-Haru-Routing: stale``).
    """

    fleet_id: UUID
    snapshot: FleetSnapshot
    routes: T
    stale: bool


@dataclass(slots=True)
class _Entry(Generic[T]):
    snapshot: FleetSnapshot
    routes: T
    loaded_at: float
    """Clock reading taken when the load that produced it started."""
    aliases: set[str] = field(default_factory=set)
    load_failed_until: float = 0.0
    """A snapshot load at this revision failed; until then, skip reloading and serve stale."""

    @property
    def revision(self) -> int:
        return self.snapshot.route_revision


@dataclass(slots=True)
class _Lease:
    pointer: FleetRoutePointer
    confirmed_at: float
    """Clock reading at which the read that last confirmed the pointer started."""
    seq: int
    used_at: float
    refresher: asyncio.Task[None] | None = None
    unanswered_until: float = 0.0
    """Once expired, fail open without a read until then (a read of it failed just before)."""


@dataclass(frozen=True, slots=True)
class _Outcome:
    pointer: FleetRoutePointer | None
    error: Exception | None
    seq: int


@dataclass(slots=True)
class _ReadBatch:
    """One reference's pointer read in flight, and the batch waiting for the next one."""

    running: asyncio.Future[_Outcome] | None = None
    queued: asyncio.Future[_Outcome] | None = None
    driver: asyncio.Task[None] | None = None


class RouteCache(Generic[T]):
    """Per-process routing cache with the fail-open rules of DESIGN 7.5.

    Args:
        store: Where pointers and snapshots come from.
        build: Derives the per-snapshot routing structure handed back in
            :attr:`RouteLookup.routes` (called once per loaded snapshot).
        ttl_ms: How long a snapshot at the current revision is reused before a reload
            (``HARU_SNAPSHOT_CACHE_TTL_MS``).
        pointer_timeout_ms: Bound on the pointer read of a request that has cached routing to
            fall back on; slower counts as unreachable.
        snapshot_timeout_ms: Bound on a snapshot load, and on the pointer read of a request
            with nothing cached to fall back on (it could only answer 503 sooner).
        outage_memo_ms: After a failed pointer read, serve stale without reading for this long.
        max_fleets: Entries kept; the least recently used is evicted beyond it.
        lease_ms: Route lease (0: read the pointer on every request).
        idle_ms: A leased fleet without requests for this long stops being refreshed.
        clock: Monotonic seconds (injected by tests).
        sleep: The refresher's pause (injected by tests).
    """

    def __init__(
        self,
        store: RouteSource,
        *,
        build: Callable[[FleetSnapshot], T],
        ttl_ms: int,
        pointer_timeout_ms: int = DEFAULT_POINTER_TIMEOUT_MS,
        snapshot_timeout_ms: int = DEFAULT_SNAPSHOT_TIMEOUT_MS,
        outage_memo_ms: int = DEFAULT_OUTAGE_MEMO_MS,
        max_fleets: int = DEFAULT_MAX_FLEETS,
        lease_ms: int = 0,
        idle_ms: int = DEFAULT_LEASE_IDLE_MS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if max_fleets < 1:
            raise ValueError(f"max_fleets must be >= 1, got {max_fleets}")
        self._store = store
        self._build = build
        self._ttl = ttl_ms / 1000
        self._pointer_timeout = pointer_timeout_ms / 1000
        self._snapshot_timeout = snapshot_timeout_ms / 1000
        self._read_bound = max(self._pointer_timeout, self._snapshot_timeout)
        """How long one pointer read may run (the wait of a request with nothing cached)."""
        self._outage_memo = outage_memo_ms / 1000
        self._max_fleets = max_fleets
        self._clock = clock
        self._entries: OrderedDict[UUID, _Entry[T]] = OrderedDict()
        self._aliases: dict[str, tuple[UUID, int]] = {}
        """spelling key -> (fleet id, sequence number of the pointer read that taught it)."""
        self._forgotten: OrderedDict[str, int] = OrderedDict()
        """spelling key -> sequence number of the read that disclaimed it (bounded)."""
        self._verdicts: dict[UUID, int] = {}
        """fleet id -> count of drops; a load that saw the count change is not cached."""
        self._locks: weakref.WeakValueDictionary[UUID, asyncio.Lock] = weakref.WeakValueDictionary()
        self._seq = 0
        self._outage = False
        self._outage_until = 0.0
        self._probing = False
        self._stale: set[UUID] = set()
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._reads: dict[str, _ReadBatch] = {}
        self._lease = lease_ms / 1000
        self._lease_ms = lease_ms
        self._stale_after = self._lease + self._pointer_timeout
        self._idle = idle_ms / 1000
        self._sleep = sleep
        self._leases: dict[UUID, _Lease] = {}
        self._movers: dict[UUID, list[asyncio.Future[None]]] = {}
        self._recorded: dict[UUID, float] = {}
        """fleet id -> clock reading once the store held this process's lease (_record_lease)."""
        self._recording: dict[UUID, asyncio.Task[None]] = {}
        self._record_retry_at: dict[UUID, float] = {}
        self._promoting: dict[UUID, tuple[int, float | None]] = {}
        """fleet id -> (sequence number of the newest read, clock reading at which this process
        first saw the promotion in flight that read saw; None: none in flight)."""

    # -- introspection (tests, diagnostics) ---------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def cached_revision(self, fleet_id: UUID) -> int | None:
        """The revision cached for ``fleet_id``, or None when nothing is cached."""
        entry = self._entries.get(fleet_id)
        return None if entry is None else entry.revision

    def indexed(self, ref: str) -> UUID | None:
        """The fleet id a spelling is indexed onto, or None."""
        alias = self._aliases.get(parse_fleet_ref(ref).key)
        return None if alias is None else alias[0]

    def leased(self, fleet_id: UUID) -> FleetRoutePointer | None:
        """The pointer this process routes ``fleet_id`` with while its lease is kept, or None."""
        lease = self._leases.get(fleet_id)
        return None if lease is None else lease.pointer

    def lease_ages(self) -> dict[str, float]:
        """Seconds since each leased fleet's pointer was last confirmed, by fleet slug.

        The age of the pointer this process routes on without reading (measured from the start
        of the read that confirmed it, on this process's clock); only fleets with a kept lease
        appear (none with ``lease_ms`` = 0: every request reads).
        """
        now = self._clock()
        return {
            lease.pointer.slug: max(now - lease.confirmed_at, 0.0)
            for lease in self._leases.values()
        }

    def refreshing(self, fleet_id: UUID) -> bool:
        """Whether a background refresher keeps ``fleet_id``'s lease confirmed."""
        lease = self._leases.get(fleet_id)
        return lease is not None and lease.refresher is not None

    def promotion_in_flight(self, fleet_id: UUID) -> bool:
        """Whether the newest pointer read (or :meth:`note_promotion`) saw a promotion in flight.

        As current as the lease: a process that routes the fleet reads the pointer once per
        lease interval, and the flag rides that read.
        """
        return self.promotion_since(fleet_id) is not None

    def promotion_since(self, fleet_id: UUID) -> float | None:
        """Clock reading at which this process first saw the promotion now in flight, or None.

        The pointer read carries only whether a promotion is in flight, so this is the
        earliest moment this process can vouch for: the operation started at or before it,
        and its step budgets run out no later than that plus their sum. A promotion that ends
        and another that starts between two reads look like one (the earlier sighting stays).
        """
        known = self._promoting.get(fleet_id)
        return None if known is None else known[1]

    def note_promotion(self, fleet_id: UUID) -> None:
        """This process accepted a promotion of ``fleet_id``: know it before the next read."""
        self._seq += 1
        self._note_promoting(fleet_id, self._seq, in_flight=True)

    def _note_promoting(self, fleet_id: UUID, seq: int, *, in_flight: bool) -> None:
        known = self._promoting.get(fleet_id)
        if known is not None and known[0] > seq:
            return  # an older read finishing late (another spelling's) teaches nothing
        since = None
        if in_flight:
            since = known[1] if known is not None and known[1] is not None else self._clock()
        self._promoting[fleet_id] = (seq, since)
        if len(self._promoting) > 4 * self._max_fleets:
            self._promoting = {
                k: v for k, v in self._promoting.items() if k in self._entries or k == fleet_id
            }

    @property
    def in_outage(self) -> bool:
        """Whether the last pointer read failed (and none has succeeded since)."""
        return self._outage

    async def aclose(self) -> None:
        """Cancel and wait for the reads in flight or abandoned after their bound (shutdown)."""
        tasks = [
            *self._abandoned,
            *(b.driver for b in self._reads.values() if b.driver),
            *(lease.refresher for lease in self._leases.values() if lease.refresher),
            *self._recording.values(),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- bounded store reads ------------------------------------------------------------------

    async def _bounded(self, read: Coroutine[Any, Any, R], timeout: float) -> R:
        """Await ``read`` for at most ``timeout`` seconds, or raise :class:`TimeoutError`.

        The read runs in its own task that is abandoned (cancelled, and held until it ends)
        when the bound passes: a driver may take seconds to acknowledge a cancellation (psycopg
        first tries to cancel the query on the server), and a hung store must cost the request
        the bound, not that.
        """
        task = asyncio.get_running_loop().create_task(read)
        try:
            done = await _wait_running(task, timeout)
        except BaseException:
            self._abandon(task)  # the request itself was cancelled
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
        task.add_done_callback(self._forget_abandoned)

    def _forget_abandoned(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()

    # -- coalesced pointer reads ---------------------------------------------------------------

    async def _read_pointer(
        self, ref: str, *, wait_s: float | None = None
    ) -> tuple[FleetRoutePointer | None, int]:
        """The pointer ``ref`` names, from a read that STARTED after this call.

        ``wait_s`` bounds the wait (default: the pointer bound). A read itself may run up to
        the snapshot bound, so a caller with nothing cached can wait for it while callers
        with a fallback stop waiting at the pointer bound.

        Concurrent requests share reads: one arriving while a read of the same ``ref`` is in
        flight waits for the next read, which starts when that one ends and serves everyone
        who queued meanwhile. No request is ever answered from a read that began before it
        arrived, so a committed pointer move is seen by every later request, while the store
        sees at most one pointer read per reference at a time however many requests arrive.

        Returns:
            The pointer (None: no such fleet) and the read's sequence number (reads are
            numbered in the order they start; later numbers carry newer knowledge).

        Raises:
            StateStoreUnavailableError: The read failed.
            TimeoutError: No answer within the pointer bound.
            MalformedFleetStateError: The stored fleet row is malformed.
        """
        loop = asyncio.get_running_loop()
        batch = self._reads.get(ref)
        if batch is None:
            batch = self._reads[ref] = _ReadBatch()
        if batch.driver is None:
            shared = batch.running = loop.create_future()
            batch.driver = loop.create_task(self._drive(ref, batch))
        else:
            if batch.queued is None:
                batch.queued = loop.create_future()
            shared = batch.queued
        outcome = await self._await_shared(shared, wait_s or self._pointer_timeout)
        if outcome.error is not None:
            raise outcome.error
        return outcome.pointer, outcome.seq

    async def _drive(self, ref: str, batch: _ReadBatch) -> None:
        """Run reads for ``ref`` back to back while requests keep queueing for one."""
        try:
            shared = batch.running
            while shared is not None:
                self._seq += 1
                seq = self._seq
                try:
                    pointer = await self._bounded(
                        self._store.get_fleet_route_pointer(ref), self._read_bound
                    )
                    if pointer is not None:
                        self._note_promoting(pointer.id, seq, in_flight=pointer.promotion_in_flight)
                    outcome = _Outcome(pointer, None, seq)
                except (StateStoreUnavailableError, TimeoutError, MalformedFleetStateError) as exc:
                    outcome = _Outcome(None, exc, seq)
                except Exception as exc:
                    logger.exception("route cache: pointer read of %r failed unexpectedly", ref)
                    outcome = _Outcome(None, exc, seq)  # the waiters answer 500, not hang
                if not shared.done():
                    shared.set_result(outcome)
                shared = batch.running = batch.queued
                batch.queued = None
        finally:
            batch.driver = None
            batch.running = None
            if batch.queued is None and self._reads.get(ref) is batch:
                del self._reads[ref]

    @staticmethod
    async def _await_shared(shared: asyncio.Future[_Outcome], timeout: float) -> _Outcome:
        """Wait for a shared read without ever cancelling it for the other waiters."""
        if not await _wait_running(shared, timeout):
            raise TimeoutError
        return shared.result()

    # -- the request path ---------------------------------------------------------------------

    async def resolve(self, ref: str) -> RouteLookup[T]:
        """Routing for the fleet ``ref`` names, fresh when the store answers.

        Raises:
            ApiError: ``fleet_not_found`` (404) when the store says no such fleet exists;
                ``state_store_unavailable`` (503) when routing cannot be served safely.
        """
        key = _cache_key(ref)
        if self._lease:
            alias = self._aliases.get(key)
            lease = None if alias is None else self._leases.get(alias[0])
            if lease is not None and lease.refresher is not None:
                now = self._clock()
                lease.used_at = now
                if now - lease.confirmed_at <= self._stale_after:
                    return await self._resolve_leased(ref, key, lease)
                # Expired: the refresher's reads fail, or this process stood still (SIGSTOP: the
                # monotonic clock ran on, the pointer may have moved and the old active may
                # sleep by now). Route only after a read, failing open only when the store
                # did not answer one: this request's, or one of this fleet that failed since
                # the lease ran out (the memo is no longer than the lease's own window).
                if now < lease.unanswered_until:
                    return await self._stale_lease(ref, key, lease)
                return await self._resolve_read(ref, key, lease)
        return await self._resolve_read(ref, key, None)

    async def _resolve_read(self, ref: str, key: str, expired: _Lease | None) -> RouteLookup[T]:
        """Routing from a pointer read (shared with the requests that arrive meanwhile).

        ``expired``: the lease this request may not route on without a read; the process-wide
        outage memo never stands in for that read.
        """
        # With nothing cached for this spelling there is nothing to fail open to: a quick
        # timeout or the outage memo could only turn a slow read into a 503 (a process that
        # just started, on a loaded machine: docs/FAULTS.md, finding 7). Such a request reads
        # (sharing the read in flight) and waits up to the snapshot bound.
        cold = self._cached(key) is None
        probe = self._outage and not cold and expired is None
        started = self._clock()
        if probe:
            if self._probing or self._clock() < self._outage_until:
                return self._serve_stale(ref, key, "the state store is unreachable")
            self._probing = True  # one probe at a time; the others keep serving stale
        try:
            try:
                pointer, seq = await self._read_pointer(
                    ref, wait_s=self._read_bound if cold else None
                )
            finally:
                if probe:
                    self._probing = False
        except (StateStoreUnavailableError, TimeoutError) as exc:
            self._enter_outage(exc)
            if expired is not None and self._leases.get(expired.pointer.id) is expired:
                self._unanswered(expired)
                return await self._stale_lease(ref, key, expired)
            return self._serve_stale(ref, key, "the state store is unreachable")
        except MalformedFleetStateError as exc:
            self._leave_outage()
            alias = self._aliases.get(key)
            if alias is not None:
                self._drop(alias[0], why="its stored state is malformed")
            raise self._malformed(ref, exc) from exc
        self._leave_outage()
        if pointer is None:
            self._forget(key, seq)
            raise ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {ref!r} not found")
        if self._lease:
            self._lease_from(pointer, started, seq)
        entry = self._entries.get(pointer.id)
        now = self._clock()
        if entry is not None and entry.revision >= pointer.route_revision:
            if now - entry.loaded_at < self._ttl:
                return self._hit(entry, pointer.id, key, seq)
            if now < entry.load_failed_until and entry.revision == pointer.route_revision:
                self._learn(entry, pointer, key, seq)
                return self._stale_hit(entry, pointer.id, "its snapshot failed to load")
        return await self._load(ref, key, pointer, seq)

    async def _resolve_leased(self, ref: str, key: str, lease: _Lease) -> RouteLookup[T]:
        pointer = lease.pointer
        entry = self._entries.get(pointer.id)
        if entry is not None and entry.revision >= pointer.route_revision:
            return self._hit(entry, pointer.id, key, lease.seq)
        return await self._load(ref, key, pointer, lease.seq)

    async def _stale_lease(self, ref: str, key: str, lease: _Lease) -> RouteLookup[T]:
        """Fail open on an expired lease: a read of its pointer just failed."""
        pointer = lease.pointer
        entry = self._entries.get(pointer.id)
        if entry is not None and entry.revision >= pointer.route_revision:
            return self._stale_hit(
                entry, pointer.id, "the state store has not confirmed the route lease"
            )
        return await self._load(ref, key, pointer, lease.seq)

    def _unanswered(self, lease: _Lease) -> None:
        """A read of the lease's pointer failed: fail open without reading for a while.

        As long as the lease's own window (lease + read bound): a flip made after this failure
        is still guarded when it runs out (``haru_core.lease_guard_ms``), and the refresher keeps
        probing meanwhile. The clock reading includes any pause before it, never after it.
        """
        lease.unanswered_until = self._clock() + self._stale_after

    # -- route leases ---------------------------------------------------------------------------

    def observe(self, pointer: FleetRoutePointer) -> None:
        """A pointer move learned without a read (NOTIFY, or a flip made by this process).

        Moves a kept lease forward at once (never backwards) without extending it: only a
        read proves that no later move happened. Fleets this process does not route are
        ignored (their first request reads).
        """
        lease = self._leases.get(pointer.id)
        if lease is None or pointer.route_revision <= lease.pointer.route_revision:
            return
        self._seq += 1
        lease.pointer = pointer
        lease.seq = self._seq
        self._wake_movers(pointer.id)

    async def wait_moved(self, fleet_id: UUID, revision: int, timeout: float) -> None:
        """Wait until this process learns a revision of ``fleet_id`` above ``revision``.

        Returns after ``timeout`` seconds at the latest.
        """
        if self._known_revision(fleet_id) > revision:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._movers.setdefault(fleet_id, []).append(waiter)
        timer = loop.call_later(timeout, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            waiters = self._movers.get(fleet_id)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._movers[fleet_id]

    def _known_revision(self, fleet_id: UUID) -> int:
        lease = self._leases.get(fleet_id)
        entry = self._entries.get(fleet_id)
        return max(
            -1 if lease is None else lease.pointer.route_revision,
            -1 if entry is None else entry.revision,
        )

    def _wake_movers(self, fleet_id: UUID) -> None:
        # In arrival order: the futures' callbacks run FIFO, so held requests resume in order.
        for waiter in self._movers.pop(fleet_id, ()):
            _settle(waiter)

    def _lease_from(self, pointer: FleetRoutePointer, started: float, seq: int) -> None:
        """Keep (or confirm) the lease from a read that started at ``started``.

        A process keeps a fleet's lease only from reads that started after the store held its
        lease (``route_lease_ms``): the promotion that flips the pointer reads the stored lease
        after the flip and waits it out before it drains the old active, so every pointer this
        process keeps from before the flip is covered by that wait. Until then (the record is
        written in the background, once per fleet per process), requests route on their own
        fresh reads, as with ``lease_ms`` = 0.
        """
        recorded = self._recorded.get(pointer.id)
        if recorded is None:
            self._start_recording(pointer.id)
        elif started >= recorded:
            self._confirm(pointer, started, seq)

    def _start_recording(self, fleet_id: UUID) -> None:
        if fleet_id in self._recording or self._clock() < self._record_retry_at.get(fleet_id, 0):
            return
        self._recording[fleet_id] = asyncio.get_running_loop().create_task(
            self._record_lease(fleet_id), name=f"route-lease-record-{fleet_id}"
        )

    async def _record_lease(self, fleet_id: UUID) -> None:
        try:
            await self._bounded(
                self._store.record_route_lease(fleet_id, self._lease_ms), self._snapshot_timeout
            )
        except Exception as exc:  # noqa: BLE001 - any failure only means: no lease yet
            self._record_retry_at[fleet_id] = self._clock() + self._outage_memo
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
            self._recorded.clear()  # recording again is only a write
            self._record_retry_at.clear()
        self._recorded[fleet_id] = self._clock()
        self._record_retry_at.pop(fleet_id, None)

    def _confirm(self, pointer: FleetRoutePointer, started: float, seq: int) -> None:
        lease = self._leases.get(pointer.id)
        if lease is None:
            lease = self._leases[pointer.id] = _Lease(pointer, started, seq, used_at=started)
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
            self._wake_movers(pointer.id)

    async def _refresh(self, fleet_id: UUID, lease: _Lease) -> None:
        """Re-confirm one fleet's lease every lease interval while the fleet is used."""
        ref = str(fleet_id)
        try:
            started = lease.confirmed_at
            while self._leases.get(fleet_id) is lease:
                await self._sleep(max(0.0, self._lease - (self._clock() - started)))
                started = self._clock()
                if self._leases.get(fleet_id) is not lease or started - lease.used_at > self._idle:
                    return
                if not await self._refresh_once(ref, lease, started):
                    return
        finally:
            lease.refresher = None
            if self._leases.get(fleet_id) is lease:
                del self._leases[fleet_id]  # dormant: the next request reads

    async def _refresh_once(self, ref: str, lease: _Lease, started: float) -> bool:
        """One refresher round; False when the lease must end."""
        fleet_id = lease.pointer.id
        try:
            pointer, seq = await self._read_pointer(ref)
        except (StateStoreUnavailableError, TimeoutError) as exc:
            self._enter_outage(exc)
            self._unanswered(lease)
            return True  # keep serving (stale once the lease runs out) and keep trying
        except MalformedFleetStateError as exc:
            self._drop(fleet_id, why=f"its stored state is malformed ({exc})")
            return False
        except Exception:
            logger.exception("route cache: refreshing the lease of fleet %s failed", fleet_id)
            return True
        self._leave_outage()
        if pointer is None or pointer.id != fleet_id:
            self._drop(fleet_id, why="the store no longer knows it")
            return False
        self._confirm(pointer, started, seq)
        entry = self._entries.get(fleet_id)
        if entry is not None and (
            entry.revision < pointer.route_revision or self._clock() - entry.loaded_at >= self._ttl
        ):
            with contextlib.suppress(ApiError):  # logged where it is raised
                await self._load(ref, ref, pointer, seq)
        return True

    def _hit(self, entry: _Entry[T], fleet_id: UUID, key: str, seq: int) -> RouteLookup[T]:
        self._entries.move_to_end(fleet_id)
        alias = self._aliases.get(key)
        if alias is None or alias[0] != fleet_id:
            self._learn_key(entry, fleet_id, key, seq)
        if fleet_id in self._stale:
            self._leave_stale(fleet_id, entry)
        return RouteLookup(fleet_id, entry.snapshot, entry.routes, stale=False)

    def _stale_hit(self, entry: _Entry[T], fleet_id: UUID, why: str) -> RouteLookup[T]:
        self._entries.move_to_end(fleet_id)
        self._enter_stale(fleet_id, entry, why)
        return RouteLookup(fleet_id, entry.snapshot, entry.routes, stale=True)

    async def _load(
        self, ref: str, key: str, pointer: FleetRoutePointer, seq: int
    ) -> RouteLookup[T]:
        fleet_id = pointer.id
        lock = self._locks.get(fleet_id)
        if lock is None:
            lock = self._locks[fleet_id] = asyncio.Lock()
        async with lock:
            # Another request may have loaded this revision while this one waited.
            entry = self._entries.get(fleet_id)
            started = self._clock()
            if (
                entry is not None
                and entry.revision >= pointer.route_revision
                and started - entry.loaded_at < self._ttl
            ):
                return self._hit(entry, fleet_id, key, seq)
            verdicts = self._verdicts.get(fleet_id, 0)
            try:
                snapshot = await self._bounded(
                    self._store.get_fleet_snapshot(str(fleet_id)), self._snapshot_timeout
                )
            except (StateStoreUnavailableError, TimeoutError) as exc:
                return self._load_failed(ref, key, pointer, seq, exc)
            except MalformedFleetStateError as exc:
                self._drop(fleet_id, why="its stored state is malformed")
                raise self._malformed(ref, exc) from exc
            if snapshot is None or snapshot.id != fleet_id:
                # Gone between the two reads (an id-first lookup only ever returns that id).
                self._drop(fleet_id, why="the store no longer knows it")
                self._forget(key, seq)
                raise ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {ref!r} not found")
            routes = self._build(snapshot)
            entry = self._entries.get(fleet_id)
            if (
                self._verdicts.get(fleet_id, 0) != verdicts
                or self._forgotten.get(key, -1) > seq
                or (entry is not None and entry.revision > snapshot.route_revision)
            ):
                # Newer knowledge landed while this load was in flight: answer this request
                # with what it read, but never let it overwrite what the cache knows now.
                return RouteLookup(fleet_id, snapshot, routes, stale=False)
            fresh = _Entry(snapshot=snapshot, routes=routes, loaded_at=started)
            if entry is not None:
                fresh.aliases = entry.aliases
            if entry is None or entry.revision < fresh.revision:
                self._wake_movers(fleet_id)
            self._entries[fleet_id] = fresh
            self._entries.move_to_end(fleet_id)
            self._learn(fresh, pointer, key, seq)
            self._evict()
            if fleet_id in self._stale:
                self._leave_stale(fleet_id, fresh)
            return RouteLookup(fleet_id, snapshot, routes, stale=False)

    def _load_failed(
        self,
        ref: str,
        key: str,
        pointer: FleetRoutePointer,
        seq: int,
        exc: BaseException,
    ) -> RouteLookup[T]:
        fleet_id = pointer.id
        entry = self._entries.get(fleet_id)
        if entry is not None and entry.revision == pointer.route_revision:
            entry.load_failed_until = self._clock() + self._outage_memo
            self._learn(entry, pointer, key, seq)
            return self._stale_hit(entry, fleet_id, f"its snapshot failed to load ({exc})")
        if entry is not None:
            self._drop(
                fleet_id,
                why=(
                    f"routing moved to revision {pointer.route_revision} and that snapshot "
                    f"failed to load ({exc})"
                ),
            )
        raise ApiError(
            ErrorCode.STATE_STORE_UNAVAILABLE,
            f"the state store could not load the routing of fleet {ref!r}; retry shortly",
            headers=dict(_RETRY_AFTER),
        ) from exc

    def _cached(self, key: str) -> _Entry[T] | None:
        alias = self._aliases.get(key)
        return None if alias is None else self._entries.get(alias[0])

    def _serve_stale(self, ref: str, key: str, why: str) -> RouteLookup[T]:
        alias = self._aliases.get(key)
        entry = None if alias is None else self._entries.get(alias[0])
        lease = None if alias is None else self._leases.get(alias[0])
        if (
            alias is None
            or entry is None
            or (lease is not None and lease.pointer.route_revision > entry.revision)
        ):
            # Nothing cached, or only a revision known to be superseded (a notified move
            # whose snapshot this process has not loaded): never route with that.
            raise ApiError(
                ErrorCode.STATE_STORE_UNAVAILABLE,
                f"{why} and no current routing for fleet {ref!r} is cached in this process",
                headers=dict(_RETRY_AFTER),
            )
        return self._stale_hit(entry, alias[0], why)

    # -- knowledge bookkeeping ----------------------------------------------------------------

    def _learn(self, entry: _Entry[T], pointer: FleetRoutePointer, key: str, seq: int) -> None:
        fleet_id = pointer.id
        for spelling in (str(fleet_id), pointer.slug, key):
            self._learn_key(entry, fleet_id, spelling, seq)

    def _learn_key(self, entry: _Entry[T], fleet_id: UUID, key: str, seq: int) -> None:
        if not parse_fleet_ref(key).may_alias(fleet_id):
            return  # a UUID-shaped slug is never an alias: an id lookup may name another fleet
        if key in entry.aliases and self._aliases.get(key, (None, 0))[0] == fleet_id:
            return
        if self._forgotten.get(key, -1) > seq:
            return  # disclaimed by a read that started after this one
        current = self._aliases.get(key)
        if current is not None:
            if current[1] > seq:
                return
            if current[0] != fleet_id:
                other = self._entries.get(current[0])
                if other is not None:
                    other.aliases.discard(key)
        self._aliases[key] = (fleet_id, seq)
        entry.aliases.add(key)
        self._forgotten.pop(key, None)

    def _forget(self, key: str, seq: int) -> None:
        """The store says this spelling names no fleet: forget it and what it named."""
        self._forgotten[key] = max(seq, self._forgotten.get(key, -1))
        self._forgotten.move_to_end(key)
        while len(self._forgotten) > self._max_fleets:
            self._forgotten.popitem(last=False)
        alias = self._aliases.pop(key, None)
        if alias is not None:
            self._drop(alias[0], why=f"the store no longer knows {key!r}")

    def _drop(self, fleet_id: UUID, *, why: str) -> None:
        self._verdicts[fleet_id] = self._verdicts.get(fleet_id, 0) + 1
        self._leases.pop(fleet_id, None)  # its refresher sees that and ends
        entry = self._entries.pop(fleet_id, None)
        if entry is None:
            return
        logger.warning(
            "route cache: dropped fleet %s (revision %d): %s", fleet_id, entry.revision, why
        )
        self._unlink(fleet_id, entry)

    def _unlink(self, fleet_id: UUID, entry: _Entry[T]) -> None:
        for key in entry.aliases:
            alias = self._aliases.get(key)
            if alias is not None and alias[0] == fleet_id:
                del self._aliases[key]
        if fleet_id in self._stale:
            self._stale.discard(fleet_id)
            logger.warning(
                "fleet %s (%s): no longer serving stale routing (entry dropped)",
                entry.snapshot.slug,
                fleet_id,
            )

    def _evict(self) -> None:
        while len(self._entries) > self._max_fleets:
            fleet_id, entry = self._entries.popitem(last=False)
            # Capacity eviction is not a verdict: an in-flight load of it may still be cached.
            self._unlink(fleet_id, entry)
        if len(self._verdicts) > 4 * self._max_fleets:
            # Verdict counts only matter while a load is in flight (under the fleet's lock).
            self._verdicts = {k: v for k, v in self._verdicts.items() if k in self._locks}

    # -- outage and stale-serving transitions (logged once per fleet, not per request) --------

    def _enter_outage(self, exc: BaseException) -> None:
        self._outage_until = self._clock() + self._outage_memo
        if not self._outage:
            self._outage = True
            logger.warning("route cache: state store unreachable (%s); failing open", exc)

    def _leave_outage(self) -> None:
        if self._outage:
            self._outage = False
            logger.info("route cache: state store reachable again")

    def _enter_stale(self, fleet_id: UUID, entry: _Entry[T], why: str) -> None:
        if fleet_id not in self._stale:
            self._stale.add(fleet_id)
            logger.warning(
                "fleet %s (%s): serving cached routing at revision %d (stale): %s",
                entry.snapshot.slug,
                fleet_id,
                entry.revision,
                why,
            )

    def _leave_stale(self, fleet_id: UUID, entry: _Entry[T]) -> None:
        self._stale.discard(fleet_id)
        logger.info(
            "fleet %s (%s): routing confirmed by the state store again (revision %d)",
            entry.snapshot.slug,
            fleet_id,
            entry.revision,
        )

    @staticmethod
    def _malformed(ref: str, exc: MalformedFleetStateError) -> ApiError:
        logger.error("fleet %r: stored state is malformed, refusing to route: %s", ref, exc)
        return ApiError(
            ErrorCode.STATE_STORE_UNAVAILABLE,
            f"the stored state of fleet {ref!r} failed validation and cannot be served "
            "(see the server log)",
        )


_BOUND_STEPS: Final = 4


async def _wait_running(awaited: asyncio.Future[Any], timeout: float) -> bool:
    """Wait until ``awaited`` is done or ``timeout`` seconds passed while this process ran.

    Counted in quarters, each as long as it was meant to be however late its timer fired: a
    process that stood still (SIGSTOP, a suspended VM) wakes to overdue timers, and a single
    timer would fail at once a read that had no time to answer. This way a pause costs at most
    one quarter, so a read fails only after three quarters of its bound of running time.

    Returns:
        Whether ``awaited`` is done.
    """
    loop = asyncio.get_running_loop()
    step = timeout / _BOUND_STEPS
    for _ in range(_BOUND_STEPS):
        waiter = loop.create_future()

        def wake(_: object = None, waiter: asyncio.Future[None] = waiter) -> None:
            if not waiter.done():
                waiter.set_result(None)

        awaited.add_done_callback(wake)
        timer = loop.call_later(step, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            awaited.remove_done_callback(wake)
        if awaited.done():
            return True
    return False


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


_REF_KEYS_MAX: Final = 1024
_ref_keys: dict[str, str | None] = {}


def ref_key(ref: str) -> str | None:
    """The cache key of a fleet reference, or None when it names nothing (memoized).

    Requests name the same few fleets over and over, so the parse is done once per spelling
    (at most :data:`_REF_KEYS_MAX` remembered; the memo starts over when full).
    """
    try:
        return _ref_keys[ref]
    except KeyError:
        pass
    parsed = parse_fleet_ref(ref)
    key = None if parsed.names_nothing else parsed.key
    if len(_ref_keys) >= _REF_KEYS_MAX:
        _ref_keys.clear()
    _ref_keys[ref] = key
    return key


def _cache_key(ref: str) -> str:
    """The cache key of a fleet reference (DESIGN 7.5's id-first rule, one spelling per fleet).

    Raises:
        ApiError: ``fleet_not_found`` when ``ref`` is neither an id nor a slug: no fleet can
            have it, so the store is not asked.
    """
    key = ref_key(ref)
    if key is None:
        raise ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {ref[:100]!r} not found")
    return key
