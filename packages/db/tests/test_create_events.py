"""An operation's insert appends its events in its own statement (DESIGN 5.3): a created
operation always has them, a joined one adds none, and an event that cannot be stored keeps
the operation from being created."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta
from uuid import UUID

import psycopg
import pytest
import sqlalchemy as sa
from haru_db import HaruDbError, StateStore
from haru_db._tables import fleets
from haru_protocol import (
    EventPayload,
    FleetSnapshot,
    Operation,
    OperationAutoFailover,
    OperationKind,
    OperationRequestedPromote,
)
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

REFUSED = "operation.auto_failover"
RefuseEvents = Callable[[str], AbstractAsyncContextManager[None]]
StatementWrites = Callable[[StateStore], AbstractContextManager[list[str]]]


def _requested(operation: Operation) -> Sequence[EventPayload]:
    return (
        OperationRequestedPromote(
            kind=operation.kind,
            target_domain_id=operation.target_domain_id,
            source_domain_id=operation.source_domain_id,
        ),
        OperationAutoFailover(
            reason="active_failed",
            active_domain_id=operation.source_domain_id or operation.target_domain_id,
            target_domain_id=operation.target_domain_id,
        ),
    )


async def _fence(raw_engine: AsyncEngine, fleet: FleetSnapshot) -> int:
    async with raw_engine.connect() as conn:
        return int(
            (
                await conn.execute(sa.select(fleets.c.fence).where(fleets.c.id == fleet.id))
            ).scalar_one()
        )


async def test_a_created_operation_appends_its_events_in_its_insert(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    built: list[Operation] = []

    def events(operation: Operation) -> Sequence[EventPayload]:
        built.append(operation)
        return _requested(operation)

    with statement_writes(store) as writes:
        operation, created = await store.create_operation(
            fleet_id=fleet.id,
            kind=OperationKind.PROMOTE,
            target_domain_id=fleet.domains[1].id,
            at=now,
            events=events,
        )
    assert created
    # One write: the insert, its fence bump and its events (a CTE on PostgreSQL).
    assert len(writes) == 1
    # The events were built from the row the insert wrote.
    assert built == [operation]
    assert operation.source_domain_id == fleet.domains[0].id
    stored = [e for e in await store.list_events(fleet.id) if e.operation_id is not None]
    assert [(e.type, e.payload) for e in stored] == [
        (
            "operation.requested.promote",
            {
                "kind": "promote",
                "targetDomainId": str(fleet.domains[1].id),
                "sourceDomainId": str(fleet.domains[0].id),
            },
        ),
        (
            "operation.auto_failover",
            {
                "reason": "active_failed",
                "activeDomainId": str(fleet.domains[0].id),
                "targetDomainId": str(fleet.domains[1].id),
            },
        ),
    ]
    for stored_event in stored:
        assert stored_event.operation_id == operation.id
        assert stored_event.fleet_id == fleet.id
        assert stored_event.domain_id == fleet.domains[1].id
        assert stored_event.created_at == now
    # The column the SQLite trigger reads is cleared by the same statement.
    assert (await store.get_operation(operation.id)) == operation


async def test_a_joined_operation_appends_no_event(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    first, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=fleet.domains[1].id,
        at=now,
        events=_requested,
    )
    assert created
    before = await store.list_events(fleet.id)
    joined, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.DEMOTE,
        target_domain_id=fleet.domains[0].id,
        at=now + timedelta(seconds=1),
        events=_requested,
    )
    assert not created
    assert joined.id == first.id
    assert await store.list_events(fleet.id) == before
    assert len([e for e in before if e.operation_id == first.id]) == 2


async def test_an_event_that_cannot_be_stored_keeps_the_operation_out(
    store: StateStore,
    fleet: FleetSnapshot,
    now: datetime,
    raw_engine: AsyncEngine,
    refuse_events: RefuseEvents,
) -> None:
    fence = await _fence(raw_engine, fleet)
    async with refuse_events(REFUSED):
        with pytest.raises(HaruDbError):
            await store.create_operation(
                fleet_id=fleet.id,
                kind=OperationKind.PROMOTE,
                target_domain_id=fleet.domains[1].id,
                at=now,
                events=_requested,
            )
        # Neither the operation, nor its first event, nor its fence bump.
        assert await store.get_in_flight_operation(fleet.id) is None
        assert [e for e in await store.list_events(fleet.id) if e.operation_id] == []
        assert await _fence(raw_engine, fleet) == fence
    operation, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=fleet.domains[1].id,
        at=now,
        events=_requested,
    )
    assert created
    assert (
        len([e for e in await store.list_events(fleet.id) if e.operation_id == operation.id]) == 2
    )


def _move_pointer(store: StateStore, fleet: FleetSnapshot, to: UUID) -> None:
    """Another writer moves the fleet's pointer (a raw connection of its own, committed)."""
    url = make_url(store.url)
    if store.dialect == "postgresql":
        libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute("UPDATE fleets SET active_domain_id = %s WHERE id = %s", (to, fleet.id))
        return
    lite = sqlite3.connect(str(url.database), isolation_level=None)
    try:
        lite.execute("UPDATE fleets SET active_domain_id = ? WHERE id = ?", (to.hex, fleet.id.hex))
    finally:
        lite.close()


async def test_the_events_name_the_source_the_row_has_when_the_pointer_moves_in_between(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha, beta = fleet.domains[0].id, fleet.domains[1].id
    sources: list[UUID | None] = []

    def events(operation: Operation) -> Sequence[EventPayload]:
        sources.append(operation.source_domain_id)
        if len(sources) == 1:
            # Between the read of the pointer and the insert.
            _move_pointer(store, fleet, beta)
        return _requested(operation)

    operation, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.DEMOTE,
        target_domain_id=alpha,
        at=now,
        events=events,
    )
    assert created
    # The first insert was skipped (the pointer had moved) and the second built from beta.
    assert sources == [alpha, beta]
    assert operation.source_domain_id == beta
    requested = [
        e.payload
        for e in await store.list_events(fleet.id)
        if e.type == "operation.requested.promote"
    ]
    assert [p["sourceDomainId"] for p in requested] == [str(beta)]
