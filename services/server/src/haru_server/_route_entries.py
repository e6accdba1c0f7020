"""The route cache's entries: loaded snapshots per fleet, least recently used evicted first.

A snapshot is loaded under its fleet's lock and cached only when no newer knowledge landed
while it was in flight: a load whose fleet received a verdict (drop, forget) meanwhile is
served but not cached, and a lower revision never replaces a higher one. A snapshot load that
fails is served stale only at the pointer's revision (DESIGN 7.5). Raises the domain errors
(``FleetNotFoundError``, ``RoutingUnavailableError``) that the proxy maps to HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar
from uuid import UUID

from haru_db import MalformedFleetStateError, StateStoreUnavailableError
from haru_protocol import FleetRoutePointer, FleetSnapshot

from haru_server._errors import FleetNotFoundError, RoutingUnavailableError
from haru_server._fleet_aliases import FleetAliases
from haru_server._route_lease import MoveWaiters
from haru_server._route_outage import StaleFleets
from haru_server._single_flight import BoundedReads

logger = logging.getLogger("haru_server._route_cache")

T = TypeVar("T")


class SnapshotSource(Protocol):
    """What loading needs of the store (``haru_db.StateStore`` provides it)."""

    async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None: ...


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
class Entry(Generic[T]):
    """One fleet's cached snapshot and the routing built from it."""

    snapshot: FleetSnapshot
    routes: T
    loaded_at: float
    """Monotonic reading taken when the load that produced it started."""
    load_failed_until: float = 0.0
    """A snapshot load at this revision failed; until then, skip reloading and serve stale."""

    @property
    def revision(self) -> int:
        return self.snapshot.route_revision


