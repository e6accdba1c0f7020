"""State compare-and-swaps on domains and slots (one guarded UPDATE each).

A domain or slot transition, and the idle-fleet escalation, can carry events about the change:
they ride the same statement and land only with it (DESIGN 5.3).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from haru_core import assert_transition, machine_for
from haru_protocol import DomainState, EventPayload, InferenceSlotState, SlotKind

from haru_db._event_writes import about_row, write_domain, write_guarded
from haru_db._exec import Executor, aware, checked_froms
from haru_db._tables import IN_FLIGHT_STATES, domains, fleets, operations, slots


async def transition_domain(
    ex: Executor,
    domain_id: UUID,
    *,
    from_states: Collection[DomainState],
    to: DomainState,
    at: datetime,
    events: Sequence[EventPayload] = (),
    fleet_id: UUID | None = None,
    operation_id: UUID | None = None,
) -> bool:
    froms = checked_froms("domain", from_states, to)
    at = aware(at)
    about = about_row(events, at, fleet_id, domain_id, operation_id=operation_id)
    if not froms:
        return False
    stmt = (
        sa.update(domains)
        .where(domains.c.id == domain_id, domains.c.state.in_(froms))
        .values(state=str(to), state_updated_at=at, updated_at=at)
    )
    return await write_domain(ex, stmt, about)


async def transition_slot(
    ex: Executor,
    slot_id: UUID,
    *,
    kind: SlotKind,
    from_states: Collection[str],
    to: str,
    at: datetime,
    events: Sequence[EventPayload] = (),
    fleet_id: UUID | None = None,
    domain_id: UUID | None = None,
) -> bool:
    froms = checked_froms(machine_for(kind), from_states, to)
    at = aware(at)
    about = about_row(events, at, fleet_id, domain_id, slot_id)
    if not froms:
        return False
    stmt = (
        sa.update(slots)
        .where(slots.c.id == slot_id, slots.c.kind == str(kind), slots.c.state.in_(froms))
        .values(state=str(to), state_updated_at=at, updated_at=at)
    )
    if about is not None:
        # As for a domain: the ids the events are stored with must be the row's.
        stmt = stmt.where(
            slots.c.domain_id == about.domain_id,
            sa.exists(
                sa.select(domains.c.id).where(
                    domains.c.id == about.domain_id, domains.c.fleet_id == about.fleet_id
                )
            ),
        )
    return await write_guarded(ex, stmt, slots.c.id, about)


async def transition_domain_slots(
    ex: Executor,
    domain_id: UUID,
    *,
    kind: SlotKind,
    from_states: Collection[str],
    to: str,
    at: datetime,
) -> int:
    froms = checked_froms(machine_for(kind), from_states, to)
    at = aware(at)
    if not froms:
        return 0
    stmt = (
        sa.update(slots)
        .where(
            slots.c.domain_id == domain_id,
            slots.c.kind == str(kind),
            slots.c.state.in_(froms),
        )
        .values(state=str(to), state_updated_at=at, updated_at=at)
        .returning(slots.c.id)
    )
    return len(await ex.write(stmt))


async def mark_domain_seen(ex: Executor, domain_id: UUID, *, at: datetime) -> bool:
    return domain_id in await mark_domains_seen(ex, (domain_id,), at=at)


async def replace_domains_seen(
    ex: Executor, replaced: Mapping[UUID, datetime], *, at: datetime
) -> frozenset[UUID]:
    at = aware(at)
    if not replaced:
        return frozenset()
    stmt = (
        sa.update(domains)
        .where(
            sa.or_(
                *(
                    sa.and_(domains.c.id == domain_id, domains.c.last_seen_at == aware(seen))
                    for domain_id, seen in replaced.items()
                )
            ),
            domains.c.last_seen_at <= at,
        )
        .values(last_seen_at=at, updated_at=at)
        .returning(domains.c.id)
    )
    return frozenset(row["id"] for row in await ex.write(stmt))


async def mark_domains_seen(
    ex: Executor, domain_ids: Collection[UUID], *, at: datetime
) -> frozenset[UUID]:
    at = aware(at)
    if not domain_ids:
        return frozenset()
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id.in_(tuple(domain_ids)),
            sa.or_(domains.c.last_seen_at.is_(None), domains.c.last_seen_at <= at),
        )
        .values(last_seen_at=at, updated_at=at)
        .returning(domains.c.id)
    )
    return frozenset(row["id"] for row in await ex.write(stmt))


async def escalate_domain_if_fleet_idle(
    ex: Executor,
    *,
    domain_id: UUID,
    fleet_id: UUID,
    at: datetime,
    heartbeat_stale_ms: int,
    events: Sequence[EventPayload] = (),
) -> bool:
    assert_transition("domain", DomainState.DEGRADED.value, DomainState.FAILED.value)
    at = aware(at)
    if heartbeat_stale_ms < 0:
        raise ValueError("heartbeat_stale_ms must not be negative")
    about = about_row(events, at, fleet_id, domain_id)
    fresh_since = at - timedelta(milliseconds=heartbeat_stale_ms)
    standby = domains.alias("standby")
    inference_slot = sa.and_(
        slots.c.domain_id == standby.c.id, slots.c.kind == SlotKind.INFERENCE.value
    )
    viable_standby = sa.exists(
        sa.select(standby.c.id).where(
            standby.c.fleet_id == fleet_id,
            standby.c.id != domain_id,
            standby.c.removed_at.is_(None),
            standby.c.state == DomainState.READY.value,
            standby.c.supervisor_url.is_not(None),
            standby.c.last_seen_at >= fresh_since,
            sa.exists(sa.select(slots.c.id).where(inference_slot)),
            ~sa.exists(
                sa.select(slots.c.id).where(
                    inference_slot, slots.c.state == InferenceSlotState.FAILED.value
                )
            ),
        )
    )
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id == domain_id,
            domains.c.fleet_id == fleet_id,
            domains.c.state == DomainState.DEGRADED.value,
            sa.exists(
                sa.select(fleets.c.id).where(
                    fleets.c.id == fleet_id, fleets.c.active_domain_id == domain_id
                )
            ),
            ~sa.exists(
                sa.select(operations.c.id).where(
                    operations.c.fleet_id == fleet_id,
                    operations.c.state.in_(IN_FLIGHT_STATES),
                )
            ),
            viable_standby,
        )
        .values(state=DomainState.FAILED.value, state_updated_at=at, updated_at=at)
    )
    return await write_guarded(ex, stmt, domains.c.id, about)


async def record_route_lease(ex: Executor, fleet_id: UUID, lease_ms: int) -> bool:
    # Only ever raised, in one statement: racing processes end at the largest lease. Neither
    # updated_at nor the pointer moves (no route notification fires).
    stmt = (
        sa.update(fleets)
        .where(
            fleets.c.id == fleet_id,
            sa.or_(fleets.c.route_lease_ms.is_(None), fleets.c.route_lease_ms < lease_ms),
        )
        .values(route_lease_ms=lease_ms)
        .returning(fleets.c.id)
    )
    return bool(await ex.write(stmt))


async def record_connect_failed(ex: Executor, domain_id: UUID, *, at: datetime) -> bool:
    # Only ever moved forward, in one statement; neither updated_at nor the pointer moves (no
    # route notification, no cache invalidation).
    at = aware(at)
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id == domain_id,
            sa.or_(domains.c.connect_failed_at.is_(None), domains.c.connect_failed_at < at),
        )
        .values(connect_failed_at=at)
        .returning(domains.c.id)
    )
    return bool(await ex.write(stmt))


_DOMAIN_TIMES = (
    "last_seen_at",
    "state_updated_at",
    "launch_started_at",
    "launched_at",
    "connect_failed_at",
)
_OPERATION_TIMES = ("created_at", "step_started_at", "finished_at")


def _clamped(table: sa.Table, names: tuple[str, ...], at: datetime) -> tuple[Any, Any]:
    """``SET c = CASE WHEN c > at THEN at ELSE c END`` per column, and their ``OR`` guard."""
    columns = [table.c[name] for name in names]
    values = {c.name: sa.case((c > at, sa.literal(at, type_=c.type)), else_=c) for c in columns}
    return values, sa.or_(*(c > at for c in columns))


async def clamp_future_times(
    ex: Executor, fleet_id: UUID, *, operation_ids: Collection[UUID], at: datetime
) -> int:
    at = aware(at)
    values, ahead = _clamped(domains, _DOMAIN_TIMES, at)
    moved = await ex.write(
        sa.update(domains)
        .where(domains.c.fleet_id == fleet_id, ahead)
        .values(values)
        .returning(domains.c.id)
    )
    count = len(moved)
    if operation_ids:
        values, ahead = _clamped(operations, _OPERATION_TIMES, at)
        moved = await ex.write(
            sa.update(operations)
            .where(
                operations.c.fleet_id == fleet_id,
                operations.c.id.in_(tuple(operation_ids)),
                ahead,
            )
            .values(values)
            .returning(operations.c.id)
        )
        count += len(moved)
    return count
