"""Events that ride the write of a domain, slot or fleet row: appended only when it lands.

On PostgreSQL a data-modifying CTE inserts them over the written row, in the write's own
statement; on SQLite the write sets the row's ``pending_events`` and migration 0012's
triggers insert them (fleet, domain and slot from the row, ``created_at`` from its
``updated_at``, the operation from the document since migration 0013) and clear the
column. Either way a process that dies after the write cannot leave the change without its
events (DESIGN 5.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import EventPayload
from sqlalchemy.dialects.postgresql import JSONB

from haru_db._events import OperationEvent
from haru_db._exec import Executor, aware
from haru_db._tables import domains, events


def _documents(payloads: Sequence[EventPayload]) -> list[dict[str, Any]]:
    return [OperationEvent.of(p).document() for p in payloads]


@dataclass(frozen=True, slots=True)
class RowEvents:
    """A write's events, what they are about and when: its statement appends them if it lands.

    ``fleet_id``, ``domain_id`` and ``slot_id`` must be the written row's own (its fleet, its
    domain): SQLite's triggers take them from the row, PostgreSQL stores these.
    ``operation_id`` names the operation the events are about (a fleet or domain row only:
    SQLite's slot triggers store none).
    """

    payloads: Sequence[EventPayload]
    at: datetime
    fleet_id: UUID
    domain_id: UUID | None = None
    slot_id: UUID | None = None
    operation_id: UUID | None = None

    def pending(self, ex: Executor) -> dict[str, Any]:
        """The ``pending_events`` value the written row takes on SQLite (none on PostgreSQL)."""
        # SQLite's triggers (migrations 0012, 0013) append these and clear the column.
        if ex.dialect == "postgresql" or not self.payloads:
            return {}
        documents = _documents(self.payloads)
        if self.operation_id is not None:
            # The 32 hex digits SQLite stores a UUID column in.
            documents = [{**d, "operationId": self.operation_id.hex} for d in documents]
        return {"pending_events": documents}


async def write_with_events(
    ex: Executor, stmt: sa.Update | sa.Insert, returned: sa.ColumnElement[Any], about: RowEvents
) -> list[Any]:
    """Run ``stmt`` (RETURNING ``returned``) and append ``about``'s events only when it lands.

    On SQLite ``stmt`` must set the row's ``pending_events`` (:meth:`RowEvents.pending`; its
    trigger appends them); on PostgreSQL they are inserted by a CTE over the written row, in
    the same statement.
    """
    if ex.dialect != "postgresql" or not about.payloads:
        return [r["value"] for r in await ex.write(stmt.returning(returned.label("value")))]
    changed = stmt.returning(returned.label("value")).cte("changed")
    rows = [
        sa.select(
            sa.literal(document["type"], events.c.type.type).label("type"),
            sa.cast(sa.literal(document["payload"], JSONB()), sa.JSON()).label("payload"),
            sa.literal(index, sa.Integer()).label("ord"),
        )
        for index, document in enumerate(_documents(about.payloads))
    ]
    source = sa.union_all(*rows).subquery("new_events")
    appended = (
        sa.insert(events)
        .from_select(
            ["fleet_id", "domain_id", "slot_id", "operation_id", "type", "payload", "created_at"],
            sa.select(
                sa.literal(about.fleet_id, events.c.fleet_id.type),
                sa.literal(about.domain_id, events.c.domain_id.type),
                sa.literal(about.slot_id, events.c.slot_id.type),
                sa.literal(about.operation_id, events.c.operation_id.type),
                source.c.type,
                source.c.payload,
                sa.literal(aware(about.at), events.c.created_at.type),
            )
            .where(sa.exists(sa.select(changed.c.value)))
            .order_by(source.c.ord),
        )
        .returning(events.c.id)
        .cte("appended")
    )
    stmt_all = sa.select(
        changed.c.value,
        sa.select(sa.func.count()).select_from(appended).scalar_subquery().label("events"),
    )
    return [r["value"] for r in await ex.write(stmt_all)]


def about_row(
    payloads: Sequence[EventPayload],
    at: datetime,
    fleet_id: UUID | None,
    domain_id: UUID | None,
    slot_id: UUID | None = None,
    operation_id: UUID | None = None,
) -> RowEvents | None:
    """The events a write carries, about its row (and ``operation_id``); None when none.

    Raises:
        ValueError: Events without the row's fleet (or, for a slot, without its domain).
    """
    if not payloads:
        return None
    if fleet_id is None or domain_id is None:
        raise ValueError("a write's events need the row's fleet_id (a slot's: domain_id)")
    return RowEvents(tuple(payloads), at, fleet_id, domain_id, slot_id, operation_id)


async def write_guarded(
    ex: Executor, stmt: sa.Update, returned: sa.ColumnElement[Any], about: RowEvents | None
) -> bool:
    """Run one guarded UPDATE, with ``about``'s events in the same statement; whether it landed."""
    if about is None:
        return bool(await ex.write(stmt.returning(returned)))
    return bool(await write_with_events(ex, stmt.values(**about.pending(ex)), returned, about))


async def write_domain(ex: Executor, stmt: sa.Update, about: RowEvents | None) -> bool:
    """Run one guarded UPDATE of a domain row with ``about``'s events; whether it landed.

    With events the row must also be of ``about.fleet_id``: they are stored with the ids given
    (PostgreSQL) or the row's (SQLite's trigger), so a write whose ids are not the row's lands
    on neither engine.
    """
    if about is not None:
        stmt = stmt.where(domains.c.fleet_id == about.fleet_id)
    return await write_guarded(ex, stmt, domains.c.id, about)
