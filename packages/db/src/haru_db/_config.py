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

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NotRequired, TypedDict, Unpack
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

from haru_db._event_writes import RowEvents, write_with_events
from haru_db._exec import Executor, aware
from haru_db._layout import initial_inference_state
from haru_db._tables import IN_FLIGHT_STATES, domains, fleets, operations, slots

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


class ConfigWrite(TypedDict):
    """The keywords of every configuration write of a domain or a slot.

    ``fleet_id``: the row's fleet; ``revision``: the row's revision the plan read; ``at``: the
    write's time; ``events``: appended by the same statement, only when it lands.
    """

    fleet_id: UUID
    revision: int
    at: datetime
    events: NotRequired[Sequence[EventPayload]]


class SlotWrite(ConfigWrite):
    """The keywords of a slot's configuration write: those of :class:`ConfigWrite`, and more.

    ``domain_id``: the slot's domain; ``moves_traffic``: the write also requires that the
    domain is not the fleet's active one.
    """

    domain_id: UUID
    moves_traffic: bool


def _undriven(domain_id: UUID, *, moves_traffic: bool) -> list[sa.ColumnElement[bool]]:
    # No in-flight operation drives the domain; a write that moves traffic also needs it
    # not to be the fleet's active one.
    guards = [_not_driven(domain_id)]
    if moves_traffic:
        guards.append(_not_active(domain_id))
    return guards


async def _revision_cas(
    ex: Executor,
    table: sa.Table,
    guards: Sequence[sa.ColumnElement[bool]],
    values: dict[str, Any],
    about: RowEvents,
) -> int | None:
    """One guarded UPDATE of a ``table`` row that raises its revision; the new one, or None.

    ``guards`` include the row's id and the revision the plan read; ``about``'s events are
    appended by the same statement, only when it lands.
    """
    stmt = (
        sa.update(table)
        .where(*guards)
        .values(
            **values,
            config_revision=table.c.config_revision + 1,
            updated_at=aware(about.at),
            **about.pending(ex),
        )
    )
    found = await write_with_events(ex, stmt, table.c.config_revision, about)
    return int(found[0]) if found else None


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
    return await _revision_cas(
        ex,
        fleets,
        [fleets.c.id == fleet_id, fleets.c.config_revision == revision],
        {"display_name": display_name, "policy": policy},
        RowEvents(events, at, fleet_id),
    )


async def replace_fleet_policy(
    ex: Executor,
    fleet_id: UUID,
    *,
    version: str,
    patch: Mapping[str, Any],
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> bool:
    # Lands only while the stored text is the one the caller read; the revision moves (a plan
    # of `haru apply` made before this change is stale now), the route pointer does not.
    found = await _revision_cas(
        ex,
        fleets,
        [fleets.c.id == fleet_id, sa.cast(fleets.c.policy, sa.Text) == version],
        {"policy": dict(patch)},
        RowEvents(events, at, fleet_id),
    )
    return found is not None


async def update_domain_config(
    ex: Executor,
    domain_id: UUID,
    *,
    layout: DomainLayout,
    moves_traffic: bool,
    **write: Unpack[ConfigWrite],
) -> int | None:
    values: dict[str, Any] = {"placement": layout.placement.model_dump(mode="json")}
    if layout.provider is Provider.STATIC:
        values.update(
            supervisor_url=layout.supervisor_url, serving_base_url=layout.serving_base_url
        )
    else:
        # Its URLs are the ones recorded for its machine: kept.
        values["provisioning"] = layout.settings.model_dump(mode="json")
    return await _domain_cas(ex, domain_id, values, moves_traffic=moves_traffic, **write)


async def remove_domain(ex: Executor, domain_id: UUID, **write: Unpack[ConfigWrite]) -> int | None:
    at = aware(write["at"])
    # A provisioned domain goes `stopping` with its removal: the provisioner runs `sky down`.
    stopping = sa.and_(
        domains.c.provider != Provider.STATIC.value, domains.c.state.in_(_TEARDOWN_FROM)
    )
    values: dict[str, Any] = {
        "removed_at": at,
        "state": sa.case((stopping, DomainState.STOPPING.value), else_=domains.c.state),
        "state_updated_at": sa.case((stopping, at), else_=domains.c.state_updated_at),
    }
    # A removal never leaves the fleet without its active domain.
    return await _domain_cas(ex, domain_id, values, moves_traffic=True, **write)


async def _domain_cas(
    ex: Executor,
    domain_id: UUID,
    values: dict[str, Any],
    *,
    moves_traffic: bool,
    fleet_id: UUID,
    revision: int,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    guards = [
        domains.c.id == domain_id,
        domains.c.fleet_id == fleet_id,
        domains.c.config_revision == revision,
        domains.c.removed_at.is_(None),
        *_undriven(domain_id, moves_traffic=moves_traffic),
    ]
    return await _revision_cas(
        ex, domains, guards, values, RowEvents(events, at, fleet_id, domain_id)
    )


async def update_slot_spec(
    ex: Executor, slot_id: UUID, *, spec: SlotSpec, **write: Unpack[SlotWrite]
) -> int | None:
    return await _slot_cas(ex, slot_id, {"spec": spec.model_dump(mode="json")}, **write)


async def remove_slot(ex: Executor, slot_id: UUID, **write: Unpack[SlotWrite]) -> int | None:
    return await _slot_cas(ex, slot_id, {"removed_at": aware(write["at"])}, **write)


async def _slot_cas(
    ex: Executor,
    slot_id: UUID,
    values: dict[str, Any],
    *,
    fleet_id: UUID,
    domain_id: UUID,
    revision: int,
    moves_traffic: bool,
    at: datetime,
    events: Sequence[EventPayload] = (),
) -> int | None:
    guards = [
        slots.c.id == slot_id,
        slots.c.domain_id == domain_id,
        slots.c.config_revision == revision,
        slots.c.removed_at.is_(None),
        _present(domain_id),
        *_undriven(domain_id, moves_traffic=moves_traffic),
    ]
    about = RowEvents(events, at, fleet_id, domain_id, slot_id)
    return await _revision_cas(ex, slots, guards, values, about)


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
    about = RowEvents(events, at, fleet_id, domain_id)
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
            **about.pending(ex),
        )
        .on_conflict_do_nothing(
            index_elements=[domains.c.fleet_id, domains.c.slug],
            index_where=domains.c.removed_at.is_(None),
        )
    )
    found = await write_with_events(ex, stmt, domains.c.id, about)
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
    about = RowEvents(events, at, fleet_id, domain_id, slot_id)
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
    pending = about.pending(ex)
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
    found = await write_with_events(ex, stmt, slots.c.id, about)
    return _uuid(found[0]) if found else None
