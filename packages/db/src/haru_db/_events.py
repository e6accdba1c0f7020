"""The audit log: appending events (alone or inside an operation's CAS) and paging them."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from haru_protocol import Event, EventPayload, check_event_payload, event_payload_document

from haru_db._exec import Executor, aware
from haru_db._rows import event_from_row
from haru_db._tables import events

MAX_EVENT_PAGE = 1000
MAX_EVENT_TYPE = 128


@dataclass(frozen=True, slots=True)
class OperationEvent:
    """An event an operation's CAS appends in its own statement, only when the CAS lands.

    It is stored with the operation's fleet, the operation's target domain, the operation id
    and the CAS time, exactly as :meth:`~haru_db.StateStore.append_event` would store it.
    """

    type: str
    """The event type (1 to 128 characters)."""
    payload: Mapping[str, object] = field(default_factory=dict)
    """Strict JSON (no NaN, no datetime)."""

    @classmethod
    def of(cls, payload: EventPayload) -> OperationEvent:
        """The event a typed payload describes (its type comes from the payload's model)."""
        return cls(payload.event_type.value, event_payload_document(payload))

    def document(self) -> dict[str, Any]:
        """The checked ``{"type", "payload"}`` document.

        Raises:
            TypeError: The payload is not strict JSON.
            ValueError: The type is empty or longer than 128 characters.
        """
        type_ = checked_type(self.type)
        return {"type": type_, "payload": checked_payload(type_, self.payload)}


def checked_type(type_: str) -> str:
    if not 1 <= len(type_) <= MAX_EVENT_TYPE:
        raise ValueError(f"event type must be 1 to {MAX_EVENT_TYPE} characters")
    return str(type_)


def typed_event(
    type_: str | None, payload: EventPayload | Mapping[str, object]
) -> tuple[str, dict[str, Any]]:
    """The checked ``(type, payload document)`` of an event to append.

    A typed payload names its own type (``type_`` may be omitted, and must agree if given).
    A raw mapping needs ``type_``; when that type has a model, the mapping must fit it, so a
    reader never sees our own writes as malformed.
    """
    if isinstance(payload, EventPayload):
        own = payload.event_type.value
        if type_ is not None and str(type_) != own:
            raise ValueError(
                f"a {type(payload).__name__} payload belongs to {own!r}, not {type_!r}"
            )
        return own, checked_payload(own, event_payload_document(payload))
    if type_ is None:
        raise ValueError("an untyped payload needs its event type")
    checked = checked_type(type_)
    return checked, checked_payload(checked, payload)


def checked_payload(type_: str, payload: Mapping[str, object]) -> dict[str, Any]:
    check_event_payload(type_, payload)
    document = dict(payload)
    try:
        # Strict JSON: NaN/Infinity would be stored by SQLite and refused by PostgreSQL.
        json.dumps(document, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"event payload is not JSON-serializable: {exc}") from exc
    return document


async def append_event(
    ex: Executor,
    *,
    fleet_id: UUID,
    payload: EventPayload | Mapping[str, object],
    at: datetime,
    type: str | None = None,
    domain_id: UUID | None = None,
    slot_id: UUID | None = None,
    operation_id: UUID | None = None,
) -> int:
    at = aware(at)
    type_, document = typed_event(type, payload)
    stmt = (
        sa.insert(events)
        .values(
            fleet_id=fleet_id,
            domain_id=domain_id,
            slot_id=slot_id,
            operation_id=operation_id,
            type=type_,
            payload=document,
            created_at=at,
        )
        .returning(events.c.id)
    )
    rows = await ex.write(stmt)
    return int(rows[0]["id"])


async def list_events(ex: Executor, fleet_id: UUID, *, after: int, limit: int) -> list[Event]:
    if after < 0:
        raise ValueError("after must not be negative")
    if not 1 <= limit <= MAX_EVENT_PAGE:
        raise ValueError(f"limit must be between 1 and {MAX_EVENT_PAGE}")
    stmt = (
        sa.select(events)
        .where(events.c.fleet_id == fleet_id, events.c.id > after)
        .order_by(events.c.id)
        .limit(limit)
    )
    return [event_from_row(row) for row in await ex.read(stmt)]


async def list_domain_events(
    ex: Executor,
    fleet_id: UUID,
    domain_id: UUID,
    *,
    types: Collection[str],
    before: int | None,
    limit: int,
) -> list[Event]:
    if before is not None and before < 1:
        raise ValueError("before must be positive")
    if not 1 <= limit <= MAX_EVENT_PAGE:
        raise ValueError(f"limit must be between 1 and {MAX_EVENT_PAGE}")
    if not types:
        return []
    where = [events.c.fleet_id == fleet_id, events.c.domain_id == domain_id]
    where.append(events.c.type.in_(sorted(types)))
    if before is not None:
        where.append(events.c.id < before)
    stmt = sa.select(events).where(*where).order_by(events.c.id.desc()).limit(limit)
    return [event_from_row(row) for row in await ex.read(stmt)]
