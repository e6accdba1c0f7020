"""Operation CAS writes append their events in the same statement, only when they land."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from haru_db import OperationEvent, StateStore
from haru_db._tables import operations
from haru_protocol import (
    EventType,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationStarted,
    OperationStep,
)
from sqlalchemy.ext.asyncio import AsyncEngine

S = OperationStep


async def _claimed(store: StateStore, fleet: FleetSnapshot, now: datetime) -> Operation:
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    started = OperationEvent.of(
        OperationStarted(kind=OperationKind.PROMOTE, target_domain_id=operation.target_domain_id)
    )
    assert await store.claim_operation(
        operation.id, first_step=S.STOP_TRAINING, at=now, events=(started,)
    )
    return operation


async def _operation_events(store: StateStore, fleet: FleetSnapshot) -> list[tuple[str, object]]:
    return [(e.type, e.payload) for e in await store.list_events(fleet.id) if e.operation_id]


async def test_a_landed_cas_appends_its_events_with_the_operation_facts(
    store: StateStore, fleet: FleetSnapshot, now: datetime, raw_engine: AsyncEngine
) -> None:
    operation = await _claimed(store, fleet, now)
    later = now + timedelta(seconds=2)
    done = OperationEvent(
        EventType.OPERATION_STEP_DONE.value,
        # Raw, with a key its model does not know: stored exactly as given.
        {"step": "stop_training", "trainingSlotsIdle": 2, "detail": {"ok": True, "none": None}},
    )
    assert await store.advance_step(
        operation.id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=later, events=(done,)
    )
    events = [e for e in await store.list_events(fleet.id) if e.operation_id == operation.id]
    assert [(e.type, e.payload) for e in events] == [
        (
            "operation.started",
            {"kind": "promote", "targetDomainId": str(operation.target_domain_id)},
        ),
        ("operation.step.done", done.payload),
    ]
    last = events[-1]
    assert (last.fleet_id, last.domain_id, last.slot_id, last.created_at) == (
        fleet.id,
        operation.target_domain_id,
        None,
        later,
    )
    async with raw_engine.connect() as conn:
        pending = await conn.scalar(
            sa.select(operations.c.pending_events).where(operations.c.id == operation.id)
        )
    assert pending is None


async def test_a_lost_cas_appends_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _claimed(store, fleet, now)
    before = await _operation_events(store, fleet)
    done = OperationEvent(EventType.OPERATION_STEP_DONE.value, {"step": "probe"})
    # Wrong from-step: the CAS loses, and so does its event.
    assert not await store.advance_step(
        operation.id, from_step=S.PROBE, to_step=S.SWITCH_ACTIVE, at=now, events=(done,)
    )
    assert not await store.claim_operation(
        operation.id, first_step=S.STOP_TRAINING, at=now, events=(done,)
    )
    assert not await store.complete_operation(
        operation.id, from_step=S.PROBE, at=now, events=(done,)
    )
    assert await _operation_events(store, fleet) == before


async def test_complete_appends_several_events_in_order(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _claimed(store, fleet, now)
    events = tuple(OperationEvent(f"test.event.{n}", {"n": n, "text": "é\"'\\"}) for n in range(12))
    assert await store.complete_operation(
        operation.id, from_step=S.STOP_TRAINING, at=now, events=events
    )
    appended = [e for e in await store.list_events(fleet.id) if e.type.startswith("test.")]
    assert [(e.type, e.payload) for e in appended] == [(e.type, dict(e.payload)) for e in events]
    assert [e.id for e in appended] == sorted(e.id for e in appended)
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.state.value == "succeeded"


async def test_a_bad_event_is_refused_before_any_sql(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _claimed(store, fleet, now)
    with pytest.raises(TypeError):
        await store.advance_step(
            operation.id,
            from_step=S.STOP_TRAINING,
            to_step=S.VERIFY_GPU,
            at=now,
            events=(OperationEvent("x", {"bad": float("nan")}),),
        )
    with pytest.raises(ValueError, match="1 to 128"):
        await store.advance_step(
            operation.id,
            from_step=S.STOP_TRAINING,
            to_step=S.VERIFY_GPU,
            at=now,
            events=(OperationEvent(""),),
        )
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.current_step is S.STOP_TRAINING


async def test_a_raw_payload_must_fit_its_types_model(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _claimed(store, fleet, now)
    misfit = OperationEvent(EventType.OPERATION_STEP_DONE.value, {"step": "no-such-step"})
    with pytest.raises(ValueError, match="does not fit"):
        await store.advance_step(
            operation.id,
            from_step=S.STOP_TRAINING,
            to_step=S.VERIFY_GPU,
            at=now,
            events=(misfit,),
        )
    with pytest.raises(ValueError, match="does not fit"):
        await store.append_event(
            fleet_id=fleet.id, type=EventType.OPERATION_STARTED, payload={"kind": "x"}, at=now
        )
    with pytest.raises(ValueError, match="belongs to"):
        await store.append_event(
            fleet_id=fleet.id,
            type=EventType.OPERATION_FAILED,
            payload=OperationStarted(kind=OperationKind.DEMOTE, target_domain_id=operation.id),
            at=now,
        )
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.current_step is S.STOP_TRAINING
