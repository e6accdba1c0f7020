"""RouteCache in isolation: a scripted store at the seam, an injected clock, no sockets."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pytest
from haru_db import MalformedFleetStateError, StateStoreUnavailableError
from haru_protocol import ErrorCode, FleetRoutePointer, FleetSnapshot, Policy, parse_fleet_ref
from haru_server._fleet_aliases import ref_key
from haru_server._route_cache import RouteCache
from haru_server._route_http import resolve_route
from haru_web import ApiError

Behaviour = Callable[[], object]


def snapshot(fleet_id: UUID, slug: str, revision: int) -> FleetSnapshot:
    return FleetSnapshot(
        id=fleet_id,
        slug=slug,
        display_name=None,
        active_domain_id=None,
        route_revision=revision,
        policy=Policy(),
        domains=(),
    )


@dataclass
class Fleet:
    id: UUID
    slug: str
    revision: int = 1
    promoting: bool = False


@dataclass
class ScriptedStore:
    """A store whose answers the test controls: fleets, failures, hangs and gates."""

    fleets: dict[UUID, Fleet] = field(default_factory=dict)
    pointer_error: BaseException | None = None
    snapshot_error: BaseException | None = None
    pointer_hang: bool = False
    stubborn: asyncio.Event | None = None
    """While set, a cancelled read keeps running until the event fires (like psycopg, which
    first tries to cancel the query on the server)."""
    snapshot_revision_override: int | None = None
    pointer_gates: list[asyncio.Event] = field(default_factory=list)
    snapshot_gates: list[asyncio.Event] = field(default_factory=list)
    pointer_reads: int = 0
    snapshot_loads: int = 0
    lease_records: list[tuple[UUID, int]] = field(default_factory=list)
    record_error: Exception | None = None

    def add(self, slug: str, revision: int = 1, fleet_id: UUID | None = None) -> Fleet:
        fleet = Fleet(fleet_id or uuid.uuid4(), slug, revision)
        self.fleets[fleet.id] = fleet
        return fleet

    def find(self, ref: str) -> Fleet | None:
        # The database's id-first rule, from the one function that states it.
        chosen = parse_fleet_ref(ref).choose({f.id: f.slug for f in self.fleets.values()})
        return None if chosen is None else self.fleets[chosen]

    async def get_fleet_route_pointer(self, ref: str) -> FleetRoutePointer | None:
        self.pointer_reads += 1
        fleet = self.find(ref)  # read "now": a gated read returns what was true when it started
        found = None if fleet is None else (fleet.id, fleet.slug, fleet.revision)
        promoting = fleet is not None and fleet.promoting
        if self.pointer_gates:
            await self.pointer_gates.pop(0).wait()
        if self.pointer_hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if self.stubborn is not None:
                    await self.stubborn.wait()
                raise
        if self.pointer_error is not None:
            raise self.pointer_error
        if found is None:
            return None
        return FleetRoutePointer(
            id=found[0],
            slug=found[1],
            active_domain_id=None,
            route_revision=found[2],
            promotion_in_flight=promoting,
        )

    async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool:
        self.lease_records.append((fleet_id, lease_ms))
        if self.record_error is not None:
            raise self.record_error
        return True

    async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None:
        self.snapshot_loads += 1
        fleet = self.find(ref)
        found = None if fleet is None else (fleet.id, fleet.slug, fleet.revision)
        if self.snapshot_gates:
            await self.snapshot_gates.pop(0).wait()
        if self.snapshot_error is not None:
            raise self.snapshot_error
        if found is None:
            return None
        revision = self.snapshot_revision_override or found[2]
        return snapshot(found[0], found[1], revision)


@dataclass
class FakeTimer:
    deadline: float
    callback: Callable[[], object]
    fired: bool = False
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Monotonic seconds moved by hand; timers armed on it (``call_later``) fire as it passes."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[FakeTimer] = []

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], object]) -> FakeTimer:
        timer = FakeTimer(self.now + delay, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> list[FakeTimer]:
        """Move on ``seconds``; fire the timers that came due (returned)."""
        self.now += seconds
        due = [t for t in self.timers if t.deadline <= self.now and not t.cancelled]
        self.timers = [t for t in self.timers if t not in due]
        for timer in due:
            timer.fired = True
            timer.callback()
        return due

    def armed(self) -> int:
        return sum(not t.cancelled for t in self.timers)

    async def elapse(self, seconds: float, *, step: float = 0.001) -> None:
        """Let ``seconds`` pass a ``step`` at a time, each fired timer taken up by its waiter.

        A waiter cancels its timer when it wakes (a bound's timer, or the answer it awaited);
        so once every fired timer is cancelled, what it woke has run on to its next wait.
        """
        for _ in range(round(seconds / step)):
            fired = self.advance(step)

            def taken_up(fired: list[FakeTimer] = fired) -> bool:
                return all(t.cancelled for t in fired)

            await until(taken_up)


@pytest.fixture
def store() -> ScriptedStore:
    return ScriptedStore()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_cache(store: ScriptedStore, clock: FakeClock, **kwargs: Any) -> RouteCache[FleetSnapshot]:
    options: dict[str, Any] = {"ttl_ms": 2000, "outage_memo_ms": 1000, "pointer_timeout_ms": 50}
    options.update(kwargs)
    return RouteCache(store, build=lambda s: s, monotonic=clock, **options)


def down() -> StateStoreUnavailableError:
    return StateStoreUnavailableError("database unreachable (OperationalError)")


async def until(predicate: Callable[[], bool]) -> None:
    """Let other tasks run until ``predicate`` holds (bounded: fails instead of hanging)."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never reached")


