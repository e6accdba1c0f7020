"""escalate_domain_if_fleet_idle: every guard is part of the one statement (DESIGN 5.3)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from uuid import uuid4

import pytest
import sqlalchemy as sa
from haru_db import StateStore
from haru_db._tables import domains, slots
from haru_protocol import (
    DomainState,
    FleetSnapshot,
    OperationError,
    OperationKind,
    OperationStep,
    SlotKind,
)
from sqlalchemy.ext.asyncio import AsyncEngine

STALE_MS = 30_000

Spoiler = Callable[[StateStore, FleetSnapshot, AsyncEngine, datetime], Awaitable[None]]


async def _prepare(store: StateStore, fleet: FleetSnapshot, now: datetime) -> None:
    alpha, beta = fleet.domains
    assert await store.transition_domain(
        alpha.id, from_states=[DomainState.READY], to=DomainState.DEGRADED, at=now
    )
    assert await store.mark_domain_seen(beta.id, at=now - timedelta(milliseconds=STALE_MS))


async def _escalate(store: StateStore, fleet: FleetSnapshot, now: datetime) -> bool:
    return await store.escalate_domain_if_fleet_idle(
        domain_id=fleet.domains[0].id, fleet_id=fleet.id, at=now, heartbeat_stale_ms=STALE_MS
    )


async def test_a_degraded_active_with_a_viable_standby_escalates(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    await _prepare(store, fleet, now)
    later = now + timedelta(milliseconds=1)
    assert not await store.escalate_domain_if_fleet_idle(
        domain_id=fleet.domains[0].id, fleet_id=fleet.id, at=later, heartbeat_stale_ms=STALE_MS
    ), "the standby's heartbeat is one millisecond too old"
    assert await _escalate(store, fleet, now), "a heartbeat exactly at the limit is fresh"
    snapshot = await store.get_fleet_snapshot(fleet.slug)
    assert snapshot is not None
    assert snapshot.domains[0].state is DomainState.FAILED
    assert snapshot.domains[0].state_updated_at == now
    assert not await _escalate(store, fleet, now), "already failed"


async def _not_degraded(s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime) -> None:
    assert await s.transition_domain(
        f.domains[0].id, from_states=[DomainState.DEGRADED], to=DomainState.READY, at=now
    )


async def _pointer_elsewhere(
    s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime
) -> None:
    operation, _ = await s.create_operation(
        fleet_id=f.id, kind=OperationKind.PROMOTE, target_domain_id=f.domains[1].id, at=now
    )
    assert await s.claim_operation(operation.id, first_step=OperationStep.SWITCH_ACTIVE, at=now)
    assert await s.switch_active(
        fleet_id=f.id,
        expected_active_domain_id=f.domains[0].id,
        target_domain_id=f.domains[1].id,
        operation_id=operation.id,
        at=now,
    )
    assert await s.complete_operation(operation.id, from_step=OperationStep.SWITCH_ACTIVE, at=now)


async def _operation_in_flight(
    s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime
) -> None:
    await s.create_operation(
        fleet_id=f.id, kind=OperationKind.DEMOTE, target_domain_id=f.domains[1].id, at=now
    )


async def _standby_stale(s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime) -> None:
    async with e.begin() as conn:
        stale = now - timedelta(milliseconds=STALE_MS + 1)
        await conn.execute(
            sa.update(domains).where(domains.c.id == f.domains[1].id).values(last_seen_at=stale)
        )


async def _standby_never_seen(
    s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime
) -> None:
    async with e.begin() as conn:
        await conn.execute(
            sa.update(domains).where(domains.c.id == f.domains[1].id).values(last_seen_at=None)
        )


async def _standby_degraded(s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime) -> None:
    assert await s.transition_domain(
        f.domains[1].id, from_states=[DomainState.READY], to=DomainState.DEGRADED, at=now
    )


async def _standby_unsupervised(
    s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime
) -> None:
    async with e.begin() as conn:
        await conn.execute(
            sa.update(domains).where(domains.c.id == f.domains[1].id).values(supervisor_url=None)
        )


async def _standby_slot_failed(
    s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime
) -> None:
    slot = next(x for x in f.domains[1].slots if x.kind is SlotKind.INFERENCE and x.gpu_index == 1)
    assert await s.transition_slot(
        slot.id, kind=SlotKind.INFERENCE, from_states=["sleeping"], to="failed", at=now
    )


async def _standby_without_inference(
    s: StateStore, f: FleetSnapshot, e: AsyncEngine, now: datetime
) -> None:
    async with e.begin() as conn:
        await conn.execute(
            sa.delete(slots).where(
                slots.c.domain_id == f.domains[1].id, slots.c.kind == "inference"
            )
        )


@pytest.mark.parametrize(
    "spoiler",
    [
        _not_degraded,
        _pointer_elsewhere,
        _operation_in_flight,
        _standby_stale,
        _standby_never_seen,
        _standby_degraded,
        _standby_unsupervised,
        _standby_slot_failed,
        _standby_without_inference,
    ],
)
async def test_each_guard_blocks_the_escalation(
    store: StateStore,
    fleet: FleetSnapshot,
    raw_engine: AsyncEngine,
    now: datetime,
    spoiler: Spoiler,
) -> None:
    await _prepare(store, fleet, now)
    await spoiler(store, fleet, raw_engine, now)
    before = await store.get_fleet_snapshot(fleet.slug)
    assert not await _escalate(store, fleet, now)
    assert await store.get_fleet_snapshot(fleet.slug) == before


async def test_another_fleet_id_loses(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    await _prepare(store, fleet, now)
    assert not await store.escalate_domain_if_fleet_idle(
        domain_id=fleet.domains[0].id, fleet_id=uuid4(), at=now, heartbeat_stale_ms=STALE_MS
    )


async def test_a_finished_operation_does_not_block(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    await _prepare(store, fleet, now)
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    assert await store.fail_operation(
        operation.id, error=OperationError(step=None, code="target_missing", message="x"), at=now
    )
    assert await _escalate(store, fleet, now)
