"""Operation CAS writes (DESIGN 5.3): each wins once, and each has a losing case."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa
from haru_db import ConstraintViolationError, HaruDbError, StateStore, _operations
from haru_db._exec import Executor
from haru_db._tables import operations, slots
from haru_protocol import (
    FleetLayout,
    FleetSnapshot,
    Operation,
    OperationError,
    OperationErrorCode,
    OperationKind,
    OperationState,
    OperationStep,
    SlotKind,
)
from sqlalchemy.ext.asyncio import AsyncEngine

S = OperationStep
PROBE_FAILED = OperationError(
    step=S.PROBE, code=OperationErrorCode.PROBE_FAILED.value, message="example-chat-small failed"
)


async def _promote(store: StateStore, fleet: FleetSnapshot, at: datetime) -> Operation:
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=at
    )
    assert created
    return operation


async def _running(store: StateStore, fleet: FleetSnapshot, at: datetime, step: S) -> Operation:
    operation = await _promote(store, fleet, at)
    assert await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=at)
    if step is not S.STOP_TRAINING:
        assert await store.advance_step(
            operation.id, from_step=S.STOP_TRAINING, to_step=step, at=at
        )
    return operation


async def _get(store: StateStore, operation_id: UUID) -> Operation:
    operation = await store.get_operation(operation_id)
    assert operation is not None
    return operation


async def _slot_states(store: StateStore, fleet: FleetSnapshot) -> dict[tuple[str, int, str], str]:
    snapshot = await store.get_fleet_snapshot(fleet.slug)
    assert snapshot is not None
    return {
        (d.slug, s.gpu_index, s.kind.value): s.state.value
        for d in snapshot.domains
        for s in d.slots
    }


async def _set_slots(
    engine: AsyncEngine, fleet: FleetSnapshot, states: dict[tuple[int, str], str]
) -> None:
    """Force beta's slots, keyed by (gpu, kind)."""
    beta = fleet.domains[1]
    async with engine.begin() as conn:
        for slot in beta.slots:
            state = states.get((slot.gpu_index, slot.kind.value))
            if state is not None:
                await conn.execute(
                    sa.update(slots).where(slots.c.id == slot.id).values(state=state)
                )


# ---- create ----------------------------------------------------------------------------------


