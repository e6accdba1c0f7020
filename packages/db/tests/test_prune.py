"""Retention: prune_history deletes old finished operations and old events, never what a
decision reads (in-flight operations, a fleet's newest operations, a relaunch streak)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from haru_db import KEEP_RECENT_OPERATIONS, OperationEvent, PruneCounts, StateStore
from haru_db._tables import UtcDateTime, events, operations
from haru_protocol import (
    DomainRelaunch,
    DomainState,
    DomainStateChanged,
    FleetSnapshot,
    Operation,
    OperationError,
    OperationErrorCode,
    OperationKind,
    OperationStep,
)
from sqlalchemy.ext.asyncio import AsyncEngine

DAY = timedelta(days=1)
HOUR = timedelta(hours=1)
EVENTS_PER_PROMOTION = 11
"""What one promotion appends (requested, started, a step.done per step, succeeded...)."""


async def _finished_promotion(
    store: StateStore, fleet: FleetSnapshot, at: datetime, *, target: int = 1
) -> Operation:
    """A promote that starts at ``at`` (two events through its claim) and fails a minute later."""
    operation, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=fleet.domains[target].id,
        at=at,
    )
    assert created
    assert await store.claim_operation(
        operation.id,
        first_step=OperationStep.STOP_TRAINING,
        at=at,
        events=[OperationEvent("test.claimed"), OperationEvent("test.step", {"n": 1})],
    )
    error = OperationError(
        step=OperationStep.STOP_TRAINING,
        code=OperationErrorCode.STEP_TIMEOUT.value,
        message="test",
    )
    assert await store.fail_operation(operation.id, error=error, at=at + timedelta(minutes=1))
    return operation


async def _event_ids(store: StateStore, fleet_id: UUID) -> list[int]:
    return [e.id for e in await store.list_events(fleet_id, limit=1000)]


async def _count(engine: AsyncEngine, table: sa.Table) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.select(sa.func.count()).select_from(table))).scalar_one())


async def test_prune_keeps_in_flight_and_the_newest_per_fleet(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    base = now - 400 * DAY
    finished = [await _finished_promotion(store, fleet, base + i * HOUR) for i in range(70)]
    # An in-flight operation older than every finished one: never pruned, nor its events.
    stuck, _ = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.DEMOTE,
        target_domain_id=fleet.domains[1].id,
        at=base - 100 * DAY,
    )
    assert await store.claim_operation(
        stuck.id,
        first_step=OperationStep.SLEEP_VLLM,
        at=base - 100 * DAY,
        events=[OperationEvent("test.stuck")],
    )
    old_note = await store.append_event(
        fleet_id=fleet.id, type="test.note", payload={}, at=base - 200 * DAY
    )
    new_note = await store.append_event(fleet_id=fleet.id, type="test.note", payload={}, at=now)
    recent_before = await store.list_recent_operations(fleet.id)
    before_ids = await _event_ids(store, fleet.id)

    cutoff = now - 30 * DAY
    pruned_ops = finished[: 70 - KEEP_RECENT_OPERATIONS]
    expected = PruneCounts(events=2 * len(pruned_ops) + 1, operations=len(pruned_ops))
    assert await store.count_prunable(before=cutoff) == expected
    # A small batch: several statements per table.
    assert await store.prune_history(before=cutoff, batch=4) == expected
    assert await store.count_prunable(before=cutoff) == PruneCounts(0, 0)
    assert await store.prune_history(before=cutoff) == PruneCounts(0, 0)

    # What promotion backoff reads is unchanged; the pruned operations are gone.
    assert await store.list_recent_operations(fleet.id) == recent_before
    for operation in pruned_ops:
        assert await store.get_operation(operation.id) is None
    kept = await store.get_operation(stuck.id)
    assert kept is not None
    assert kept.state.value == "running"
    after = await store.list_events(fleet.id, limit=1000)
    assert old_note not in {e.id for e in after}
    assert new_note in {e.id for e in after}
    assert [e.id for e in after if e.operation_id == stuck.id]
    gone = {e for e in before_ids if e not in {a.id for a in after}}
    assert len(gone) == expected.events


async def test_prune_keeps_a_failed_domains_relaunch_streak(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha, beta = fleet.domains[0], fleet.domains[1]
    old = now - 90 * DAY
    for domain in (alpha, beta):
        await store.append_event(
            fleet_id=fleet.id,
            domain_id=domain.id,
            payload=DomainStateChanged(from_state=DomainState.READY, to_state=DomainState.FAILED),
            at=old,
        )
        await store.append_event(
            fleet_id=fleet.id,
            domain_id=domain.id,
            payload=DomainRelaunch(cluster="c", relaunch=1, max_attempts=1, backoff_ms=0),
            at=old,
        )
        # Not a streak event: it goes whatever the domain's state.
        await store.append_event(
            fleet_id=fleet.id, domain_id=domain.id, type="test.note", payload={}, at=old
        )
    assert await store.transition_domain(
        beta.id, from_states=[DomainState.READY], to=DomainState.FAILED, at=old
    )
    cutoff = now - 30 * DAY
    # alpha is ready: its three go; beta failed: only its note goes (the streak stays).
    assert await store.prune_history(before=cutoff) == PruneCounts(events=4, operations=0)
    left = await store.list_events(fleet.id, limit=1000)
    assert {(e.domain_id, e.type) for e in left} == {
        (None, "fleet.layout.applied"),
        (beta.id, "domain.state.changed"),
        (beta.id, "domain.relaunch"),
    }
    # Once beta is ready again, its old streak no longer counts: it goes.
    assert await store.transition_domain(
        beta.id, from_states=[DomainState.FAILED], to=DomainState.DEGRADED, at=now
    )
    assert await store.transition_domain(
        beta.id, from_states=[DomainState.DEGRADED], to=DomainState.READY, at=now
    )
    assert await store.prune_history(before=cutoff) == PruneCounts(events=2, operations=0)


async def test_prune_bounds_batches_and_checks_its_arguments(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    for i in range(5):
        await store.append_event(
            fleet_id=fleet.id, type="test.note", payload={}, at=now - 40 * DAY + i * HOUR
        )
    cutoff = now - 30 * DAY
    assert await store.prune_history(before=cutoff, batch=2, max_batches=2) == PruneCounts(4, 0)
    assert await store.prune_history(before=cutoff, batch=2, max_batches=2) == PruneCounts(1, 0)
    with pytest.raises(ValueError, match="timezone-aware"):
        await store.prune_history(before=cutoff.replace(tzinfo=None))
    with pytest.raises(ValueError, match="keep_recent"):
        await store.count_prunable(before=cutoff, keep_recent=-1)
    with pytest.raises(ValueError, match="batch"):
        await store.prune_history(before=cutoff, batch=0)


# ---- a year of promotions -----------------------------------------------------------------

_SERIES = {
    # :count succeeded promotions, one every :step hours from :start, alternating targets, made
    # in the database (a year of rows through Python would take most of the test's time).
    "sqlite": """
        WITH RECURSIVE h(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM h WHERE n + 1 < :count),
        t(n, at, done) AS (
            SELECT n,
                strftime(:fmt, :start, '+' || (n * :step * 60) || ' minutes'),
                strftime(:fmt, :start, '+' || (n * :step * 60 + 2) || ' minutes')
            FROM h
        )
        INSERT INTO operations (id, fleet_id, kind, state, target_domain_id, source_domain_id,
            routing_committed, created_at, updated_at, finished_at)
        SELECT lower(hex(randomblob(16))), :fleet, 'promote', 'succeeded',
            CASE n % 2 WHEN 0 THEN :a ELSE :b END, CASE n % 2 WHEN 0 THEN :b ELSE :a END, 1,
            at, done, done
        FROM t
    """,
    "postgresql": """
        INSERT INTO operations (id, fleet_id, kind, state, target_domain_id, source_domain_id,
            routing_committed, created_at, updated_at, finished_at)
        SELECT gen_random_uuid(), :fleet, 'promote', 'succeeded',
            CASE n % 2 WHEN 0 THEN :a ELSE :b END, CASE n % 2 WHEN 0 THEN :b ELSE :a END, true,
            :start + n * :step * interval '1 hour',
            :start + n * :step * interval '1 hour' + interval '2 minutes',
            :start + n * :step * interval '1 hour' + interval '2 minutes'
        FROM generate_series(0, :count - 1) AS n
    """,
}
_STEPS = {
    # EVENTS_PER_PROMOTION events for each operation made since :start.
    "sqlite": """
        WITH RECURSIVE k(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM k WHERE n + 1 < :per)
        INSERT INTO events (fleet_id, domain_id, operation_id, type, payload, created_at)
        SELECT o.fleet_id, o.target_domain_id, o.id, 'test.promotion.step', '{}', o.created_at
        FROM operations AS o, k WHERE o.fleet_id = :fleet AND o.created_at >= :start
        ORDER BY o.created_at, k.n
    """,
    "postgresql": """
        INSERT INTO events (fleet_id, domain_id, operation_id, type, payload, created_at)
        SELECT o.fleet_id, o.target_domain_id, o.id, 'test.promotion.step', '{}', o.created_at
        FROM operations AS o, generate_series(1, :per) AS k
        WHERE o.fleet_id = :fleet AND o.created_at >= :start
        ORDER BY o.created_at, k
    """,
}


async def _insert_promotions(
    engine: AsyncEngine, fleet: FleetSnapshot, start: datetime, count: int, *, step: int
) -> None:
    params: list[sa.BindParameter[Any]] = [
        sa.bindparam("fleet", fleet.id, type_=sa.Uuid()),
        sa.bindparam("a", fleet.domains[0].id, type_=sa.Uuid()),
        sa.bindparam("b", fleet.domains[1].id, type_=sa.Uuid()),
        sa.bindparam("start", start, type_=UtcDateTime()),
    ]
    dialect = engine.dialect.name
    async with engine.begin() as conn:
        series = sa.text(_SERIES[dialect]).bindparams(*params, count=count, step=step)
        if dialect == "sqlite":
            # SQLAlchemy's storage format of a SQLite DATETIME (microseconds always written).
            series = series.bindparams(fmt="%Y-%m-%d %H:%M:%S.000000")
        await conn.execute(series)
        steps = sa.text(_STEPS[dialect]).bindparams(params[0], params[3], per=EVENTS_PER_PROMOTION)
        await conn.execute(steps)


@pytest.mark.parametrize("every_days", [7, 365], ids=["pruned-weekly", "pruned-once"])
async def test_a_year_of_promotions_stays_bounded(
    store: StateStore,
    fleet: FleetSnapshot,
    raw_engine: AsyncEngine,
    now: datetime,
    every_days: int,
) -> None:
    # A promotion every 3 hours for a year (2,920), 11 events each; the periodic prune
    # simulated at the end of every chunk of `every_days` (the clock is the prune's `before`).
    step_h = 3
    per_day = 24 // step_h
    retention = 7 * DAY
    # What may stay: a retention window of promotions plus the newest kept per fleet.
    bound_ops = retention.days * per_day + KEEP_RECENT_OPERATIONS
    bound_events = EVENTS_PER_PROMOTION * bound_ops
    start = (now - 365 * DAY).replace(microsecond=0)
    total = 365 * per_day
    events_before = await _count(raw_engine, events)
    seen: list[tuple[int, int]] = []
    deleted = PruneCounts(0, 0)
    for day in range(0, 365, every_days):
        days = min(every_days, 365 - day)
        await _insert_promotions(raw_engine, fleet, start + day * DAY, days * per_day, step=step_h)
        clock = start + (day + days) * DAY
        deleted += await store.prune_history(before=clock - retention)
        seen.append((await _count(raw_engine, operations), await _count(raw_engine, events)))
    assert deleted.operations + seen[-1][0] == total
    assert deleted.events + seen[-1][1] == total * EVENTS_PER_PROMOTION + events_before
    # Bounded by retention x rate + the kept newest (plus, between prunes, one chunk), never
    # by the year.
    assert max(n_ops for n_ops, _ in seen) <= bound_ops + every_days * per_day
    assert seen[-1][0] <= bound_ops
    assert seen[-1][1] <= bound_events + events_before
    assert seen[-1][0] < total / 10
    recent = await store.list_recent_operations(fleet.id)
    assert len(recent) == KEEP_RECENT_OPERATIONS
