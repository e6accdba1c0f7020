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

With a route lease (``lease_ms`` > 0; its bookkeeping is ``_route_lease``) requests stop
reading the pointer and route with the kept one at once; a background refresher per fleet
(single-flight, only while the fleet had a request within ``idle_ms``) re-reads it every lease
and reloads the snapshot when the revision moved or its TTL ran out. A notified move
(:meth:`RouteCache.observe`: PostgreSQL NOTIFY, or a flip made by this process) replaces the
pointer at once but never extends the lease. A pointer not confirmed for longer than the
lease plus the read bound has expired and is never routed on before a read was tried: the
request reads (shared, bounded), and serves the old pointer marked stale only when that read,
or one of the fleet's reads within the last lease window, failed (the store does not answer,
so the pointer cannot move). A process that stood still (SIGSTOP: the monotonic clock runs
on) thus reads before it routes again. Read bounds count time the process ran
(``_single_flight``), so a read in flight across a pause is not failed at once. A fleet that
went idle is dormant: its next request reads the pointer like a cold start. ``lease_ms`` = 0
keeps one coalesced pointer read per request.

Entries (``_route_entries``) are keyed by fleet id, least recently used evicted first;
spellings are indexed onto the id by ``_fleet_aliases``. Newer knowledge always wins. The cache
raises domain errors (``FleetNotFoundError``, ``RoutingUnavailableError``); the proxy maps them
to HTTP (``_route_http``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final, Generic, Protocol, TypeVar
from uuid import UUID

from haru_core import ROUTE_READ_BOUND_MS
from haru_db import MalformedFleetStateError, StateStoreUnavailableError
from haru_protocol import FleetRoutePointer, FleetSnapshot, parse_fleet_ref

from haru_server._errors import FleetNotFoundError, RoutingUnavailableError
from haru_server._fleet_aliases import FleetAliases, cache_key
from haru_server._promotion_sightings import PromotionSightings
from haru_server._route_entries import Entry, RouteEntries, RouteLookup
from haru_server._route_lease import Lease, LeaseHooks, LeaseRecords, MoveWaiters, RouteLeases
from haru_server._route_outage import StaleFleets, StoreOutage
from haru_server._single_flight import BoundedReads, CallLater, SingleFlight

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


class RouteSource(Protocol):
    """What the cache needs of the store (``haru_db.StateStore`` provides it)."""

    async def get_fleet_route_pointer(self, ref: str) -> FleetRoutePointer | None: ...

    async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None: ...

    async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool: ...


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
        monotonic: Monotonic seconds (injected by tests).
        sleep: The refresher's pause (injected by tests).
        call_later: Arms the timers counting the read bounds (default: the running loop's
            ``call_later``; injected by tests).
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
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        call_later: CallLater | None = None,
    ) -> None:
        if max_fleets < 1:
            raise ValueError(f"max_fleets must be >= 1, got {max_fleets}")
        self._store = store
        self._ttl = ttl_ms / 1000
        self._pointer_timeout = pointer_timeout_ms / 1000
        self._snapshot_timeout = snapshot_timeout_ms / 1000
        self._read_bound = max(self._pointer_timeout, self._snapshot_timeout)
        """How long one pointer read may run (the wait of a request with nothing cached)."""
        self._outage_memo = outage_memo_ms / 1000
        self._monotonic = monotonic
        self._aliases = FleetAliases(max_disclaimed=max_fleets)
        self._seq = 0
        self._outage = StoreOutage(memo_s=self._outage_memo, monotonic=monotonic)
        self._stale = StaleFleets()
        self._bounded = BoundedReads(call_later=call_later)
        self._pointers: SingleFlight[str, FleetRoutePointer | None] = SingleFlight(
            self._fetch_pointer, next_seq=self._next_seq, call_later=call_later
        )
        self._lease = lease_ms > 0
        self._movers = MoveWaiters()
        records = LeaseRecords(
            store,
            self._bounded,
            lease_ms=lease_ms,
            timeout_s=self._snapshot_timeout,
            retry_s=self._outage_memo,
            max_fleets=max_fleets,
            monotonic=monotonic,
        )
        hooks = LeaseHooks(
            read=self._read_pointer,
            on_outage=self._outage.enter,
            on_answer=self._outage.leave,
            drop=lambda fleet_id, why: self._fleets.drop(fleet_id, why=why),
            reload=self._reload,
            moved=self._movers.wake,
        )
        self._leases = RouteLeases(
            records,
            hooks,
            lease_s=lease_ms / 1000,
            window_s=lease_ms / 1000 + self._pointer_timeout,
            idle_s=idle_ms / 1000,
            monotonic=monotonic,
            sleep=sleep,
        )
        self._promotions = PromotionSightings(max_fleets=max_fleets, monotonic=monotonic)
        self._fleets: RouteEntries[T] = RouteEntries(
            store,
            build=build,
            aliases=self._aliases,
            stale=self._stale,
            movers=self._movers,
            end_lease=self._leases.end,
            bounded=self._bounded,
            ttl_s=self._ttl,
            snapshot_timeout_s=self._snapshot_timeout,
            outage_memo_s=self._outage_memo,
            max_fleets=max_fleets,
            monotonic=monotonic,
        )

    # -- introspection (tests, diagnostics) ---------------------------------------------------

    def __len__(self) -> int:
        return len(self._fleets.entries)

    def cached_revision(self, fleet_id: UUID) -> int | None:
        """The revision cached for ``fleet_id``, or None when nothing is cached."""
        entry = self._fleets.entries.get(fleet_id)
        return None if entry is None else entry.revision

    def indexed(self, ref: str) -> UUID | None:
        """The fleet id a spelling is indexed onto, or None."""
        return self._aliases.get(parse_fleet_ref(ref).key)

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
        now = self._monotonic()
        return {
            lease.pointer.slug: max(now - lease.confirmed_at, 0.0) for lease in self._leases.all()
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
        """Monotonic reading at which this process first saw the promotion now in flight."""
        return self._promotions.since(fleet_id)

    def note_promotion(self, fleet_id: UUID) -> None:
        """This process accepted a promotion of ``fleet_id``: know it before the next read."""
        self._seq += 1
        self._note_promoting(fleet_id, self._seq, in_flight=True)

    def _note_promoting(self, fleet_id: UUID, seq: int, *, in_flight: bool) -> None:
        self._promotions.note(
            fleet_id, seq, in_flight=in_flight, keep=self._fleets.entries.__contains__
        )

    @property
    def in_outage(self) -> bool:
        """Whether the last pointer read failed (and none has succeeded since)."""
        return self._outage.active

    async def aclose(self) -> None:
        """Cancel and wait for the reads in flight or abandoned after their bound (shutdown)."""
        tasks = [
            *self._bounded.tasks(),
            *self._pointers.tasks(),
            *self._leases.tasks(),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- coalesced pointer reads ---------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _read_pointer(
        self, ref: str, *, wait_s: float | None = None
    ) -> tuple[FleetRoutePointer | None, int]:
        """The pointer ``ref`` names, from a read that STARTED after this call (shared).

        ``wait_s`` bounds the wait (default: the pointer bound). A read itself may run up to
        the snapshot bound, so a caller with nothing cached can wait for it while callers
        with a fallback stop waiting at the pointer bound. No request is ever answered from a
        read that began before it arrived, so a committed pointer move is seen by every later
        request, while the store sees at most one pointer read per reference at a time.

        Returns:
            The pointer (None: no such fleet) and the read's sequence number (reads are
            numbered in the order they start; later numbers carry newer knowledge).

        Raises:
            StateStoreUnavailableError: The read failed.
            TimeoutError: No answer within the pointer bound.
            MalformedFleetStateError: The stored fleet row is malformed.
        """
        return await self._pointers.read(ref, wait_s or self._pointer_timeout)

    async def _fetch_pointer(self, ref: str, seq: int) -> FleetRoutePointer | None:
        """One pointer read (numbered ``seq``), shared by the requests that wait for it."""
        try:
            pointer = await self._bounded.run(
                self._store.get_fleet_route_pointer(ref), self._read_bound
            )
        except (StateStoreUnavailableError, TimeoutError, MalformedFleetStateError):
            raise
        except Exception:
            logger.exception("route cache: pointer read of %r failed unexpectedly", ref)
            raise  # the waiters answer 500, not hang
        if pointer is not None:
            self._note_promoting(pointer.id, seq, in_flight=pointer.promotion_in_flight)
        return pointer

    # -- the request path ---------------------------------------------------------------------

    async def resolve(self, ref: str) -> RouteLookup[T]:
        """Routing for the fleet ``ref`` names, fresh when the store answers.

        Raises:
            FleetNotFoundError: The store says no such fleet exists (or ``ref`` names nothing).
            RoutingUnavailableError: Routing cannot be served safely.
        """
        key = cache_key(ref)
        if self._lease:
            fleet = self._aliases.get(key)
            lease = None if fleet is None else self._leases.get(fleet)
            if lease is not None and lease.refresher is not None:
                now = self._monotonic()
                lease.used_at = now
                if now - lease.confirmed_at <= self._leases.window:
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

    async def _resolve_read(self, ref: str, key: str, expired: Lease | None) -> RouteLookup[T]:
        """Routing from a pointer read (shared with the requests that arrive meanwhile).

        ``expired``: the lease this request may not route on without a read; the process-wide
        outage memo never stands in for that read.
        """
        # With nothing cached for this spelling there is nothing to fail open to: a quick
        # timeout or the outage memo could only turn a slow read into a 503 (a process that
        # just started, on a loaded machine: docs/FAULTS.md, finding 7). Such a request reads
        # (sharing the read in flight) and waits up to the snapshot bound.
        cold = self._cached(key) is None
        probe = self._outage.active and not cold and expired is None
        started = self._monotonic()
        if probe:
            if self._outage.probing or self._outage.memo_running():
                return self._serve_stale(ref, key, "the state store is unreachable")
            self._outage.probing = True  # one probe at a time; the others keep serving stale
        try:
            try:
                pointer, seq = await self._read_pointer(
                    ref, wait_s=self._read_bound if cold else None
                )
            finally:
                if probe:
                    self._outage.probing = False
        except (StateStoreUnavailableError, TimeoutError) as exc:
            self._outage.enter(exc)
            if expired is not None and self._leases.get(expired.pointer.id) is expired:
                self._leases.unanswered(expired)
                return await self._stale_lease(ref, key, expired)
            return self._serve_stale(ref, key, "the state store is unreachable")
        except MalformedFleetStateError as exc:
            self._outage.leave()
            fleet = self._aliases.get(key)
            if fleet is not None:
                self._fleets.drop(fleet, why="its stored state is malformed")
            raise self._fleets.malformed(ref, exc) from exc
        self._outage.leave()
        if pointer is None:
            self._fleets.forget(key, seq)
            raise FleetNotFoundError(ref)
        if self._lease:
            self._leases.keep_from(pointer, started, seq)
        entry = self._fleets.entries.get(pointer.id)
        now = self._monotonic()
        if entry is not None and entry.revision >= pointer.route_revision:
            if now - entry.loaded_at < self._ttl:
                return self._fleets.hit(entry, pointer.id, key, seq)
            if now < entry.load_failed_until and entry.revision == pointer.route_revision:
                self._fleets.learn(pointer, key, seq)
                return self._fleets.stale_hit(entry, pointer.id, "its snapshot failed to load")
        return await self._fleets.load(ref, key, pointer, seq)

    async def _resolve_leased(self, ref: str, key: str, lease: Lease) -> RouteLookup[T]:
        pointer = lease.pointer
        entry = self._fleets.entries.get(pointer.id)
        if entry is not None and entry.revision >= pointer.route_revision:
            return self._fleets.hit(entry, pointer.id, key, lease.seq)
        return await self._fleets.load(ref, key, pointer, lease.seq)

    async def _stale_lease(self, ref: str, key: str, lease: Lease) -> RouteLookup[T]:
        """Fail open on an expired lease: a read of its pointer just failed."""
        pointer = lease.pointer
        entry = self._fleets.entries.get(pointer.id)
        if entry is not None and entry.revision >= pointer.route_revision:
            return self._fleets.stale_hit(
                entry, pointer.id, "the state store has not confirmed the route lease"
            )
        return await self._fleets.load(ref, key, pointer, lease.seq)

    # -- route leases ---------------------------------------------------------------------------

    def observe(self, pointer: FleetRoutePointer) -> None:
        """A pointer move learned without a read (NOTIFY, or a flip made by this process).

        Moves a kept lease forward at once (never backwards) without extending it: only a
        read proves that no later move happened. Fleets this process does not route are
        ignored (their first request reads).
        """
        self._leases.observe(pointer, self._next_seq)

    async def wait_moved(self, fleet_id: UUID, revision: int, timeout: float) -> None:
        """Wait until this process learns a revision of ``fleet_id`` above ``revision``.

        Returns after ``timeout`` seconds at the latest.
        """
        if self._known_revision(fleet_id) > revision:
            return
        await self._movers.wait(fleet_id, timeout)

    def _known_revision(self, fleet_id: UUID) -> int:
        lease = self._leases.get(fleet_id)
        entry = self._fleets.entries.get(fleet_id)
        return max(
            -1 if lease is None else lease.pointer.route_revision,
            -1 if entry is None else entry.revision,
        )

    async def _reload(self, ref: str, pointer: FleetRoutePointer, seq: int) -> None:
        """Reload a leased fleet's snapshot if its revision moved or its TTL ran out."""
        entry = self._fleets.entries.get(pointer.id)
        if entry is not None and (
            entry.revision < pointer.route_revision
            or self._monotonic() - entry.loaded_at >= self._ttl
        ):
            with contextlib.suppress(FleetNotFoundError, RoutingUnavailableError):  # logged
                await self._fleets.load(ref, ref, pointer, seq)

    def _cached(self, key: str) -> Entry[T] | None:
        fleet = self._aliases.get(key)
        return None if fleet is None else self._fleets.entries.get(fleet)

    def _serve_stale(self, ref: str, key: str, why: str) -> RouteLookup[T]:
        fleet = self._aliases.get(key)
        entry = None if fleet is None else self._fleets.entries.get(fleet)
        lease = None if fleet is None else self._leases.get(fleet)
        if (
            fleet is None
            or entry is None
            or (lease is not None and lease.pointer.route_revision > entry.revision)
        ):
            # Nothing cached, or only a revision known to be superseded (a notified move
            # whose snapshot this process has not loaded): never route with that.
            raise RoutingUnavailableError(
                f"{why} and no current routing for fleet {ref!r} is cached in this process",
                retry_soon=True,
            )
        return self._fleets.stale_hit(entry, fleet, why)