async def test_create_captures_the_pointer_as_source(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    assert operation.state is OperationState.PENDING
    assert operation.kind is OperationKind.PROMOTE
    assert operation.fleet_id == fleet.id
    assert operation.target_domain_id == fleet.domains[1].id
    assert operation.source_domain_id == fleet.active_domain_id == fleet.domains[0].id
    assert (operation.current_step, operation.step_started_at, operation.error) == (
        None,
        None,
        None,
    )
    assert operation.routing_committed is False
    assert (operation.created_at, operation.finished_at) == (now, None)
    assert await store.get_in_flight_operation(fleet.id) == operation
    assert await store.get_operation(operation.id, fleet_id=fleet.id) == operation


async def test_create_joins_the_in_flight_operation(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    first = await _promote(store, fleet, now)
    joined, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.DEMOTE,
        target_domain_id=fleet.domains[1].id,
        at=now + timedelta(seconds=1),
    )
    assert not created
    assert joined == first


async def test_create_after_the_previous_finished(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    first = await _promote(store, fleet, now)
    assert await store.fail_operation(first.id, error=PROBE_FAILED, at=now)
    second, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    assert created
    assert second.id != first.id
    assert second.kind is OperationKind.DEMOTE


async def test_create_without_a_pointer_has_no_source(
    store: StateStore, make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    applied = await store.apply_fleet_layout(make_layout("headless", active=None), at=now)
    snapshot = await store.get_fleet_snapshot("headless")
    assert snapshot is not None
    assert snapshot.active_domain_id is None
    operation, created = await store.create_operation(
        fleet_id=applied.fleet_id,
        kind=OperationKind.PROMOTE,
        target_domain_id=snapshot.domains[0].id,
        at=now,
    )
    assert created
    assert operation.source_domain_id is None


async def test_create_refuses_unknown_fleets_and_foreign_targets(
    store: StateStore, fleet: FleetSnapshot, make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    with pytest.raises(ConstraintViolationError):
        await store.create_operation(
            fleet_id=uuid4(),
            kind=OperationKind.PROMOTE,
            target_domain_id=fleet.domains[1].id,
            at=now,
        )
    await store.apply_fleet_layout(make_layout("other"), at=now)
    other = await store.get_fleet_snapshot("other")
    assert other is not None
    with pytest.raises(ConstraintViolationError):
        await store.create_operation(
            fleet_id=fleet.id,
            kind=OperationKind.PROMOTE,
            target_domain_id=other.domains[1].id,
            at=now,
        )
    assert await store.get_in_flight_operation(fleet.id) is None


async def test_create_retries_when_the_in_flight_operation_finishes_in_between(
    store: StateStore, fleet: FleetSnapshot, now: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = await _promote(store, fleet, now)
    real = _operations.get_in_flight_operation
    calls: list[UUID] = []

    async def finishing_in_between(ex: Executor, fleet_id: UUID) -> Operation | None:
        # The conflicting operation finishes between the insert and this read.
        calls.append(fleet_id)
        assert await store.fail_operation(blocker.id, error=PROBE_FAILED, at=now)
        return await real(ex, fleet_id)

    monkeypatch.setattr(_operations, "get_in_flight_operation", finishing_in_between)
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    assert created
    assert operation.id != blocker.id
    assert calls == [fleet.id]


async def test_create_gives_up_after_a_few_attempts(
    store: StateStore, fleet: FleetSnapshot, now: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _promote(store, fleet, now)
    calls: list[UUID] = []

    async def always_gone(_ex: Executor, fleet_id: UUID) -> Operation | None:
        calls.append(fleet_id)
        return None

    monkeypatch.setattr(_operations, "get_in_flight_operation", always_gone)
    with pytest.raises(HaruDbError, match="attempts"):
        await store.create_operation(
            fleet_id=fleet.id,
            kind=OperationKind.DEMOTE,
            target_domain_id=fleet.domains[1].id,
            at=now,
        )
    assert len(calls) == 5


# ---- claim / advance / complete --------------------------------------------------------------


async def test_claim(store: StateStore, fleet: FleetSnapshot, now: datetime) -> None:
    operation = await _promote(store, fleet, now)
    later = now + timedelta(seconds=3)
    assert await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=later)
    claimed = await _get(store, operation.id)
    assert claimed.state is OperationState.RUNNING
    assert (claimed.current_step, claimed.step_started_at) == (S.STOP_TRAINING, later)
    assert not await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=later)
    assert not await store.claim_operation(uuid4(), first_step=S.STOP_TRAINING, at=later)


async def test_claim_with_a_step_of_the_other_kind_is_refused(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    with pytest.raises(ConstraintViolationError):
        await store.claim_operation(operation.id, first_step=S.SLEEP_VLLM, at=now)
    assert (await _get(store, operation.id)).state is OperationState.PENDING


async def test_advance(store: StateStore, fleet: FleetSnapshot, now: datetime) -> None:
    operation = await _promote(store, fleet, now)
    assert not await store.advance_step(
        operation.id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=now
    ), "a pending operation has no step to advance"
    assert await store.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=now)
    later = now + timedelta(seconds=7)
    assert await store.advance_step(
        operation.id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=later
    )
    advanced = await _get(store, operation.id)
    assert (advanced.current_step, advanced.step_started_at) == (S.VERIFY_GPU, later)
    assert not await store.advance_step(
        operation.id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=later
    )
    assert not await store.advance_step(
        uuid4(), from_step=S.VERIFY_GPU, to_step=S.WAKE_VLLM, at=later
    )


async def test_complete(store: StateStore, fleet: FleetSnapshot, now: datetime) -> None:
    operation = await _running(store, fleet, now, S.DEMOTE_OLD_TRAIN)
    assert not await store.complete_operation(operation.id, from_step=S.DEMOTE_OLD_SLEEP, at=now)
    done_at = now + timedelta(minutes=1)
    assert await store.complete_operation(operation.id, from_step=S.DEMOTE_OLD_TRAIN, at=done_at)
    done = await _get(store, operation.id)
    assert done.state is OperationState.SUCCEEDED
    assert done.finished_at == done_at
    assert done.current_step is S.DEMOTE_OLD_TRAIN
    assert not await store.complete_operation(
        operation.id, from_step=S.DEMOTE_OLD_TRAIN, at=done_at
    )
    assert not await store.advance_step(
        operation.id, from_step=S.DEMOTE_OLD_TRAIN, to_step=S.DEMOTE_OLD_SLEEP, at=done_at
    )
    assert await store.get_in_flight_operation(fleet.id) is None


# ---- fail ------------------------------------------------------------------------------------


async def test_fail_a_pending_operation(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    assert await store.fail_operation(operation.id, error=PROBE_FAILED, at=now)
    failed = await _get(store, operation.id)
    assert failed.state is OperationState.FAILED
    assert failed.error == PROBE_FAILED
    assert failed.finished_at == now
    assert not await store.fail_operation(operation.id, error=PROBE_FAILED, at=now)
    assert not await store.fail_operation(uuid4(), error=PROBE_FAILED, at=now)


async def test_fail_guarded_on_the_expected_step(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.PROBE)
    assert not await store.fail_operation(
        operation.id, error=PROBE_FAILED, at=now, expected_step=S.WAKE_VLLM
    )
    assert (await _get(store, operation.id)).state is OperationState.RUNNING
    assert await store.fail_operation(
        operation.id, error=PROBE_FAILED, at=now, expected_step=S.PROBE
    )


async def test_fail_guarded_on_routing_not_committed(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.SWITCH_ACTIVE)
    assert await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=fleet.domains[0].id,
        target_domain_id=fleet.domains[1].id,
        operation_id=operation.id,
        at=now,
    )
    timeout = OperationError(step=S.SWITCH_ACTIVE, code="step_timeout", message="over budget")
    assert not await store.fail_operation(
        operation.id, error=timeout, at=now, expected_step=S.SWITCH_ACTIVE, target_not_routed=True
    )
    assert (await _get(store, operation.id)).state is OperationState.RUNNING
    # Without the guard a committed operation may still fail (a caller's explicit choice).
    assert await store.fail_operation(operation.id, error=timeout, at=now)


async def test_failed_promote_cleans_up_its_target_in_the_same_statement(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.PROBE)
    await _set_slots(
        raw_engine,
        fleet,
        {
            (0, "inference"): "probing",
            (1, "inference"): "waking",
            (0, "training"): "stopping",
            (1, "training"): "training",
        },
    )
    before = await _slot_states(store, fleet)
    fail_at = now + timedelta(seconds=42)
    assert await store.fail_operation(
        operation.id, error=PROBE_FAILED, at=fail_at, expected_step=S.PROBE, target_not_routed=True
    )
    after = await _slot_states(store, fleet)
    assert after == {
        **before,
        ("beta", 0, "inference"): "failed",
        ("beta", 1, "inference"): "failed",
        ("beta", 0, "training"): "training",
    }
    changed = {
        s.id for s in fleet.domains[1].slots if (s.gpu_index, s.kind) != (1, SlotKind.TRAINING)
    }
    async with raw_engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.select(slots.c.id, slots.c.state_updated_at).where(
                    slots.c.domain_id == fleet.domains[1].id
                )
            )
        ).all()
    stamped = {row.id for row in rows if row.state_updated_at == fail_at}
    assert stamped == changed


async def test_failed_promote_keeps_serving_slots_when_the_pointer_is_at_the_target(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.SWITCH_ACTIVE)
    await _set_slots(raw_engine, fleet, {(0, "inference"): "serving", (1, "inference"): "serving"})
    assert await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=fleet.domains[0].id,
        target_domain_id=fleet.domains[1].id,
        operation_id=operation.id,
        at=now,
    )
    await _set_slots(raw_engine, fleet, {(1, "inference"): "probing"})
    assert await store.fail_operation(operation.id, error=PROBE_FAILED, at=now)
    after = await _slot_states(store, fleet)
    assert after[("beta", 0, "inference")] == "serving"
    assert after[("beta", 1, "inference")] == "failed"


async def test_failed_promote_fails_serving_slots_when_the_pointer_is_elsewhere(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.PROBE)
    await _set_slots(raw_engine, fleet, {(0, "inference"): "serving", (1, "inference"): "sleeping"})
    assert await store.fail_operation(operation.id, error=PROBE_FAILED, at=now)
    after = await _slot_states(store, fleet)
    assert after[("beta", 0, "inference")] == "failed"
    assert after[("beta", 1, "inference")] == "sleeping", "not on the wake path"
    # The source (alpha, the active) is never touched.
    assert {v for k, v in after.items() if k[0] == "alpha" and k[2] == "inference"} == {"serving"}


async def test_a_lost_fail_cleans_nothing(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.WAKE_VLLM)
    await _set_slots(raw_engine, fleet, {(0, "inference"): "waking", (0, "training"): "stopping"})
    before = await _slot_states(store, fleet)
    assert not await store.fail_operation(
        operation.id, error=PROBE_FAILED, at=now, expected_step=S.PROBE
    )
    assert await _slot_states(store, fleet) == before


async def test_a_failed_demote_cleans_nothing(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    assert await store.claim_operation(operation.id, first_step=S.SLEEP_VLLM, at=now)
    await _set_slots(raw_engine, fleet, {(0, "inference"): "waking", (0, "training"): "stopping"})
    before = await _slot_states(store, fleet)
    error = OperationError(step=S.SLEEP_VLLM, code="step_timeout", message="over budget")
    assert await store.fail_operation(operation.id, error=error, at=now)
    assert await _slot_states(store, fleet) == before


# ---- switch_active ---------------------------------------------------------------------------


def _switch_args(fleet: FleetSnapshot, operation: Operation, now: datetime) -> dict[str, Any]:
    return {
        "fleet_id": fleet.id,
        "expected_active_domain_id": fleet.domains[0].id,
        "target_domain_id": fleet.domains[1].id,
        "operation_id": operation.id,
        "at": now,
    }


async def test_switch_active_moves_the_pointer_and_commits_routing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    operation = await _running(store, fleet, now, S.SWITCH_ACTIVE)
    switch_at = now + timedelta(seconds=9)
    assert await store.switch_active(**_switch_args(fleet, operation, switch_at))
    pointer = await store.get_fleet_route_pointer(fleet.slug)
    assert pointer is not None
    assert pointer.active_domain_id == fleet.domains[1].id
    assert pointer.route_revision == fleet.route_revision + 1
    switched = await _get(store, operation.id)
    assert switched.routing_committed is True
    assert switched.state is OperationState.RUNNING
    # The pointer no longer equals the expected value: the losing case.
    assert not await store.switch_active(**_switch_args(fleet, operation, switch_at))
    again = await store.get_fleet_route_pointer(fleet.slug)
    assert again == pointer


async def test_switch_active_requires_a_running_operation_of_the_fleet(
    store: StateStore, fleet: FleetSnapshot, make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    pending = await _promote(store, fleet, now)
    assert not await store.switch_active(**_switch_args(fleet, pending, now))
    assert await store.fail_operation(pending.id, error=PROBE_FAILED, at=now)
    assert not await store.switch_active(**_switch_args(fleet, pending, now))

    await store.apply_fleet_layout(make_layout("other"), at=now)
    other = await store.get_fleet_snapshot("other")
    assert other is not None
    foreign = await _running(store, other, now, S.SWITCH_ACTIVE)
    assert not await store.switch_active(**_switch_args(fleet, foreign, now))

    pointer = await store.get_fleet_route_pointer(fleet.slug)
    assert pointer is not None
    assert (pointer.active_domain_id, pointer.route_revision) == (
        fleet.active_domain_id,
        fleet.route_revision,
    )
    assert (await _get(store, pending.id)).routing_committed is False
    assert (await _get(store, foreign.id)).routing_committed is False


async def test_switch_active_compares_an_unset_pointer_null_safely(
    store: StateStore, make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    await store.apply_fleet_layout(make_layout("headless", active=None), at=now)
    fleet = await store.get_fleet_snapshot("headless")
    assert fleet is not None
    operation = await _running(store, fleet, now, S.SWITCH_ACTIVE)
    args = {**_switch_args(fleet, operation, now), "expected_active_domain_id": fleet.domains[0].id}
    assert not await store.switch_active(**args)
    args["expected_active_domain_id"] = None
    assert await store.switch_active(**args)
    pointer = await store.get_fleet_route_pointer("headless")
    assert pointer is not None
    assert (pointer.active_domain_id, pointer.route_revision) == (fleet.domains[1].id, 2)
    assert not await store.switch_active(**args)


async def test_switch_active_to_a_foreign_domain_is_refused(
    store: StateStore, fleet: FleetSnapshot, make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    await store.apply_fleet_layout(make_layout("other"), at=now)
    other = await store.get_fleet_snapshot("other")
    assert other is not None
    operation = await _running(store, fleet, now, S.SWITCH_ACTIVE)
    with pytest.raises(ConstraintViolationError):
        await store.switch_active(
            **{**_switch_args(fleet, operation, now), "target_domain_id": other.domains[1].id}
        )
    assert (await _get(store, operation.id)).routing_committed is False


async def test_operation_reads(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation = await _promote(store, fleet, now)
    assert await store.get_operation(operation.id, fleet_id=uuid4()) is None
    assert await store.get_operation(uuid4()) is None
    assert await store.get_in_flight_operation(uuid4()) is None
    async with raw_engine.connect() as conn:
        count = (
            await conn.execute(sa.select(sa.func.count()).select_from(operations))
        ).scalar_one()
    assert count == 1
