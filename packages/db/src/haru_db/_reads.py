"""Reads: each one statement (so one consistent view), returning haru_protocol read models."""

from __future__ import annotations

import re
from collections.abc import Sequence
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import FleetRoutePointer, FleetSnapshot, Operation, is_slug

from haru_db._exec import Executor
from haru_db._rows import Row, operation_from_row, pointer_from_row, snapshot_from_rows
from haru_db._tables import domains, fleets, operations, slots

_UUID_RE = re.compile(
    r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)


async def get_fleet_snapshot(ex: Executor, ref: str) -> FleetSnapshot | None:
    match = _fleet_match(ref)
    if match is None:
        return None
    d = domains
    s = slots
    stmt = (
        sa.select(
            *(c.label(f"f_{c.name}") for c in fleets.c),
            *(c.label(f"d_{c.name}") for c in d.c),
            *(c.label(f"s_{c.name}") for c in s.c),
        )
        .select_from(
            fleets.outerjoin(d, d.c.fleet_id == fleets.c.id).outerjoin(s, s.c.domain_id == d.c.id)
        )
        .where(match)
    )
    rows = await ex.read(stmt)
    chosen = _choose_fleet(ref, rows, id_key="f_id")
    if chosen is None:
        return None
    return snapshot_from_rows([r for r in rows if r["f_id"] == chosen])


async def get_fleet_route_pointer(ex: Executor, ref: str) -> FleetRoutePointer | None:
    match = _fleet_match(ref)
    if match is None:
        return None
    stmt = sa.select(
        fleets.c.id, fleets.c.slug, fleets.c.active_domain_id, fleets.c.route_revision
    ).where(match)
    rows = await ex.read(stmt)
    chosen = _choose_fleet(ref, rows, id_key="id")
    if chosen is None:
        return None
    return pointer_from_row(next(r for r in rows if r["id"] == chosen))


async def list_fleets(ex: Executor) -> list[FleetRoutePointer]:
    rows = await ex.read(
        sa.select(fleets.c.id, fleets.c.slug, fleets.c.active_domain_id, fleets.c.route_revision)
    )
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


def _fleet_match(ref: str) -> sa.ColumnElement[bool] | None:
    by_slug = fleets.c.slug == ref if is_slug(ref) else None
    if _UUID_RE.match(ref):
        by_id = fleets.c.id == UUID(ref)
        return by_id if by_slug is None else sa.or_(by_id, by_slug)
    return by_slug


def _choose_fleet(ref: str, rows: Sequence[Row], *, id_key: str) -> UUID | None:
    # An id match wins over a slug that happens to look like a UUID (SPEC 3.1).
    ids = {r[id_key] for r in rows}
    if _UUID_RE.match(ref) and UUID(ref) in ids:
        return UUID(ref)
    return next(iter(ids), None)