class RouteEntries(Generic[T]):
    """Cached snapshots by fleet id, with what a load must respect.

    Args:
        store: Where snapshots come from.
        build: Derives the per-snapshot routing structure (called once per loaded snapshot).
        aliases: The spellings index (taught by loads, unlinked with their entry).
        stale: The fleets served stale (left when a load confirms them).
        movers: Woken when a load finds a newer revision.
        end_lease: Ends a fleet's kept lease when its entry is dropped.
        bounded: Runs the bounded snapshot loads.
        ttl_s: How long a snapshot at the current revision is reused.
        snapshot_timeout_s: Bound on a snapshot load.
        outage_memo_s: After a failed load at a revision, serve stale without reloading this long.
        max_fleets: Entries kept.
        monotonic: Monotonic seconds.
    """

    def __init__(
        self,
        store: SnapshotSource,
        *,
        build: Callable[[FleetSnapshot], T],
        aliases: FleetAliases,
        stale: StaleFleets,
        movers: MoveWaiters,
        end_lease: Callable[[UUID], None],
        bounded: BoundedReads,
        ttl_s: float,
        snapshot_timeout_s: float,
        outage_memo_s: float,
        max_fleets: int,
        monotonic: Callable[[], float],
    ) -> None:
        self._store = store
        self._build = build
        self._aliases = aliases
        self._stale = stale
        self._movers = movers
        self._end_lease = end_lease
        self._bounded = bounded
        self._ttl = ttl_s
        self._snapshot_timeout = snapshot_timeout_s
        self._outage_memo = outage_memo_s
        self._max_fleets = max_fleets
        self._monotonic = monotonic
        self.entries: OrderedDict[UUID, Entry[T]] = OrderedDict()
        self._verdicts: dict[UUID, int] = {}
        """fleet id -> count of drops; a load that saw the count change is not cached."""
        self._locks: weakref.WeakValueDictionary[UUID, asyncio.Lock] = weakref.WeakValueDictionary()

    def hit(self, entry: Entry[T], fleet_id: UUID, key: str, seq: int) -> RouteLookup[T]:
        """Serve ``entry`` as confirmed by read number ``seq`` of spelling ``key``."""
        self.entries.move_to_end(fleet_id)
        if self._aliases.get(key) != fleet_id:
            self._aliases.learn(fleet_id, key, seq)
        self._stale.leave(fleet_id, entry.snapshot.slug, entry.revision)
        return RouteLookup(fleet_id, entry.snapshot, entry.routes, stale=False)

    def stale_hit(self, entry: Entry[T], fleet_id: UUID, why: str) -> RouteLookup[T]:
        """Serve ``entry`` marked stale: the store could not confirm it (``why``)."""
        self.entries.move_to_end(fleet_id)
        self._stale.enter(fleet_id, entry.snapshot.slug, entry.revision, why)
        return RouteLookup(fleet_id, entry.snapshot, entry.routes, stale=True)

    async def load(
        self, ref: str, key: str, pointer: FleetRoutePointer, seq: int
    ) -> RouteLookup[T]:
        """Routing at ``pointer`` (read number ``seq`` of spelling ``key``), loading if needed.

        Raises:
            FleetNotFoundError: The fleet is gone since the pointer read.
            RoutingUnavailableError: The load failed and nothing at the pointer's revision is
                cached, or the stored state is malformed.
        """
        fleet_id = pointer.id
        lock = self._locks.get(fleet_id)
        if lock is None:
            lock = self._locks[fleet_id] = asyncio.Lock()
        async with lock:
            # Another request may have loaded this revision while this one waited.
            entry = self.entries.get(fleet_id)
            started = self._monotonic()
            if (
                entry is not None
                and entry.revision >= pointer.route_revision
                and started - entry.loaded_at < self._ttl
            ):
                return self.hit(entry, fleet_id, key, seq)
            verdicts = self._verdicts.get(fleet_id, 0)
            try:
                snapshot = await self._bounded.run(
                    self._store.get_fleet_snapshot(str(fleet_id)), self._snapshot_timeout
                )
            except (StateStoreUnavailableError, TimeoutError) as exc:
                return self._load_failed(ref, key, pointer, seq, exc)
            except MalformedFleetStateError as exc:
                self.drop(fleet_id, why="its stored state is malformed")
                raise self.malformed(ref, exc) from exc
            if snapshot is None or snapshot.id != fleet_id:
                # Gone between the two reads (an id-first lookup only ever returns that id).
                self.drop(fleet_id, why="the store no longer knows it")
                self.forget(key, seq)
                raise FleetNotFoundError(ref)
            routes = self._build(snapshot)
            entry = self.entries.get(fleet_id)
            if (
                self._verdicts.get(fleet_id, 0) != verdicts
                or self._aliases.disclaimed_after(key, seq)
                or (entry is not None and entry.revision > snapshot.route_revision)
            ):
                # Newer knowledge landed while this load was in flight: answer this request
                # with what it read, but never let it overwrite what the cache knows now.
                return RouteLookup(fleet_id, snapshot, routes, stale=False)
            fresh = Entry(snapshot=snapshot, routes=routes, loaded_at=started)
            if entry is None or entry.revision < fresh.revision:
                self._movers.wake(fleet_id)
            self.entries[fleet_id] = fresh
            self.entries.move_to_end(fleet_id)
            self.learn(pointer, key, seq)
            self._evict()
            self._stale.leave(fleet_id, fresh.snapshot.slug, fresh.revision)
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
        entry = self.entries.get(fleet_id)
        if entry is not None and entry.revision == pointer.route_revision:
            entry.load_failed_until = self._monotonic() + self._outage_memo
            self.learn(pointer, key, seq)
            return self.stale_hit(entry, fleet_id, f"its snapshot failed to load ({exc})")
        if entry is not None:
            self.drop(
                fleet_id,
                why=(
                    f"routing moved to revision {pointer.route_revision} and that snapshot "
                    f"failed to load ({exc})"
                ),
            )
        raise RoutingUnavailableError(
            f"the state store could not load the routing of fleet {ref!r}; retry shortly",
            retry_soon=True,
        ) from exc

    def learn(self, pointer: FleetRoutePointer, key: str, seq: int) -> None:
        """Read number ``seq`` of ``key`` found ``pointer``: index its spellings."""
        fleet_id = pointer.id
        for spelling in (str(fleet_id), pointer.slug, key):
            self._aliases.learn(fleet_id, spelling, seq)

    def forget(self, key: str, seq: int) -> None:
        """The store says this spelling names no fleet: forget it and what it named."""
        fleet = self._aliases.disclaim(key, seq)
        if fleet is not None:
            self.drop(fleet, why=f"the store no longer knows {key!r}")

    def drop(self, fleet_id: UUID, *, why: str) -> None:
        """A verdict: ``fleet_id``'s routing must go (a load in flight is not cached)."""
        self._verdicts[fleet_id] = self._verdicts.get(fleet_id, 0) + 1
        self._end_lease(fleet_id)  # its refresher sees that and ends
        entry = self.entries.pop(fleet_id, None)
        if entry is None:
            return
        logger.warning(
            "route cache: dropped fleet %s (revision %d): %s", fleet_id, entry.revision, why
        )
        self._unlink(fleet_id, entry)

    def _unlink(self, fleet_id: UUID, entry: Entry[T]) -> None:
        self._aliases.unlink(fleet_id)
        self._stale.drop(fleet_id, entry.snapshot.slug)

    def _evict(self) -> None:
        while len(self.entries) > self._max_fleets:
            fleet_id, entry = self.entries.popitem(last=False)
            # Capacity eviction is not a verdict: an in-flight load of it may still be cached.
            self._unlink(fleet_id, entry)
        if len(self._verdicts) > 4 * self._max_fleets:
            # Verdict counts only matter while a load is in flight (under the fleet's lock).
            self._verdicts = {k: v for k, v in self._verdicts.items() if k in self._locks}

    @staticmethod
    def malformed(ref: str, exc: MalformedFleetStateError) -> RoutingUnavailableError:
        """The error for malformed stored state (logged here, never served)."""
        logger.error("fleet %r: stored state is malformed, refusing to route: %s", ref, exc)
        return RoutingUnavailableError(
            f"the stored state of fleet {ref!r} failed validation and cannot be served "
            "(see the server log)",
            retry_soon=False,
        )
