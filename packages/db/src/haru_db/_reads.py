"""Reads: each one statement (so one consistent view), returning haru_protocol read models."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import (
    IN_FLIGHT_OPERATION_STATES,
    DomainSnapshot,
    DomainState,
    FleetRef,
    FleetRoutePointer,
    FleetSnapshot,
    Operation,
    OperationKind,
    parse_fleet_ref,
)

from haru_db._exec import Executor
from haru_db._rows import operation_from_row, pointer_from_row, snapshot_from_rows
from haru_db._tables import domains, fleets, operations, slots


async def get_fleet_snapshot(ex: Executor, ref: str | FleetRef) -> FleetSnapshot | None:
    ref = _parsed(ref)
    match = _fleet_match(ref)
    if match is None:
        return None
    # Removed rows (migration 0012) are no part of the fleet any more.
    rows = await ex.read(_snapshot_statement(match, domains.c.removed_at.is_(None)))
    chosen = ref.choose({r["f_id"]: r["f_slug"] for r in rows})
    if chosen is None:
        return None
    return snapshot_from_rows([r for r in rows if r["f_id"] == chosen])


async def list_removed_teardowns(ex: Executor, fleet_id: UUID) -> list[DomainSnapshot]:
    removed = sa.and_(
        domains.c.removed_at.is_not(None), domains.c.state == DomainState.STOPPING.value
    )
    rows = await ex.read(_snapshot_statement(fleets.c.id == fleet_id, removed))
    if not rows:
        return []
    return list(snapshot_from_rows(rows).domains)


def _snapshot_statement(
    match: sa.ColumnElement[bool], domain_filter: sa.ColumnElement[bool]
) -> sa.Select[Any]:
    d = domains
    s = slots
    return (
        sa.select(
            *(c.label(f"f_{c.name}") for c in fleets.c),
            *(c.label(f"d_{c.name}") for c in d.c),
            *(c.label(f"s_{c.name}") for c in s.c),
        )
        .select_from(
            fleets.outerjoin(d, sa.and_(d.c.fleet_id == fleets.c.id, domain_filter)).outerjoin(
                s, sa.and_(s.c.domain_id == d.c.id, s.c.removed_at.is_(None))
            )
        )
        .where(match)
    )


def _pointer_columns() -> tuple[sa.ColumnElement[Any], ...]:
    # The in-flight check rides the pointer's own statement (one read, one consistent view);
    # uq_operations_one_in_flight_per_fleet indexes exactly the rows it looks for.
    promoting = (
        sa.select(operations.c.id)
        .where(
            operations.c.fleet_id == fleets.c.id,
            operations.c.kind == OperationKind.PROMOTE.value,
            operations.c.state.in_([s.value for s in IN_FLIGHT_OPERATION_STATES]),
        )
        .exists()
        .label("promotion_in_flight")
    )
    c = fleets.c
    return (c.id, c.slug, c.active_domain_id, c.route_revision, promoting)


async def get_fleet_route_pointer(ex: Executor, ref: str | FleetRef) -> FleetRoutePointer | None:
    ref = _parsed(ref)
    match = _fleet_match(ref)
    if match is None:
        return None
    stmt = sa.select(*_pointer_columns()).where(match)
    rows = await ex.read(stmt)
    chosen = ref.choose({r["id"]: r["slug"] for r in rows})
    if chosen is None:
        return None
    return pointer_from_row(next(r for r in rows if r["id"] == chosen))


async def get_route_lease_ms(ex: Executor, fleet_id: UUID) -> int | None:
    rows = await ex.read(sa.select(fleets.c.route_lease_ms).where(fleets.c.id == fleet_id))
    if not rows or rows[0]["route_lease_ms"] is None:
        return None
    return int(rows[0]["route_lease_ms"])


async def list_fleets(ex: Executor) -> list[FleetRoutePointer]:
    rows = await ex.read(sa.select(*_pointer_columns()))
    return sorted((pointer_from_row(r) for r in rows), key=lambda p: p.slug)


async def get_operation(
    ex: Executor, operation_id: UUID, *, fleet_id: UUID | None
) -> Operation | None:
    stmt = sa.select(operations).where(operations.c.id == operation_id)
    if fleet_id is not None:
        stmt = stmt.where(operations.c.fleet_id == fleet_id)
    rows = await ex.read(stmt)
    return operation_from_row(rows[0]) if rows else None


async def ping(ex: Executor) -> None:
    await ex.read(sa.select(sa.literal(1).label("ok")))


# SQLite's 'now' is the host's clock, read by the process running the statement: every process
# sharing one SQLite file runs on that host, so they all read the same clock.
_SQLITE_NOW = sa.text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now') AS now")
# clock_timestamp(), not now(): now() is the transaction's start, and the read is timed by the
# caller around this very statement.
_POSTGRES_NOW = sa.text("SELECT clock_timestamp() AS now")


async def database_now(ex: Executor) -> datetime:
    if ex.dialect == "postgresql":
        rows = await ex.read(_POSTGRES_NOW)
        value = rows[0]["now"]
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise TypeError(f"clock_timestamp() returned {value!r}")
        return value.astimezone(UTC)
    rows = await ex.read(_SQLITE_NOW)
    return datetime.fromisoformat(str(rows[0]["now"])).replace(tzinfo=UTC)


def _parsed(ref: str | FleetRef) -> FleetRef:
    return ref if isinstance(ref, FleetRef) else parse_fleet_ref(ref)


def _fleet_match(ref: FleetRef) -> sa.ColumnElement[bool] | None:
    """Rows the reference may name (id or slug); :meth:`FleetRef.choose` picks among them."""
    by_id = None if ref.id is None else fleets.c.id == ref.id
    by_slug = None if ref.slug is None else fleets.c.slug == ref.slug
    if by_id is not None and by_slug is not None:
        return sa.or_(by_id, by_slug)
    return by_id if by_id is not None else by_slug