async def expect_error(cache: RouteCache[FleetSnapshot], ref: str, code: ErrorCode) -> ApiError:
    with pytest.raises(ApiError) as info:
        await resolve_route(cache, ref)
    assert info.value.code is code
    return info.value


# -- spellings ---------------------------------------------------------------------------------


async def test_a_reference_that_names_nothing_never_reaches_the_store(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    for ref in (f"{fleet.id}\n", "prod\n", " prod", "Prod", "", "x" * 64):
        with pytest.raises(ApiError) as caught:
            await resolve_route(cache, ref)
        assert caught.value.code is ErrorCode.FLEET_NOT_FOUND
    assert store.pointer_reads == 0
    upper = str(fleet.id).upper()
    assert (await resolve_route(cache, upper)).fleet_id == fleet.id
    assert cache.indexed(str(fleet.id)) == fleet.id  # ids are indexed lowercase


def test_ref_keys_are_memoized_without_changing_a_verdict() -> None:
    fleet_id = uuid.uuid4()
    refs = [str(fleet_id), str(fleet_id).upper(), "prod", "Prod", " prod", "", "x" * 64]
    expected = {ref: parse_fleet_ref(ref) for ref in refs}
    for _ in range(2):  # the second pass answers from the memo
        for ref in refs:
            parsed = expected[ref]
            assert ref_key(ref) == (None if parsed.names_nothing else parsed.key)
    assert ref_key(str(fleet_id).upper()) == str(fleet_id)  # ids compare lowercase
    # Past its bound the memo starts over and still answers right.
    for n in range(1100):
        assert ref_key(f"fleet-{n}") == f"fleet-{n}"
    assert ref_key("Prod") is None
    assert ref_key("prod") == "prod"


# -- fresh path --------------------------------------------------------------------------------


async def test_hit_reads_the_pointer_but_not_the_snapshot(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    for _ in range(5):
        lookup = await resolve_route(cache, "prod")
        assert lookup.fleet_id == fleet.id
        assert not lookup.stale
        assert lookup.routes.route_revision == 1
    assert store.pointer_reads == 5
    assert store.snapshot_loads == 1


async def test_ttl_expiry_reloads_the_snapshot(store: ScriptedStore, clock: FakeClock) -> None:
    store.add("prod")
    cache = make_cache(store, clock, ttl_ms=2000)
    await resolve_route(cache, "prod")
    clock.advance(1.9)
    await resolve_route(cache, "prod")
    assert store.snapshot_loads == 1
    clock.advance(0.2)
    await resolve_route(cache, "prod")
    assert store.snapshot_loads == 2


async def test_a_moved_pointer_is_seen_on_the_very_next_request(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock, ttl_ms=60_000)
    assert (await resolve_route(cache, "prod")).snapshot.route_revision == 1
    fleet.revision = 2
    lookup = await resolve_route(cache, "prod")
    assert lookup.snapshot.route_revision == 2
    assert cache.cached_revision(fleet.id) == 2


async def test_concurrent_misses_load_the_snapshot_once(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    gate = asyncio.Event()
    store.snapshot_gates.append(gate)
    cache = make_cache(store, clock)
    tasks = [asyncio.create_task(resolve_route(cache, "prod")) for _ in range(10)]
    await until(lambda: store.snapshot_loads == 1)
    gate.set()
    lookups = await asyncio.gather(*tasks)
    assert {lk.snapshot.route_revision for lk in lookups} == {1}
    assert store.snapshot_loads == 1
    # Ten requests, two pointer reads: the first, and one shared by those who came during it.
    assert store.pointer_reads == 2


async def test_a_request_never_uses_a_pointer_read_that_started_before_it(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock, ttl_ms=60_000)
    await resolve_route(cache, "prod")
    gate = asyncio.Event()
    store.pointer_gates.append(gate)
    early = asyncio.create_task(resolve_route(cache, "prod"))
    await until(lambda: store.pointer_reads == 2)  # its read has started (and read revision 1)
    fleet.revision = 2  # a promotion commits while that read is in flight
    late = [asyncio.create_task(resolve_route(cache, "prod")) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    assert (await early).snapshot.route_revision == 1
    assert {(await t).snapshot.route_revision for t in late} == {2}
    assert store.pointer_reads == 3  # the five late requests shared one read


async def test_unknown_fleet_is_404_and_never_cached(
    store: ScriptedStore, clock: FakeClock
) -> None:
    cache = make_cache(store, clock)
    await expect_error(cache, "nope", ErrorCode.FLEET_NOT_FOUND)
    assert len(cache) == 0


# -- fail-open on a failing pointer read -------------------------------------------------------


async def test_pointer_failure_serves_the_warm_cache_as_stale(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    await resolve_route(cache, "prod")
    store.pointer_error = down()
    for _ in range(3):
        lookup = await resolve_route(cache, "prod")
        assert lookup.stale
        assert lookup.fleet_id == fleet.id
    # Stale serving ignores the TTL: the pointer cannot move while the store is down.
    clock.advance(3600)
    assert (await resolve_route(cache, str(fleet.id).upper())).stale


async def test_pointer_failure_with_a_cold_cache_is_503(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    store.pointer_error = down()
    cache = make_cache(store, clock)
    error = await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)
    assert error.status == 503


async def test_a_cold_cache_waits_for_a_slow_pointer_read_instead_of_failing(
    store: ScriptedStore, clock: FakeClock
) -> None:
    # Fault schedule pg-replicas:1021 (finding 7): a replica that had just started, on a
    # loaded machine, read its first pointer more slowly than the pointer bound; with nothing
    # cached it answered 503 at once, and for the outage memo's second after that too.
    fleet = store.add("prod")
    other = store.add("staging")
    cache = make_cache(
        store, clock, pointer_timeout_ms=20, snapshot_timeout_ms=2000, call_later=clock.call_later
    )
    gate = asyncio.Event()
    store.pointer_gates.append(gate)
    first = asyncio.create_task(resolve_route(cache, "prod"))
    await until(lambda: clock.armed() == 2)  # the request's wait and its read's bound
    await clock.elapse(0.1)  # five times the pointer bound
    assert not first.done()
    gate.set()
    lookup = await first
    assert lookup.fleet_id == fleet.id
    assert not lookup.stale
    # A failed read starts the outage memo; a spelling with nothing cached still reads.
    store.pointer_error = down()
    clock.advance(5)
    assert (await resolve_route(cache, "prod")).stale
    assert cache.in_outage
    store.pointer_error = None
    lookup = await resolve_route(cache, "staging")
    assert lookup.fleet_id == other.id
    assert not lookup.stale
    # Once cached, a slow read is bounded by the pointer bound again (served stale).
    clock.advance(5)
    store.pointer_hang = True
    slow = asyncio.create_task(resolve_route(cache, "staging"))
    await until(lambda: clock.armed() == 2)
    await clock.elapse(0.025)  # past the pointer bound, far from the read's own
    await until(slow.done)
    assert (await slow).stale
    await cache.aclose()


async def test_a_cold_cache_still_fails_when_the_read_outlasts_the_snapshot_bound(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    store.pointer_hang = True
    cache = make_cache(store, clock, pointer_timeout_ms=20, snapshot_timeout_ms=100)
    error = await asyncio.wait_for(
        expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE), timeout=2
    )
    assert error.status == 503
    await cache.aclose()


async def test_hung_pointer_read_counts_as_unreachable_within_its_bound(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    cache = make_cache(store, clock, pointer_timeout_ms=20)
    await resolve_route(cache, "prod")
    store.pointer_hang = True
    lookup = await asyncio.wait_for(resolve_route(cache, "prod"), timeout=2)
    assert lookup.stale


async def test_a_read_slow_to_cancel_still_costs_only_the_bound(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    cache = make_cache(store, clock, pointer_timeout_ms=20)
    await resolve_route(cache, "prod")
    store.pointer_hang = True
    store.stubborn = asyncio.Event()
    lookup = await asyncio.wait_for(resolve_route(cache, "prod"), timeout=2)
    assert lookup.stale
    store.stubborn.set()
    await cache.aclose()


async def test_outage_is_memoised_then_probed_once(store: ScriptedStore, clock: FakeClock) -> None:
    store.add("prod")
    cache = make_cache(store, clock, outage_memo_ms=1000)
    await resolve_route(cache, "prod")
    store.pointer_error = down()
    await resolve_route(cache, "prod")
    reads = store.pointer_reads
    for _ in range(5):
        assert (await resolve_route(cache, "prod")).stale
    assert store.pointer_reads == reads  # memo: no reads for a second
    clock.advance(1.1)
    # The memo expired: exactly one request probes while the others keep serving stale.
    gate = asyncio.Event()
    store.pointer_gates.append(gate)
    probe = asyncio.create_task(resolve_route(cache, "prod"))
    await until(lambda: store.pointer_reads == reads + 1)
    others = [await resolve_route(cache, "prod") for _ in range(3)]
    assert all(lk.stale for lk in others)
    assert store.pointer_reads == reads + 1
    store.pointer_error = None
    gate.set()
    assert not (await probe).stale
    assert not cache.in_outage
    assert not (await resolve_route(cache, "prod")).stale


async def test_a_failed_read_never_evicts(store: ScriptedStore, clock: FakeClock) -> None:
    fleets = [store.add(f"fleet-{i}") for i in range(3)]
    cache = make_cache(store, clock, max_fleets=3)
    for fleet in fleets:
        await resolve_route(cache, fleet.slug)
    store.pointer_error = down()
    clock.advance(5)
    for _ in range(3):
        for fleet in fleets:
            assert (await resolve_route(cache, fleet.slug)).stale
            clock.advance(2)
    assert len(cache) == 3


# -- pointer answered, snapshot load failed ----------------------------------------------------


async def test_same_revision_with_a_failing_load_serves_stale(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    cache = make_cache(store, clock, ttl_ms=1000, outage_memo_ms=500)
    await resolve_route(cache, "prod")
    clock.advance(2)  # TTL expired: a reload is due
    store.snapshot_error = down()
    assert (await resolve_route(cache, "prod")).stale
    loads = store.snapshot_loads
    assert (await resolve_route(cache, "prod")).stale
    assert store.snapshot_loads == loads  # the failed load is memoised too
    clock.advance(0.6)
    store.snapshot_error = None
    assert not (await resolve_route(cache, "prod")).stale


async def test_moved_pointer_with_a_failing_load_is_503_and_drops_the_entry(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    await resolve_route(cache, "prod")
    fleet.revision = 2
    store.snapshot_error = down()
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)
    assert cache.cached_revision(fleet.id) is None
    # A later outage cannot resurrect routing known to be superseded.
    store.pointer_error = down()
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)


async def test_a_hung_load_at_a_moved_revision_is_503(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock, snapshot_timeout_ms=20)
    await resolve_route(cache, "prod")
    fleet.revision = 2
    store.snapshot_gates.append(asyncio.Event())  # never set
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)
    assert cache.cached_revision(fleet.id) is None


async def test_malformed_snapshot_is_503_and_never_served(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock, ttl_ms=1000)
    await resolve_route(cache, "prod")
    clock.advance(2)
    store.snapshot_error = MalformedFleetStateError("slot kind differs from spec kind")
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)
    assert cache.cached_revision(fleet.id) is None
    store.pointer_error = down()
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)


async def test_malformed_pointer_is_503_and_drops_the_entry(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    await resolve_route(cache, "prod")
    store.pointer_error = MalformedFleetStateError("invalid slug read back")
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)
    assert cache.cached_revision(fleet.id) is None
    assert not cache.in_outage


# -- verdicts: disclaimed and superseded entries -----------------------------------------------


async def test_disclaimed_spelling_is_404_and_forgotten(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    await resolve_route(cache, "prod")
    assert cache.indexed("prod") == fleet.id
    del store.fleets[fleet.id]
    await expect_error(cache, "prod", ErrorCode.FLEET_NOT_FOUND)
    assert cache.indexed("prod") is None
    assert cache.cached_revision(fleet.id) is None
    store.pointer_error = down()
    await expect_error(cache, "prod", ErrorCode.STATE_STORE_UNAVAILABLE)
    await expect_error(cache, str(fleet.id), ErrorCode.STATE_STORE_UNAVAILABLE)


async def test_a_load_overtaken_by_a_verdict_is_served_but_not_cached(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    gate = asyncio.Event()
    store.snapshot_gates.append(gate)
    slow = asyncio.create_task(resolve_route(cache, "prod"))
    await until(lambda: store.snapshot_loads == 1)
    # While that load is in flight the store disclaims the fleet.
    del store.fleets[fleet.id]
    await expect_error(cache, "prod", ErrorCode.FLEET_NOT_FOUND)
    gate.set()
    assert (await slow).fleet_id == fleet.id  # it answers with what it read ...
    assert cache.cached_revision(fleet.id) is None  # ... but cannot undo the verdict
    assert cache.indexed("prod") is None


async def test_an_older_pointer_read_cannot_restore_a_forgotten_spelling(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    gate = asyncio.Event()
    store.pointer_gates.append(gate)
    older = asyncio.create_task(resolve_route(cache, str(fleet.id)))  # reads while "prod" exists
    await until(lambda: store.pointer_reads == 1)
    del store.fleets[fleet.id]
    await expect_error(cache, "prod", ErrorCode.FLEET_NOT_FOUND)  # a newer read: gone
    store.fleets[fleet.id] = fleet  # the older request's snapshot load still succeeds
    gate.set()
    await older
    assert cache.indexed(str(fleet.id)) == fleet.id
    assert cache.indexed("prod") is None  # the newer verdict on that spelling stands


async def test_a_lower_revision_never_replaces_a_higher_one(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod", revision=5)
    cache = make_cache(store, clock, ttl_ms=1000)
    await resolve_route(cache, "prod")
    clock.advance(2)
    store.snapshot_revision_override = 4  # a load that read older state
    lookup = await resolve_route(cache, "prod")
    assert lookup.snapshot.route_revision == 4
    assert cache.cached_revision(fleet.id) == 5


# -- aliases -----------------------------------------------------------------------------------


async def test_every_accepted_spelling_is_indexed_onto_the_id(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    cache = make_cache(store, clock)
    await resolve_route(cache, str(fleet.id).upper())
    assert cache.indexed("prod") == fleet.id
    assert cache.indexed(str(fleet.id)) == fleet.id
    assert len(cache) == 1
    store.pointer_error = down()
    for ref in ("prod", str(fleet.id), str(fleet.id).upper()):
        lookup = await resolve_route(cache, ref)
        assert lookup.stale
        assert lookup.fleet_id == fleet.id


async def test_a_uuid_shaped_slug_is_never_an_alias(store: ScriptedStore, clock: FakeClock) -> None:
    tricky = str(uuid.uuid4())
    fleet = store.add(tricky)
    cache = make_cache(store, clock)
    lookup = await resolve_route(cache, tricky)
    assert lookup.fleet_id == fleet.id
    assert cache.indexed(tricky) is None
    assert cache.indexed(str(fleet.id)) == fleet.id
    store.pointer_error = down()
    await expect_error(cache, tricky, ErrorCode.STATE_STORE_UNAVAILABLE)
    assert (await resolve_route(cache, str(fleet.id))).stale


async def test_a_slug_that_moves_to_another_fleet_is_reindexed(
    store: ScriptedStore, clock: FakeClock
) -> None:
    first = store.add("prod")
    cache = make_cache(store, clock)
    await resolve_route(cache, "prod")
    del store.fleets[first.id]
    second = store.add("prod")
    assert (await resolve_route(cache, "prod")).fleet_id == second.id
    assert cache.indexed("prod") == second.id
    store.pointer_error = down()
    assert (await resolve_route(cache, "prod")).fleet_id == second.id


# -- size bound --------------------------------------------------------------------------------


async def test_lru_bound_evicts_the_least_recently_used(
    store: ScriptedStore, clock: FakeClock
) -> None:
    a, b, c = (store.add(s) for s in ("a", "b", "c"))
    cache = make_cache(store, clock, max_fleets=2)
    await resolve_route(cache, "a")
    await resolve_route(cache, "b")
    await resolve_route(cache, "a")  # a is now the most recently used
    await resolve_route(cache, "c")
    assert len(cache) == 2
    assert cache.cached_revision(b.id) is None
    assert cache.cached_revision(a.id) == 1
    assert cache.indexed("b") is None
    store.pointer_error = down()
    await expect_error(cache, "b", ErrorCode.STATE_STORE_UNAVAILABLE)
    assert (await resolve_route(cache, "c")).fleet_id == c.id


# -- logging -----------------------------------------------------------------------------------


async def test_stale_serving_is_logged_on_transitions_only(
    store: ScriptedStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    store.add("prod")
    cache = make_cache(store, clock, outage_memo_ms=100)
    await resolve_route(cache, "prod")
    caplog.set_level(logging.INFO, logger="haru_server._route_cache")
    store.pointer_error = down()
    for _ in range(20):
        await resolve_route(cache, "prod")
        clock.advance(0.05)
    entering = [r for r in caplog.records if "serving cached routing" in r.getMessage()]
    assert len(entering) == 1
    assert entering[0].levelno == logging.WARNING
    outage = [r for r in caplog.records if "failing open" in r.getMessage()]
    assert len(outage) == 1
    caplog.clear()
    store.pointer_error = None
    clock.advance(1)
    for _ in range(5):
        await resolve_route(cache, "prod")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("confirmed by the state store again" in m for m in messages) == 1
    assert sum("reachable again" in m for m in messages) == 1


def test_max_fleets_must_be_positive(store: ScriptedStore, clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="max_fleets"):
        make_cache(store, clock, max_fleets=0)


async def test_a_lease_is_kept_only_from_reads_made_after_the_process_recorded_it(
    store: ScriptedStore, clock: FakeClock
) -> None:
    fleet = store.add("prod")
    store.record_error = down()
    never = asyncio.Event()

    async def sleep(_: float) -> None:
        await never.wait()  # no refresher round runs unless the test says so

    cache: RouteCache[FleetSnapshot] = RouteCache(
        store,
        build=lambda s: s,
        monotonic=clock,
        ttl_ms=600_000,
        outage_memo_ms=1_000,
        pointer_timeout_ms=50,
        lease_ms=100,
        sleep=sleep,
    )

    async def settle() -> None:
        for _ in range(10):
            await asyncio.sleep(0)

    try:
        # The store refuses the record: no lease, every request reads (and the record is
        # retried only after the outage memo, never once per request).
        for _ in range(3):
            assert not (await resolve_route(cache, "prod")).stale
            await settle()
        assert store.pointer_reads == 3
        assert cache.leased(fleet.id) is None
        assert store.lease_records == [(fleet.id, 100)]
        store.record_error = None
        clock.advance(1.0)
        await resolve_route(cache, "prod")  # starts the record; this read predates it
        await settle()
        assert store.lease_records == [(fleet.id, 100)] * 2
        assert cache.leased(fleet.id) is None
        await resolve_route(cache, "prod")  # read after the record: the lease starts here
        assert cache.refreshing(fleet.id)
        for _ in range(5):
            await resolve_route(cache, "prod")
        assert store.pointer_reads == 5
        assert len(store.lease_records) == 2
    finally:
        await cache.aclose()


# -- an expired lease is routed on only after a read ------------------------------------------

LEASE_WINDOW_S = 0.15
"""lease_ms + pointer_timeout_ms of :func:`leased_cache`: a lease confirmed longer ago expired."""


@dataclass
class Leased:
    cache: RouteCache[FleetSnapshot]
    fleet: Fleet
    rounds: asyncio.Queue[None]
    """One item lets the refresher run one round (its pause is otherwise endless)."""


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def leased_cache(store: ScriptedStore, clock: FakeClock) -> Leased:
    fleet = store.add("prod")
    rounds: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(_: float) -> None:
        await rounds.get()

    cache: RouteCache[FleetSnapshot] = RouteCache(
        store,
        build=lambda s: s,
        monotonic=clock,
        ttl_ms=600_000,
        outage_memo_ms=1_000,
        pointer_timeout_ms=50,
        lease_ms=100,
        sleep=sleep,
    )
    await resolve_route(cache, "prod")  # records the lease
    await settle()
    await resolve_route(cache, "prod")  # read after the record: leased from here on
    assert cache.refreshing(fleet.id)
    assert store.pointer_reads == 2
    return Leased(cache, fleet, rounds)


async def test_a_lease_expired_by_a_pause_is_read_before_routing(
    store: ScriptedStore, clock: FakeClock
) -> None:
    leased = await leased_cache(store, clock)
    try:
        # The process stood still (SIGSTOP) while the pointer moved; the monotonic clock ran on.
        clock.advance(10.0)
        leased.fleet.revision = 2
        lookup = await resolve_route(leased.cache, "prod")
        assert store.pointer_reads == 3  # read before routing, though the refresher did not run
        assert not lookup.stale
        assert lookup.snapshot.route_revision == 2
        # The read confirmed the lease again: the next requests route on it without reading.
        assert not (await resolve_route(leased.cache, "prod")).stale
        assert store.pointer_reads == 3
    finally:
        await leased.cache.aclose()


async def test_an_expired_lease_fails_open_only_when_its_read_fails(
    store: ScriptedStore, clock: FakeClock
) -> None:
    leased = await leased_cache(store, clock)
    try:
        clock.advance(10.0)
        store.pointer_error = down()
        assert (await resolve_route(leased.cache, "prod")).stale
        assert store.pointer_reads == 3  # the read was tried first
        # That failure spares the next requests a read for the lease's own window, no longer.
        clock.advance(LEASE_WINDOW_S - 0.01)
        assert (await resolve_route(leased.cache, "prod")).stale
        assert store.pointer_reads == 3
        clock.advance(0.02)
        store.pointer_error = None
        leased.fleet.revision = 2
        lookup = await resolve_route(leased.cache, "prod")
        assert store.pointer_reads == 4
        assert not lookup.stale
        assert lookup.snapshot.route_revision == 2
    finally:
        await leased.cache.aclose()


async def test_an_outage_memo_from_before_a_pause_never_skips_the_read(
    store: ScriptedStore, clock: FakeClock
) -> None:
    leased = await leased_cache(store, clock)
    try:
        store.pointer_error = down()
        leased.rounds.put_nowait(None)  # one refresher round: its read fails
        await settle()
        assert store.pointer_reads == 3
        assert leased.cache.in_outage
        # Paused for less than the process-wide outage memo (1 s) but longer than the lease
        # window; meanwhile the store came back and the pointer moved.
        store.pointer_error = None
        leased.fleet.revision = 2
        clock.advance(0.5)
        lookup = await resolve_route(leased.cache, "prod")
        assert store.pointer_reads == 4
        assert not lookup.stale
        assert lookup.snapshot.route_revision == 2
        assert not leased.cache.in_outage
    finally:
        await leased.cache.aclose()


async def test_requests_on_an_expired_lease_share_the_reads(
    store: ScriptedStore, clock: FakeClock
) -> None:
    leased = await leased_cache(store, clock)
    try:
        clock.advance(10.0)
        leased.fleet.revision = 2
        gate = asyncio.Event()
        store.pointer_gates = [gate]
        tasks = [asyncio.create_task(resolve_route(leased.cache, "prod")) for _ in range(20)]
        await settle()
        assert store.pointer_reads == 3  # one read in flight for all of them
        gate.set()
        lookups = await asyncio.gather(*tasks)
        # The first request's read, then one more for all who arrived while it ran.
        assert store.pointer_reads == 4
        assert all(not lk.stale and lk.snapshot.route_revision == 2 for lk in lookups)
    finally:
        await leased.cache.aclose()


async def test_a_read_in_flight_across_a_stall_keeps_its_bound(
    store: ScriptedStore, clock: FakeClock
) -> None:
    store.add("prod")
    cache = make_cache(store, clock, pointer_timeout_ms=200)
    assert not (await resolve_route(cache, "prod")).stale
    gate = asyncio.Event()
    store.pointer_gates = [gate]
    request = asyncio.create_task(resolve_route(cache, "prod"))
    await settle()
    assert store.pointer_reads == 2  # in flight
    # The whole process stands still past the read's bound (as under SIGSTOP): its timers are
    # overdue when it runs again, and the store answers right after.
    time.sleep(0.3)  # noqa: TID251, ASYNC251 - blocking the loop is the point
    asyncio.get_running_loop().call_later(0.01, gate.set)
    lookup = await request
    assert not lookup.stale  # the read was given the rest of its bound, not failed at once
    assert not cache.in_outage
    await cache.aclose()


async def test_a_promotion_is_dated_from_when_this_process_first_saw_it(
    store: ScriptedStore, clock: FakeClock
) -> None:
    cache = make_cache(store, clock)
    fleet = store.add("prod")
    await resolve_route(cache, "prod")
    assert cache.promotion_since(fleet.id) is None
    fleet.promoting = True
    await resolve_route(cache, "prod")
    first = clock.now
    assert cache.promotion_since(fleet.id) == first
    clock.advance(5)
    await resolve_route(cache, "prod")  # the same promotion, still in flight: its sighting stays
    assert cache.promotion_since(fleet.id) == first
    assert cache.promotion_in_flight(fleet.id)
    fleet.promoting = False
    await resolve_route(cache, "prod")
    assert cache.promotion_since(fleet.id) is None
    assert not cache.promotion_in_flight(fleet.id)
    clock.advance(5)
    cache.note_promotion(fleet.id)  # accepted by this process: known before any read
    assert cache.promotion_since(fleet.id) == clock.now


async def test_lease_ages_count_from_the_read_that_confirmed_the_pointer(
    store: ScriptedStore, clock: FakeClock
) -> None:
    leased = await leased_cache(store, clock)
    try:
        assert leased.cache.lease_ages() == {"prod": 0.0}
        clock.advance(0.5)  # the refresher is paused: nothing confirms the pointer
        assert leased.cache.lease_ages() == {"prod": pytest.approx(0.5)}
        leased.rounds.put_nowait(None)  # one refresher round reads and confirms it
        await settle()
        assert store.pointer_reads == 3
        assert leased.cache.lease_ages() == {"prod": 0.0}
    finally:
        await leased.cache.aclose()
    assert make_cache(store, clock).lease_ages() == {}  # lease_ms = 0: nothing is leased
