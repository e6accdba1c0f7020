"""The fencing token: every operation write raises its fleet's fence in its own statement."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from uuid import UUID

import pytest_asyncio
import sqlalchemy as sa
from haru_db import SlotMirror, StateStore
from haru_db._engine import create_engine
from haru_db._events import OperationEvent
from haru_db._tables import fleets
from haru_db.testing import DatabaseUrlFactory
from haru_protocol import (
    FleetLayout,
    FleetSnapshot,
    OperationError,
    OperationKind,
    OperationStarted,
    OperationStep,
    SlotKind,
    TrainingSlotState,
)
from sqlalchemy.ext.asyncio import AsyncEngine

S = OperationStep
GIVE_UP = OperationError(step=None, code="step_timeout", message="fence test")
RACERS = 6


async def _fence(engine: AsyncEngine, fleet_id: UUID) -> int:
    async with engine.connect() as conn:
        value = await conn.scalar(sa.select(fleets.c.fence).where(fleets.c.id == fleet_id))
    assert isinstance(value, int)
    return value


async def _create(store: StateStore, fleet: FleetSnapshot, at: datetime) -> UUID:
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=at
    )
    assert created
    return operation.id


async def test_every_operation_write_raises_the_fence_once(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    assert await _fence(raw_engine, fleet.id) == 0
    operation_id = await _create(store, fleet, now)
    assert await _fence(raw_engine, fleet.id) == 1
    # A create that joins the in-flight operation writes nothing.
    _, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    assert not created
    assert await _fence(raw_engine, fleet.id) == 1

    started = OperationEvent.of(
        OperationStarted(kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id)
    )
    stopping = SlotMirror(
        SlotKind.TRAINING, (TrainingSlotState.TRAINING,), TrainingSlotState.STOPPING
    )
    # The claim with an event and a mirror (the CTE / trigger shape) returns the new fence.
    assert (
        await store.claim_operation(
            operation_id,
            first_step=S.STOP_TRAINING,
            at=now,
            events=(started,),
            entry_mirror=stopping,
        )
        == 2
    )
    assert await store.get_operation_fence(operation_id, S.STOP_TRAINING) == 2
    # Lost CASes raise nothing.
    assert await store.claim_operation(operation_id, first_step=S.STOP_TRAINING, at=now) is None
    assert (
        await store.advance_step(operation_id, from_step=S.PROBE, to_step=S.SWITCH_ACTIVE, at=now)
        is None
    )
    assert await _fence(raw_engine, fleet.id) == 2
    # A bare advance (no event, no mirror) too.
    later = now + timedelta(seconds=1)
    assert (
        await store.advance_step(
            operation_id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=later
        )
        == 3
    )
    # The token belongs to the step: the old one has none any more.
    assert await store.get_operation_fence(operation_id, S.STOP_TRAINING) is None
    assert await store.get_operation_fence(operation_id, S.VERIFY_GPU) == 3
    assert await store.fail_operation(
        operation_id, error=GIVE_UP, at=later, expected_step=S.VERIFY_GPU, target_not_routed=True
    )
    assert await _fence(raw_engine, fleet.id) == 4
    assert await store.get_operation_fence(operation_id, S.VERIFY_GPU) is None
    assert not await store.fail_operation(operation_id, error=GIVE_UP, at=later)
    assert await _fence(raw_engine, fleet.id) == 4

    # The next operation continues from there, through to its completion.
    demote, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=fleet.domains[1].id, at=later
    )
    assert created
    assert await store.claim_operation(demote.id, first_step=S.SLEEP_VLLM, at=later) == 6
    assert (
        await store.advance_step(
            demote.id, from_step=S.SLEEP_VLLM, to_step=S.START_TRAINING, at=later
        )
        == 7
    )
    assert await store.complete_operation(demote.id, from_step=S.START_TRAINING, at=later)
    assert await _fence(raw_engine, fleet.id) == 8
    assert await store.get_operation_fence(demote.id, S.START_TRAINING) is None


async def test_fences_are_per_fleet(
    store: StateStore,
    fleet: FleetSnapshot,
    raw_engine: AsyncEngine,
    make_layout: Callable[..., FleetLayout],
    now: datetime,
) -> None:
    await store.apply_fleet_layout(make_layout(slug="other"), at=now)
    other = await store.get_fleet_snapshot("other")
    assert other is not None
    first = await _create(store, fleet, now)
    assert await store.claim_operation(first, first_step=S.STOP_TRAINING, at=now) == 2
    second = await _create(store, other, now)
    assert await store.claim_operation(second, first_step=S.STOP_TRAINING, at=now) == 2
    assert await _fence(raw_engine, fleet.id) == 2
    assert await _fence(raw_engine, other.id) == 2


@pytest_asyncio.fixture
async def racers(database_url_factory: DatabaseUrlFactory) -> AsyncIterator[list[StateStore]]:
    url = await database_url_factory()
    stores = [StateStore.open(url) for _ in range(RACERS)]
    try:
        await asyncio.gather(*(s.ping() for s in stores))
        yield stores
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_racing_writes_never_share_a_token(
    racers: list[StateStore], make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    """Advances and fails of one operation from separate engines: each landed write has its
    own token (on PostgreSQL they interleave under READ COMMITTED)."""
    store = racers[0]
    await store.apply_fleet_layout(make_layout(), at=now)
    fleet = await store.get_fleet_snapshot("fleet")
    assert fleet is not None
    engine = create_engine(store.url)
    try:
        for n in range(4):
            at = now + timedelta(seconds=n)
            operation_id = await _create(store, fleet, at)
            before = await _fence(engine, fleet.id)
            claimed = await store.claim_operation(operation_id, first_step=S.STOP_TRAINING, at=at)
            assert claimed == before + 1
            calls = []
            for i, racer in enumerate(racers):
                if i % 2:
                    calls.append(
                        racer.advance_step(
                            operation_id, from_step=S.STOP_TRAINING, to_step=S.VERIFY_GPU, at=at
                        )
                    )
                else:
                    calls.append(racer.fail_operation(operation_id, error=GIVE_UP, at=at))
            results = await asyncio.gather(*calls)
            advanced = [r for i, r in enumerate(results) if i % 2 and r is not None]
            failed = [r for i, r in enumerate(results) if not i % 2 and r]
            assert len(failed) == 1, results
            assert len(advanced) <= 1, results
            # One fail, perhaps one advance before it: each raised the fence once.
            after = await _fence(engine, fleet.id)
            assert after == claimed + 1 + len(advanced)
            if advanced:
                assert advanced[0] == claimed + 1
    finally:
        await engine.dispose()
