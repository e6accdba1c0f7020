"""The provisioner's launch writes (claim, launched, address) append their events in their own
statement (DESIGN 5.3): a landed one has exactly them, with the domain's ids and its time; a
lost one adds none; an event that cannot be stored keeps the write from landing; and events
with ids other than the row's do not land."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest
import pytest_asyncio
from haru_db import HaruDbError, StateStore
from haru_protocol import (
    DomainAddressRecorded,
    DomainLaunchStarted,
    DomainLaunchSucceeded,
    DomainSnapshot,
    Event,
    EventPayload,
    EventType,
    FleetLayout,
)

LayoutFactory = Callable[..., FleetLayout]
RefuseEvents = Callable[[str], AbstractAsyncContextManager[None]]
StatementWrites = Callable[[StateStore], AbstractContextManager[list[str]]]

CLUSTER = "haru-fleet--gamma"
SUPERVISOR = "https://10.0.0.9:8701"
SERVING = "https://10.0.0.9:8000"


@dataclass(frozen=True)
class LaunchWrite:
    """One launch write: the writes before it (at attempt 1), and itself at ``attempt``."""

    name: str
    event: EventPayload
    claimed_first: bool
    run: Callable[..., Awaitable[bool]]

    async def prepare(self, store: StateStore, gamma: DomainSnapshot, at: datetime) -> None:
        if self.claimed_first:
            assert await store.claim_launch(gamma.id, expected_attempt=0, at=at)


async def _claim(store: StateStore, gamma: DomainSnapshot, attempt: int, **kw: Any) -> bool:
    return await store.claim_launch(gamma.id, expected_attempt=attempt - 1, **kw)


async def _launched(store: StateStore, gamma: DomainSnapshot, attempt: int, **kw: Any) -> bool:
    return await store.mark_launched(gamma.id, attempt=attempt, **kw)


async def _address(store: StateStore, gamma: DomainSnapshot, attempt: int, **kw: Any) -> bool:
    return await store.record_domain_address(
        gamma.id,
        attempt=attempt,
        supervisor_url=SUPERVISOR,
        serving_base_url=SERVING,
        model_urls={"gamma-small": f"{SERVING}/m/gamma-small"},
        **kw,
    )


WRITES = [
    LaunchWrite(
        "claim_launch",
        DomainLaunchStarted(cluster=CLUSTER, attempt=1, role="standby"),
        claimed_first=False,
        run=_claim,
    ),
    LaunchWrite(
        "mark_launched",
        DomainLaunchSucceeded(cluster=CLUSTER, attempt=1, observed=True),
        claimed_first=True,
        run=_launched,
    ),
    LaunchWrite(
        "record_domain_address",
        DomainAddressRecorded(
            cluster=CLUSTER, attempt=1, supervisor_url=SUPERVISOR, serving_base_url=SERVING
        ),
        claimed_first=True,
        run=_address,
    ),
]


@pytest.fixture(params=WRITES, ids=[w.name for w in WRITES])
def write(request: pytest.FixtureRequest) -> LaunchWrite:
    param: LaunchWrite = request.param
    return param


@pytest_asyncio.fixture
async def gamma(
    store: StateStore,
    make_layout: LayoutFactory,
    domain_document: Callable[..., Any],
    now: datetime,
) -> DomainSnapshot:
    """A provisioned standby domain of fleet ``fleet``, never launched."""
    layout = make_layout("fleet", domains=["alpha", domain_document("gamma", provider="skypilot")])
    await store.apply_fleet_layout(layout, at=now)
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    return snapshot.domains[1]


async def _run(
    store: StateStore,
    gamma: DomainSnapshot,
    write: LaunchWrite,
    at: datetime,
    *,
    attempt: int = 1,
    fleet_id: UUID | None = None,
) -> bool:
    return await write.run(
        store,
        gamma,
        attempt,
        at=at,
        events=(write.event,),
        fleet_id=gamma.fleet_id if fleet_id is None else fleet_id,
    )


async def _row(store: StateStore, gamma: DomainSnapshot) -> DomainSnapshot:
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    return next(d for d in snapshot.domains if d.id == gamma.id)


def _launch_fields(domain: DomainSnapshot) -> tuple[object, ...]:
    return (
        domain.launch_attempt,
        domain.launch_started_at,
        domain.launched_at,
        domain.supervisor_url,
        domain.serving_base_url,
    )


async def _events_since(
    store: StateStore, gamma: DomainSnapshot, after: list[Event]
) -> list[Event]:
    return await store.list_events(gamma.fleet_id, after=after[-1].id if after else 0)


async def test_a_landed_launch_write_appends_exactly_its_events(
    store: StateStore,
    gamma: DomainSnapshot,
    write: LaunchWrite,
    now: datetime,
    statement_writes: StatementWrites,
) -> None:
    await write.prepare(store, gamma, now)
    before_row = await _row(store, gamma)
    at = now + timedelta(seconds=5)
    before = await store.list_events(gamma.fleet_id)
    with statement_writes(store) as writes:
        assert await _run(store, gamma, write, at)
    # One write: the launch write and its event (a CTE on PostgreSQL, a trigger on SQLite).
    assert len(writes) == 1
    appended = await _events_since(store, gamma, before)
    assert [(e.type, e.data) for e in appended] == [(write.event.event_type, write.event)]
    stored = appended[0]
    assert (stored.fleet_id, stored.domain_id, stored.slot_id) == (gamma.fleet_id, gamma.id, None)
    assert stored.operation_id is None
    # SQLite's trigger stamps the row's updated_at: the write's own time, as on PostgreSQL.
    assert stored.created_at == at
    assert _launch_fields(await _row(store, gamma)) != _launch_fields(before_row)


async def test_a_launch_write_that_loses_its_guard_appends_nothing(
    store: StateStore, gamma: DomainSnapshot, write: LaunchWrite, now: datetime
) -> None:
    await write.prepare(store, gamma, now)
    before_row = await _row(store, gamma)
    before = await store.list_events(gamma.fleet_id)
    # Another attempt than the domain's: the claim, the outcome and the address all lose.
    assert not await _run(store, gamma, write, now, attempt=2)
    assert await store.list_events(gamma.fleet_id) == before
    assert await _row(store, gamma) == before_row


async def test_a_launch_write_whose_event_is_refused_does_not_land(
    store: StateStore,
    gamma: DomainSnapshot,
    write: LaunchWrite,
    now: datetime,
    refuse_events: RefuseEvents,
) -> None:
    await write.prepare(store, gamma, now)
    before_row = await _row(store, gamma)
    before = await store.list_events(gamma.fleet_id)
    async with refuse_events(write.event.event_type):
        with pytest.raises(HaruDbError):
            await _run(store, gamma, write, now + timedelta(seconds=5))
    # Neither the write nor its event: one statement, so never one without the other.
    assert await _row(store, gamma) == before_row
    assert await store.list_events(gamma.fleet_id) == before


async def test_launch_events_with_ids_other_than_the_rows_do_not_land(
    store: StateStore,
    gamma: DomainSnapshot,
    write: LaunchWrite,
    make_layout: LayoutFactory,
    now: datetime,
) -> None:
    await store.apply_fleet_layout(make_layout("other", domains=["alpha"]), at=now)
    other = await store.get_fleet_snapshot("other")
    assert other is not None
    await write.prepare(store, gamma, now)
    before_row = await _row(store, gamma)
    before = await store.list_events(gamma.fleet_id)
    before_other = await store.list_events(other.id)
    # PostgreSQL would store the ids given, SQLite's trigger the row's: the write itself is
    # guarded on them, so neither engine files an event under another fleet.
    for fleet_id in (other.id, uuid4()):
        assert not await _run(store, gamma, write, now, fleet_id=fleet_id)
    assert await store.list_events(gamma.fleet_id) == before
    assert await store.list_events(other.id) == before_other
    assert await _row(store, gamma) == before_row


async def test_launch_events_need_the_domains_fleet(
    store: StateStore, gamma: DomainSnapshot, write: LaunchWrite, now: datetime
) -> None:
    await write.prepare(store, gamma, now)
    before_row = await _row(store, gamma)
    with pytest.raises(ValueError, match="fleet_id"):
        await write.run(store, gamma, 1, at=now, events=(write.event,))
    # Refused before any write.
    assert await _row(store, gamma) == before_row


async def test_a_claims_cluster_name_is_read_back_from_its_event(
    store: StateStore, gamma: DomainSnapshot, now: datetime
) -> None:
    # The provisioner finds the cluster of a claimed attempt by this query (an earlier
    # launch's name may differ from the one a new launch takes).
    started = DomainLaunchStarted(cluster="haru-fleet-gamma", attempt=1, role="standby")
    assert await _claim(store, gamma, 1, at=now, events=(started,), fleet_id=gamma.fleet_id)
    page = await store.list_domain_events(
        gamma.fleet_id, gamma.id, types=(EventType.DOMAIN_LAUNCH_STARTED,), limit=1
    )
    assert [e.data for e in page] == [started]
