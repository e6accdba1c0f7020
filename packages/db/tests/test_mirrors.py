"""Slot mirrors ride an operation's CAS: moved in the same statement, only when it lands."""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

import pytest
import sqlalchemy as sa
from haru_core import InvalidTransitionError
from haru_db import OperationEvent, SlotMirror, StateStore
from haru_db._tables import operations, slots
from haru_protocol import (
    EventType,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationStep,
    SlotKind,
)
from sqlalchemy.ext.asyncio import AsyncEngine

S = OperationStep
TRAINING, INFERENCE = SlotKind.TRAINING, SlotKind.INFERENCE


async def _states(store: StateStore, domain_id: UUID, kind: SlotKind) -> list[str]:
    fleet = await store.get_fleet_snapshot("fleet")
    assert fleet is not None
    domain = fleet.domain(domain_id)
    assert domain is not None
    return sorted(str(s.state) for s in domain.slots if s.kind is kind)


async def _promote(store: StateStore, fleet: FleetSnapshot, now: datetime) -> Operation:
    beta = fleet.domains[1]
    # The standby trains, as its posture wants.
    assert await store.transition_domain_slots(
        beta.id, kind=TRAINING, from_states=("idle",), to="training", at=now
    )
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=beta.id, at=now
    )
    assert created
    return operation


async def test_a_promotions_mirrors_ride_its_claim_and_advances(
    store: StateStore, fleet: FleetSnapshot, now: datetime, raw_engine: AsyncEngine
) -> None:
    operation = await _promote(store, fleet, now)
    beta = operation.target_domain_id
    training = len(await _states(store, beta, TRAINING))
    assert training > 0
    assert await store.claim_operation(
        operation.id,
        first_step=S.STOP_TRAINING,
        at=now,
        entry_mirror=SlotMirror(TRAINING, ("training",), "stopping"),
    )
    assert await _states(store, beta, TRAINING) == ["stopping"] * training

    later = now + timedelta(seconds=1)
    done = OperationEvent(EventType.OPERATION_STEP_DONE.value, {"step": "stop_training"})
    assert await store.advance_step(
        operation.id,
        from_step=S.STOP_TRAINING,
        to_step=S.VERIFY_GPU,
        at=later,
        events=(done, OperationEvent("test.second", {"n": 2})),
        exit_mirror=SlotMirror(
            TRAINING, ("stopping", "training"), "idle", count_into="trainingSlotsIdle"
        ),
    )
    assert await _states(store, beta, TRAINING) == ["idle"] * training
    events = [e for e in await store.list_events(fleet.id) if e.operation_id == operation.id]
    # The count lands in the first event only.
    assert [(e.type, e.payload) for e in events] == [
        ("operation.step.done", {"step": "stop_training", "trainingSlotsIdle": training}),
        ("test.second", {"n": 2}),
    ]
    async with raw_engine.connect() as conn:
        stamped = await conn.scalars(
            sa.select(slots.c.state_updated_at).where(
                slots.c.domain_id == beta, slots.c.kind == TRAINING.value
            )
        )
        assert set(stamped) == {later}

    # An entry mirror alone (wake_vllm's first move), and a mirror with no event at all.
    assert await store.advance_step(
        operation.id,
        from_step=S.VERIFY_GPU,
        to_step=S.WAKE_VLLM,
        at=later,
        entry_mirror=SlotMirror(INFERENCE, ("sleeping", "failed"), "waking"),
    )
    inference = await _states(store, beta, INFERENCE)
    assert inference
    assert set(inference) == {"waking"}
    async with raw_engine.connect() as conn:
        pending = (
            await conn.execute(
                sa.select(operations.c.pending_events, operations.c.pending_mirrors).where(
                    operations.c.id == operation.id
                )
            )
        ).one()
    assert tuple(pending) == (None, None)


async def test_a_lost_cas_moves_no_slot(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    beta = operation.target_domain_id
    before = await _states(store, beta, TRAINING)
    stop = SlotMirror(TRAINING, ("training",), "stopping")
    # Not claimed yet: advance and complete lose, and so do their mirrors.
    assert not await store.advance_step(
        operation.id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=now, entry_mirror=stop
    )
    assert not await store.complete_operation(
        operation.id, from_step=S.STOP_TRAINING, at=now, exit_mirror=stop
    )
    assert await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=now)
    assert not await store.claim_operation(
        operation.id, first_step=S.STOP_TRAINING, at=now, entry_mirror=stop
    )
    assert await _states(store, beta, TRAINING) == before
    assert [e for e in await store.list_events(fleet.id) if e.operation_id] == []


async def test_a_mirror_on_the_source_domain(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    alpha = operation.source_domain_id
    assert alpha is not None
    assert alpha != operation.target_domain_id
    serving = await _states(store, alpha, INFERENCE)
    assert serving
    assert set(serving) == {"serving"}
    target_before = await _states(store, operation.target_domain_id, INFERENCE)
    assert await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=now)
    done = OperationEvent(EventType.OPERATION_STEP_DONE.value, {"step": "stop_training"})
    assert await store.complete_operation(
        operation.id,
        from_step=S.STOP_TRAINING,
        at=now,
        events=(done,),
        exit_mirror=SlotMirror(
            INFERENCE,
            ("serving", "probing", "waking", "failed"),
            "sleeping",
            on_source=True,
            count_into="inferenceSlotsSleeping",
        ),
    )
    slept = await _states(store, alpha, INFERENCE)
    assert set(slept) == {"sleeping"}
    # The target's slots were not touched.
    assert await _states(store, operation.target_domain_id, INFERENCE) == target_before
    events = [e for e in await store.list_events(fleet.id) if e.operation_id == operation.id]
    assert [e.payload for e in events] == [
        {"step": "stop_training", "inferenceSlotsSleeping": len(slept)}
    ]


async def test_bad_mirrors_are_refused_before_any_sql(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    with pytest.raises(InvalidTransitionError):
        await store.claim_operation(
            operation.id,
            first_step=S.STOP_TRAINING,
            at=now,
            entry_mirror=SlotMirror(TRAINING, ("idle",), "stopping"),
        )
    with pytest.raises(ValueError, match="different slots"):
        await store.advance_step(
            operation.id,
            from_step=S.STOP_TRAINING,
            to_step=S.VERIFY_GPU,
            at=now,
            exit_mirror=SlotMirror(TRAINING, ("stopping",), "idle"),
            entry_mirror=SlotMirror(TRAINING, ("idle",), "training"),
        )
    with pytest.raises(ValueError, match="exit mirror"):
        await store.advance_step(
            operation.id,
            from_step=S.STOP_TRAINING,
            to_step=S.VERIFY_GPU,
            at=now,
            entry_mirror=SlotMirror(INFERENCE, ("sleeping",), "waking", count_into="n"),
        )
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.state.value == "pending"
