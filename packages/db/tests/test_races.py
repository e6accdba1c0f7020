"""True races: eight stores, each with its own engine and connections, on one database.

On PostgreSQL (READ COMMITTED) the statements really interleave; on SQLite the writers
queue on the database lock (BEGIN IMMEDIATE + busy timeout). Either way every CAS has exactly
one winner, every round.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

import pytest
import pytest_asyncio
import sqlalchemy as sa
from haru_db import StateStore
from haru_db._engine import create_engine
from haru_db._tables import domains, operations, slots
from haru_db.testing import DatabaseUrlFactory, Lane
from haru_protocol import (
    DomainState,
    FleetLayout,
    FleetSnapshot,
    Operation,
    OperationError,
    OperationKind,
    OperationState,
    OperationStep,
    SlotKind,
)
from sqlalchemy.ext.asyncio import AsyncEngine

RACERS = 8
STALE_MS = 30_000
S = OperationStep
GIVE_UP = OperationError(step=None, code="step_timeout", message="race cleanup")
T = TypeVar("T")


@pytest.fixture
def rounds(haru_db_lane: Lane) -> int:
    # SQLite serialises writers, so fewer rounds prove as much there.
    return 20 if haru_db_lane == "postgres" else 6


@pytest_asyncio.fixture
async def racers(database_url_factory: DatabaseUrlFactory) -> AsyncIterator[list[StateStore]]:
    url = await database_url_factory()
    stores = [StateStore.open(url) for _ in range(RACERS)]
    try:
        # Connect every engine before the first race so the statements, not the connects, race.
        await asyncio.gather(*(s.ping() for s in stores))
        yield stores
    finally:
        await asyncio.gather(*(s.close() for s in stores))


@pytest_asyncio.fixture
async def engine(racers: list[StateStore]) -> AsyncIterator[AsyncEngine]:
    raw = create_engine(racers[0].url)
    try:
        yield raw
    finally:
        await raw.dispose()


async def _race(calls: list[Awaitable[T]]) -> list[T]:
    return list(await asyncio.gather(*calls))


async def _fleet(store: StateStore, layout: FleetLayout, at: datetime) -> FleetSnapshot:
    await store.apply_fleet_layout(layout, at=at)
    snapshot = await store.get_fleet_snapshot(layout.slug)
    assert snapshot is not None
    return snapshot


async def _create(store: StateStore, fleet: FleetSnapshot, target: UUID, at: datetime) -> Operation:
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=target, at=at
    )
    assert created
    return operation


async def test_claim_vs_claim(
    racers: list[StateStore], make_layout: Callable[..., FleetLayout], now: datetime, rounds: int
) -> None:
    fleet = await _fleet(racers[0], make_layout(), now)
    for n in range(rounds):
        at = now + timedelta(seconds=n)
        operation = await _create(racers[0], fleet, fleet.domains[1].id, at)
        won = await _race(
            [s.claim_operation(operation.id, first_step=S.STOP_TRAINING, at=at) for s in racers]
        )
        # A landed claim returns its fence (an int), a lost one None.
        assert len([w for w in won if w is not None]) == 1, f"round {n}: {won}"
        claimed = await racers[0].get_operation(operation.id)
        assert claimed is not None
        assert (claimed.state, claimed.current_step) == (OperationState.RUNNING, S.STOP_TRAINING)
        assert await racers[0].fail_operation(operation.id, error=GIVE_UP, at=at)


async def test_advance_vs_advance(
    racers: list[StateStore], make_layout: Callable[..., FleetLayout], now: datetime, rounds: int
) -> None:
    fleet = await _fleet(racers[0], make_layout(), now)
    for n in range(rounds):
        at = now + timedelta(seconds=n)
        operation = await _create(racers[0], fleet, fleet.domains[1].id, at)
        assert await racers[0].claim_operation(operation.id, first_step=S.STOP_TRAINING, at=at)
        # Half the racers take the step to verify_gpu, half skip to wake_vllm: one move wins.
        won = await _race(
            [
                s.advance_step(
                    operation.id,
                    from_step=S.STOP_TRAINING,
                    to_step=S.VERIFY_GPU if i % 2 else S.WAKE_VLLM,
                    at=at,
                )
                for i, s in enumerate(racers)
            ]
        )
        landed = [w is not None for w in won]
        assert landed.count(True) == 1, f"round {n}: {won}"
        winner = landed.index(True)
        advanced = await racers[0].get_operation(operation.id)
        assert advanced is not None
        assert advanced.current_step is (S.VERIFY_GPU if winner % 2 else S.WAKE_VLLM)
        assert await racers[0].fail_operation(operation.id, error=GIVE_UP, at=at)


async def test_create_vs_create(
    racers: list[StateStore], make_layout: Callable[..., FleetLayout], now: datetime, rounds: int
) -> None:
    fleet = await _fleet(racers[0], make_layout(), now)
    for n in range(rounds):
        at = now + timedelta(seconds=n)
        results = await _race(
            [
                s.create_operation(
                    fleet_id=fleet.id,
                    kind=OperationKind.PROMOTE if i % 2 else OperationKind.DEMOTE,
                    target_domain_id=fleet.domains[1].id,
                    at=at,
                )
                for i, s in enumerate(racers)
            ]
        )
        assert [created for _, created in results].count(True) == 1, f"round {n}"
        assert len({operation.id for operation, _ in results}) == 1, "the others joined it"
        in_flight = await racers[0].get_in_flight_operation(fleet.id)
        assert in_flight is not None
        assert in_flight.id == results[0][0].id
        assert await racers[0].fail_operation(in_flight.id, error=GIVE_UP, at=at)


async def _reset_postures(engine: AsyncEngine, fleet_id: UUID) -> None:
    # Every inference slot on the wake path, so a fail's cleanup is visible.
    async with engine.begin() as conn:
        rows = (
            await conn.execute(sa.select(domains.c.id).where(domains.c.fleet_id == fleet_id))
        ).all()
        for (domain_id,) in rows:
            await conn.execute(
                sa.update(slots)
                .where(slots.c.domain_id == domain_id, slots.c.kind == SlotKind.INFERENCE.value)
                .values(state="probing")
            )


async def test_switch_active_vs_fail_target_not_routed(
    racers: list[StateStore],
    engine: AsyncEngine,
    make_layout: Callable[..., FleetLayout],
    now: datetime,
    rounds: int,
) -> None:
    fleet = await _fleet(racers[0], make_layout(), now)
    outcomes = {"switched": 0, "failed": 0}
    for n in range(rounds):
        at = now + timedelta(seconds=n)
        pointer = await racers[0].get_fleet_route_pointer(fleet.slug)
        assert pointer is not None
        source = pointer.active_domain_id
        target = next(d.id for d in fleet.domains if d.id != source)
        operation = await _create(racers[0], fleet, target, at)
        assert await racers[0].claim_operation(operation.id, first_step=S.SWITCH_ACTIVE, at=at)
        await _reset_postures(engine, fleet.id)
        error = OperationError(step=S.SWITCH_ACTIVE, code="step_timeout", message="over budget")
        calls: list[Awaitable[bool]] = []
        for i, store in enumerate(racers):
            if i % 2:
                calls.append(
                    store.switch_active(
                        fleet_id=fleet.id,
                        expected_active_domain_id=source,
                        target_domain_id=target,
                        operation_id=operation.id,
                        at=at,
                    )
                )
            else:
                calls.append(
                    store.fail_operation(
                        operation.id,
                        error=error,
                        at=at,
                        expected_step=S.SWITCH_ACTIVE,
                        target_not_routed=True,
                    )
                )
        won = await _race(calls)
        assert won.count(True) == 1, f"round {n}: {won}"
        switched = won.index(True) % 2 == 1
        after = await racers[0].get_operation(operation.id)
        moved = await racers[0].get_fleet_route_pointer(fleet.slug)
        snapshot = await racers[0].get_fleet_snapshot(fleet.slug)
        assert after is not None
        assert moved is not None
        assert snapshot is not None
        target_slots = {
            s.state.value
            for s in next(d for d in snapshot.domains if d.id == target).slots
            if s.kind is SlotKind.INFERENCE
        }
        if switched:
            outcomes["switched"] += 1
            assert (after.state, after.routing_committed) == (OperationState.RUNNING, True)
            assert (moved.active_domain_id, moved.route_revision) == (
                target,
                pointer.route_revision + 1,
            )
            assert target_slots == {"probing"}
            assert await racers[0].complete_operation(
                operation.id, from_step=S.SWITCH_ACTIVE, at=at
            )
        else:
            outcomes["failed"] += 1
            assert (after.state, after.routing_committed) == (OperationState.FAILED, False)
            assert moved == pointer
            assert target_slots == {"failed"}, "the cleanup landed with the fail"
    async with engine.connect() as conn:
        both = (
            await conn.execute(
                sa.select(sa.func.count())
                .select_from(operations)
                .where(
                    operations.c.state == "failed", operations.c.routing_committed.is_(sa.true())
                )
            )
        ).scalar_one()
    assert both == 0, "never routing committed AND operation failed"
    assert sum(outcomes.values()) == rounds


async def test_escalate_vs_create_operation(
    racers: list[StateStore],
    engine: AsyncEngine,
    make_layout: Callable[..., FleetLayout],
    now: datetime,
    rounds: int,
) -> None:
    fleet = await _fleet(racers[0], make_layout(), now)
    alpha, beta = fleet.domains
    assert await racers[0].mark_domain_seen(beta.id, at=now)
    for n in range(rounds):
        at = now + timedelta(milliseconds=n)
        async with engine.begin() as conn:
            await conn.execute(
                sa.update(domains).where(domains.c.id == alpha.id).values(state="degraded")
            )
        calls: list[Awaitable[Any]] = []
        for i, store in enumerate(racers):
            if i % 2:
                calls.append(
                    store.escalate_domain_if_fleet_idle(
                        domain_id=alpha.id, fleet_id=fleet.id, at=at, heartbeat_stale_ms=STALE_MS
                    )
                )
            else:
                calls.append(
                    store.create_operation(
                        fleet_id=fleet.id,
                        kind=OperationKind.PROMOTE,
                        target_domain_id=beta.id,
                        at=at,
                    )
                )
        results = await _race(calls)
        escalations = [r for i, r in enumerate(results) if i % 2]
        creations = [r for i, r in enumerate(results) if not i % 2]
        assert escalations.count(True) <= 1, f"round {n}: {escalations}"
        assert [created for _, created in creations].count(True) == 1, f"round {n}"
        snapshot = await racers[0].get_fleet_snapshot(fleet.slug)
        assert snapshot is not None
        expected = DomainState.FAILED if True in escalations else DomainState.DEGRADED
        assert snapshot.domains[0].state is expected
        in_flight = await racers[0].get_in_flight_operation(fleet.id)
        assert in_flight is not None
        # With the operation visible, escalation is refused from now on.
        if True not in escalations:
            assert not await racers[0].escalate_domain_if_fleet_idle(
                domain_id=alpha.id, fleet_id=fleet.id, at=at, heartbeat_stale_ms=STALE_MS
            )
        assert await racers[0].fail_operation(in_flight.id, error=GIVE_UP, at=at)


async def test_concurrent_layout_applies(
    racers: list[StateStore], make_layout: Callable[..., FleetLayout], now: datetime, rounds: int
) -> None:
    # Each round is about forty statements per racer: half the rounds prove as much.
    rounds = max(rounds // 2, 3)
    for n in range(rounds):
        layout = make_layout(f"fleet-{n}")
        results = await _race([s.apply_fleet_layout(layout, at=now) for s in racers])
        assert [r.fleet_created for r in results].count(True) == 1, f"round {n}"
        assert len({r.fleet_id for r in results}) == 1
        assert sum(r.domains_created for r in results) == 2
        assert sum(r.slots_created for r in results) == 8
        assert [r.pointer_set for r in results].count(True) == 1
        snapshot = await racers[0].get_fleet_snapshot(layout.slug)
        assert snapshot is not None
        assert len(snapshot.domains) == 2
        assert sum(len(d.slots) for d in snapshot.domains) == 8
        assert snapshot.route_revision == 2
        assert snapshot.active_domain_id == snapshot.domains[0].id
    assert len(await racers[0].list_fleets()) == rounds
