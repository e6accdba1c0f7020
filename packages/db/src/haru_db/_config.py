"""Configuration writes of ``haru apply``: one compare-and-swap per row on ``config_revision``.

Each write lands only while the row's revision is the one the plan read (and raises it by
one), and appends its ``fleet.config.changed`` events in its own statement, only when it lands
(a data-modifying CTE on PostgreSQL; ``pending_events`` and the triggers of migration 0012 on
SQLite). A domain or slot write also requires, in the same statement, that no in-flight
operation drives the domain (targets it or comes from it), and a write that would move traffic
requires that the domain is not the fleet's active one: a promotion that starts, or a pointer
that moves, between the plan and the write makes the write lose instead of changing a domain
under an operation.

A removal sets ``removed_at`` (DESIGN 5.2): the row stays for its events and operations, and
every read of the fleet leaves it out. A removed provisioned domain goes ``stopping`` in the
same statement, so the provisioner tears it down as after ``haru domain down``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import sqlalchemy as sa
from haru_protocol import (
    DomainLayout,
    DomainState,
    EventPayload,
    InferenceSlotSpec,
    Provider,
    SlotSpec,
    TrainingSlotState,
)
from sqlalchemy.dialects.postgresql import JSONB

from haru_db._events import OperationEvent
from haru_db._exec import Executor, aware
from haru_db._layout import initial_inference_state
from haru_db._tables import IN_FLIGHT_STATES, domains, events, fleets, operations, slots

_TEARDOWN_FROM = (
    DomainState.PROVISIONING.value,
    DomainState.READY.value,
    DomainState.DEGRADED.value,
    DomainState.FAILED.value,
)
"""The states ``haru domain down`` stops a provisioned domain from (removal does the same)."""


async def get_config_revisions(ex: Executor, fleet_id: UUID) -> dict[tuple[str, UUID], int]:
    # One statement: the fleet's, its domains' and its slots' revisions in one view.
    fleet_rows = sa.select(
        sa.literal("fleet").label("tbl"), fleets.c.id, fleets.c.config_revision
    ).where(fleets.c.id == fleet_id)
    domain_rows = sa.select(
        sa.literal("domain").label("tbl"), domains.c.id, domains.c.config_revision
    ).where(domains.c.fleet_id == fleet_id, domains.c.removed_at.is_(None))
    slot_rows = (
        sa.select(sa.literal("slot").label("tbl"), slots.c.id, slots.c.config_revision)
        .select_from(slots.join(domains, domains.c.id == slots.c.domain_id))
        .where(
            domains.c.fleet_id == fleet_id,
            domains.c.removed_at.is_(None),
            slots.c.removed_at.is_(None),
        )
    )
    rows = await ex.read(sa.union_all(fleet_rows, domain_rows, slot_rows))
    return {(str(r["tbl"]), _uuid(r["id"])): int(r["config_revision"]) for r in rows}


def _uuid(value: Any) -> UUID:
    # A UNION loses the column type on SQLite: the id may come back as its stored text.
    return value if isinstance(value, UUID) else UUID(str(value))


def _not_driven(domain_id: UUID) -> sa.ColumnElement[bool]:
    return ~sa.exists(
        sa.select(operations.c.id).where(
            operations.c.state.in_(IN_FLIGHT_STATES),
            sa.or_(
                operations.c.target_domain_id == domain_id,
                operations.c.source_domain_id == domain_id,
            ),
        )
    )


def _not_active(domain_id: UUID) -> sa.ColumnElement[bool]:
    return ~sa.exists(sa.select(fleets.c.id).where(fleets.c.active_domain_id == domain_id))


def _present(domain_id: UUID) -> sa.ColumnElement[bool]:
    return sa.exists(
        sa.select(domains.c.id).where(domains.c.id == domain_id, domains.c.removed_at.is_(None))
    )


def _documents(payloads: Sequence[EventPayload]) -> list[dict[str, Any]]:
    return [OperationEvent.of(p).document() for p in payloads]


async def _write_with_events(
    ex: Executor,
    stmt: sa.Update | sa.Insert,
    *,
    returned: sa.ColumnElement[Any],
    payloads: Sequence[EventPayload],
    fleet_id: UUID,
    domain_id: UUID | None,
    slot_id: UUID | None,
    at: datetime,
) -> list[Any]:
    """Run ``stmt`` (RETURNING ``returned``) and append ``payloads`` only when it lands.

    On SQLite ``stmt`` must set the row's ``pending_events`` (its trigger appends them); on
    PostgreSQL they are inserted by a CTE over the written row, in the same statement.
    """
    if ex.dialect != "postgresql" or not payloads:
        return [r["value"] for r in await ex.write(stmt.returning(returned.label("value")))]
    changed = stmt.returning(returned.label("value")).cte("changed")
    rows = [
        sa.select(
            sa.literal(document["type"], events.c.type.type).label("type"),
            sa.cast(sa.literal(document["payload"], JSONB()), sa.JSON()).label("payload"),
            sa.literal(index, sa.Integer()).label("ord"),
        )
        for index, document in enumerate(_documents(payloads))
    ]
    source = sa.union_all(*rows).subquery("new_events")
    appended = (
        sa.insert(events)
        .from_select(
            ["fleet_id", "domain_id", "slot_id", "type", "payload", "created_at"],
            sa.select(
                sa.literal(fleet_id, events.c.fleet_id.type),
                sa.literal(domain_id, events.c.domain_id.type),
                sa.literal(slot_id, events.c.slot_id.type),
                source.c.type,
                source.c.payload,
                sa.literal(aware(at), events.c.created_at.type),
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


def _pending(ex: Executor, payloads: Sequence[EventPayload]) -> dict[str, Any]:
    # SQLite's triggers (migration 0012) append these and clear the column.
    if ex.dialect == "postgresql" or not payloads:
        return {}
    return {"pending_events": _documents(payloads)}


async def update_fleet_config(
    ex: Executor,
    fleet_id: UUID,
    *,
    revision: int,
    display_name: str | None,
    policy: dict[str, Any],
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    stmt = (
        sa.update(fleets)
        .where(fleets.c.id == fleet_id, fleets.c.config_revision == revision)
        .values(
            display_name=display_name,
            policy=policy,
            config_revision=fleets.c.config_revision + 1,
            updated_at=aware(at),
            **_pending(ex, events),
        )
    )
    found = await _write_with_events(
        ex,
        stmt,
        returned=fleets.c.config_revision,
        payloads=events,
        fleet_id=fleet_id,
        domain_id=None,
        slot_id=None,
        at=at,
    )
    return int(found[0]) if found else None


async def update_domain_config(
    ex: Executor,
    domain_id: UUID,
    *,
    fleet_id: UUID,
    revision: int,
    layout: DomainLayout,
    moves_traffic: bool,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    guards = [
        domains.c.id == domain_id,
        domains.c.fleet_id == fleet_id,
        domains.c.config_revision == revision,
        domains.c.removed_at.is_(None),
        _not_driven(domain_id),
    ]
    if moves_traffic:
        guards.append(_not_active(domain_id))
    values: dict[str, Any] = {
        "placement": layout.placement.model_dump(mode="json"),
        "config_revision": domains.c.config_revision + 1,
        "updated_at": aware(at),
        **_pending(ex, events),
    }
    if layout.provider is Provider.STATIC:
        values.update(
            supervisor_url=layout.supervisor_url, serving_base_url=layout.serving_base_url
        )
    else:
        # Its URLs are the ones recorded for its machine: kept.
        values["provisioning"] = layout.settings.model_dump(mode="json")
    found = await _write_with_events(
        ex,
        sa.update(domains).where(*guards).values(**values),
        returned=domains.c.config_revision,
        payloads=events,
        fleet_id=fleet_id,
        domain_id=domain_id,
        slot_id=None,
        at=at,
    )
    return int(found[0]) if found else None


async def remove_domain(
    ex: Executor,
    domain_id: UUID,
    *,
    fleet_id: UUID,
    revision: int,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    at = aware(at)
    # A provisioned domain goes `stopping` with its removal: the provisioner runs `sky down`.
    stopping = sa.and_(
        domains.c.provider != Provider.STATIC.value, domains.c.state.in_(_TEARDOWN_FROM)
    )
    stmt = (
        sa.update(domains)
        .where(
            domains.c.id == domain_id,
            domains.c.fleet_id == fleet_id,
            domains.c.config_revision == revision,
            domains.c.removed_at.is_(None),
            _not_driven(domain_id),
            _not_active(domain_id),
        )
        .values(
            removed_at=at,
            state=sa.case((stopping, DomainState.STOPPING.value), else_=domains.c.state),
            state_updated_at=sa.case((stopping, at), else_=domains.c.state_updated_at),
            config_revision=domains.c.config_revision + 1,
            updated_at=at,
            **_pending(ex, events),
        )
    )
    found = await _write_with_events(
        ex,
        stmt,
        returned=domains.c.config_revision,
        payloads=events,
        fleet_id=fleet_id,
        domain_id=domain_id,
        slot_id=None,
        at=at,
    )
    return int(found[0]) if found else None


async def update_slot_spec(
    ex: Executor,
    slot_id: UUID,
    *,
    fleet_id: UUID,
    domain_id: UUID,
    revision: int,
    spec: SlotSpec,
    moves_traffic: bool,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    return await _slot_cas(
        ex,
        slot_id,
        fleet_id=fleet_id,
        domain_id=domain_id,
        revision=revision,
        moves_traffic=moves_traffic,
        values={"spec": spec.model_dump(mode="json")},
        at=at,
        events=events,
    )


async def remove_slot(
    ex: Executor,
    slot_id: UUID,
    *,
    fleet_id: UUID,
    domain_id: UUID,
    revision: int,
    moves_traffic: bool,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    return await _slot_cas(
        ex,
        slot_id,
        fleet_id=fleet_id,
        domain_id=domain_id,
        revision=revision,
        moves_traffic=moves_traffic,
        values={"removed_at": aware(at)},
        at=at,
        events=events,
    )


async def _slot_cas(
    ex: Executor,
    slot_id: UUID,
    *,
    fleet_id: UUID,
    domain_id: UUID,
    revision: int,
    moves_traffic: bool,
    values: dict[str, Any],
    at: datetime,
    events: Sequence[EventPayload],
) -> int | None:
    guards = [
        slots.c.id == slot_id,
        slots.c.domain_id == domain_id,
        slots.c.config_revision == revision,
        slots.c.removed_at.is_(None),
        _present(domain_id),
        _not_driven(domain_id),
    ]
    if moves_traffic:
        guards.append(_not_active(domain_id))
    stmt = (
        sa.update(slots)
        .where(*guards)
        .values(
            **values,
            config_revision=slots.c.config_revision + 1,
            updated_at=aware(at),
            **_pending(ex, events),
        )
    )
    found = await _write_with_events(
        ex,
        stmt,
        returned=slots.c.config_revision,
        payloads=events,
        fleet_id=fleet_id,
        domain_id=domain_id,
        slot_id=slot_id,
        at=at,
    )
    return int(found[0]) if found else None


async def add_domain(
    ex: Executor,
    fleet_id: UUID,
    layout: DomainLayout,
    *,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> UUID | None:
    at = aware(at)
    domain_id = uuid4()
    stmt = (
        ex.insert(domains)
        .values(
            id=domain_id,
            fleet_id=fleet_id,
            slug=layout.slug,
            # As a seeded domain: nothing routes to it before a supervisor confirms it.
            state=DomainState.PROVISIONING.value,
            provider=layout.provider.value,
            placement=layout.placement.model_dump(mode="json"),
            supervisor_url=layout.supervisor_url,
            serving_base_url=layout.serving_base_url,
            provisioning=None
            if layout.provider is Provider.STATIC
            else layout.settings.model_dump(mode="json"),
            last_seen_at=None,
            state_updated_at=at,
            created_at=at,
            updated_at=at,
            **_pending(ex, events),
        )
        .on_conflict_do_nothing(
            index_elements=[domains.c.fleet_id, domains.c.slug],
            index_where=domains.c.removed_at.is_(None),
        )
    )
    found = await _write_with_events(
        ex,
        stmt,
        returned=domains.c.id,
        payloads=events,
        fleet_id=fleet_id,
        domain_id=domain_id,
        slot_id=None,
        at=at,
    )
    if not found:
        return None
    for spec in layout.slots:
        await add_slot(ex, fleet_id, domain_id, spec, at=at)
    return domain_id


async def add_slot(
    ex: Executor,
    fleet_id: UUID,
    domain_id: UUID,
    spec: SlotSpec,
    *,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> UUID | None:
    """Insert a slot while the domain is not removed and no operation drives it."""
    at = aware(at)
    slot_id = uuid4()
    state: Any = (
        initial_inference_state(fleet_id, domain_id, declared_active=False)
        if isinstance(spec, InferenceSlotSpec)
        else sa.literal(TrainingSlotState.IDLE.value, slots.c.state.type)
    )
    values: dict[str, Any] = {
        "id": sa.literal(slot_id, slots.c.id.type),
        "domain_id": sa.literal(domain_id, slots.c.domain_id.type),
        "gpu_index": sa.literal(spec.gpu_index, slots.c.gpu_index.type),
        "kind": sa.literal(spec.kind.value, slots.c.kind.type),
        "state": state,
        "spec": sa.literal(spec.model_dump(mode="json"), slots.c.spec.type),
        "state_updated_at": sa.literal(at, slots.c.state_updated_at.type),
        "created_at": sa.literal(at, slots.c.created_at.type),
        "updated_at": sa.literal(at, slots.c.updated_at.type),
    }
    pending = _pending(ex, events)
    if pending:
        values["pending_events"] = sa.literal(
            pending["pending_events"], slots.c.pending_events.type
        )
    source = sa.select(*(v.label(k) for k, v in values.items())).where(
        _present(domain_id), _not_driven(domain_id)
    )
    stmt = (
        ex.insert(slots)
        .from_select(list(values), source)
        .on_conflict_do_nothing(
            index_elements=[slots.c.domain_id, slots.c.gpu_index, slots.c.kind],
            index_where=slots.c.removed_at.is_(None),
        )
    )
    found = await _write_with_events(
        ex,
        stmt,
        returned=slots.c.id,
        payloads=events,
        fleet_id=fleet_id,
        domain_id=domain_id,
        slot_id=slot_id,
        at=at,
    )
    return _uuid(found[0]) if found else None
