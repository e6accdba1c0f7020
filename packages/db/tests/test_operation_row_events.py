"""The route switch, an operation's fail and a best-effort degrade append their events in
their own statement (DESIGN 5.3, migration 0013): a landed switch has exactly its
``routing.switched`` (about the operation and the target, with the revision it wrote), a lost
one none, and an event that cannot be stored keeps the write from landing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta

import pytest
from haru_db import HaruDbError, OperationEvent, StateStore
from haru_protocol import (
    DomainState,
    Event,
    FleetSnapshot,
    Operation,
    OperationError,
    OperationErrorCode,
    OperationFailed,
    OperationKind,
    OperationState,
    OperationStep,
    OperationStepTimeoutBestEffort,
    RoutingSwitched,
)

RefuseEvents = Callable[[str], AbstractAsyncContextManager[None]]
StatementWrites = Callable[[StateStore], AbstractContextManager[list[str]]]
S = OperationStep


async def _at_switch(store: StateStore, fleet: FleetSnapshot, at: datetime) -> Operation:
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=at
    )
    assert created
    assert await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=at)
    assert await store.advance_step(
        operation.id, from_step=S.STOP_TRAINING, to_step=S.SWITCH_ACTIVE, at=at
    )
    return operation


async def _switch(
    store: StateStore, fleet: FleetSnapshot, operation: Operation, at: datetime
) -> bool:
    return await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=fleet.domains[0].id,
        target_domain_id=fleet.domains[1].id,
        operation_id=operation.id,
        at=at,
    )


async def _since(store: StateStore, fleet: FleetSnapshot, before: list[Event]) -> list[Event]:
    return await store.list_events(fleet.id, after=before[-1].id if before else 0)


async def test_a_landed_switch_appends_its_event_in_its_statement(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    operation = await _at_switch(store, fleet, now)
    at = now + timedelta(seconds=3)
    before = await store.list_events(fleet.id)
    with statement_writes(store) as writes:
        assert await _switch(store, fleet, operation, at)
    assert len(writes) == 1
    pointer = await store.get_fleet_route_pointer(fleet.slug)
    assert pointer is not None
    assert pointer.route_revision == fleet.route_revision + 1
    appended = await _since(store, fleet, before)
    assert [(e.type, e.data) for e in appended] == [
        (
            "routing.switched",
            RoutingSwitched(
                from_domain_id=fleet.domains[0].id,
                to_domain_id=fleet.domains[1].id,
                route_revision=pointer.route_revision,
            ),
        )
    ]
    stored = appended[0]
    assert (stored.fleet_id, stored.domain_id, stored.slot_id, stored.operation_id) == (
        fleet.id,
        fleet.domains[1].id,
        None,
        operation.id,
    )
    assert stored.created_at == at


async def test_a_lost_switch_appends_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _at_switch(store, fleet, now)
    assert await _switch(store, fleet, operation, now)
    before = await store.list_events(fleet.id)
    # The pointer no longer names the expected domain: the switch loses, and says nothing.
    assert not await _switch(store, fleet, operation, now)
    assert await store.list_events(fleet.id) == before


async def test_a_switch_whose_event_is_refused_moves_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime, refuse_events: RefuseEvents
) -> None:
    operation = await _at_switch(store, fleet, now)
    before = await store.list_events(fleet.id)
    async with refuse_events("routing.switched"):
        with pytest.raises(HaruDbError):
            await _switch(store, fleet, operation, now)
    pointer = await store.get_fleet_route_pointer(fleet.slug)
    assert pointer is not None
    assert (pointer.active_domain_id, pointer.route_revision) == (
        fleet.active_domain_id,
        fleet.route_revision,
    )
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.routing_committed is False
    assert await store.list_events(fleet.id) == before
    # Once events can be stored again, the same switch lands with its event.
    assert await _switch(store, fleet, operation, now)
    assert [e.type for e in await _since(store, fleet, before)] == ["routing.switched"]


async def test_a_degrade_about_an_operation_stores_the_operation_with_its_event(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    operation = await _at_switch(store, fleet, now)
    source = fleet.domains[0]
    timed_out = OperationStepTimeoutBestEffort(
        step=S.DEMOTE_OLD_SLEEP, source_domain_id=source.id, source_degraded=True
    )
    before = await store.list_events(fleet.id)
    with statement_writes(store) as writes:
        assert await store.transition_domain(
            source.id,
            from_states=(DomainState.READY,),
            to=DomainState.DEGRADED,
            at=now,
            events=[timed_out],
            fleet_id=fleet.id,
            operation_id=operation.id,
        )
    assert len(writes) == 1
    appended = await _since(store, fleet, before)
    assert [(e.type, e.data) for e in appended] == [
        ("operation.step.timeout_best_effort", timed_out)
    ]
    assert (appended[0].domain_id, appended[0].operation_id) == (source.id, operation.id)


PROBE_FAILED = OperationFailed(
    step=S.PROBE, code=OperationErrorCode.PROBE_FAILED, message="probe failed: chat (500)"
)
ERROR = OperationError(step=S.PROBE, code="probe_failed", message="probe failed: chat (500)")


async def _fail(store: StateStore, operation: Operation, at: datetime) -> bool:
    return await store.fail_operation(
        operation.id,
        error=ERROR,
        at=at,
        expected_step=S.SWITCH_ACTIVE,
        target_not_routed=True,
        events=(OperationEvent.of(PROBE_FAILED),),
    )


async def test_a_landed_fail_appends_its_event_in_its_statement(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    operation = await _at_switch(store, fleet, now)
    at = now + timedelta(seconds=4)
    before = await store.list_events(fleet.id)
    with statement_writes(store) as writes:
        assert await _fail(store, operation, at)
    assert len(writes) == 1
    appended = await _since(store, fleet, before)
    assert [(e.type, e.data) for e in appended] == [("operation.failed", PROBE_FAILED)]
    stored = appended[0]
    assert (stored.domain_id, stored.operation_id, stored.created_at) == (
        fleet.domains[1].id,
        operation.id,
        at,
    )
    # Failed already: a second fail loses and says nothing.
    assert not await _fail(store, operation, at)
    assert await _since(store, fleet, before) == appended


async def test_a_fail_whose_event_is_refused_does_not_land(
    store: StateStore, fleet: FleetSnapshot, now: datetime, refuse_events: RefuseEvents
) -> None:
    operation = await _at_switch(store, fleet, now)
    before = await store.list_events(fleet.id)
    async with refuse_events("operation.failed"):
        with pytest.raises(HaruDbError):
            await _fail(store, operation, now)
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.state is OperationState.RUNNING
    assert await store.list_events(fleet.id) == before
