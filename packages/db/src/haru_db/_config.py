"""Configuration writes of ``haru apply``: one compare-and-swap per row on ``config_revision``.

Each write lands only while the row's revision is the one the plan read (and raises it by
one). A domain or slot write also requires, in the same statement, that no in-flight operation
drives the domain (targets it or comes from it), and a write that would move traffic requires
that the domain is not the fleet's active one: a promotion that starts, or a pointer that
moves, between the plan and the write makes the write lose instead of changing a domain under
an operation.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import sqlalchemy as sa
from haru_protocol import (
    DomainLayout,
    DomainState,
    InferenceSlotSpec,
    Provider,
    SlotSpec,
    TrainingSlotState,
)

from haru_db._exec import Executor, aware
from haru_db._layout import initial_inference_state
from haru_db._tables import IN_FLIGHT_STATES, domains, fleets, operations, slots


async def get_config_revisions(ex: Executor, fleet_id: UUID) -> dict[tuple[str, UUID], int]:
    # One statement: the fleet's, its domains' and its slots' revisions in one view.
    fleet_rows = sa.select(
        sa.literal("fleet").label("tbl"), fleets.c.id, fleets.c.config_revision
    ).where(fleets.c.id == fleet_id)
    domain_rows = sa.select(
        sa.literal("domain").label("tbl"), domains.c.id, domains.c.config_revision
    ).where(domains.c.fleet_id == fleet_id)
    slot_rows = (
        sa.select(sa.literal("slot").label("tbl"), slots.c.id, slots.c.config_revision)
        .select_from(slots.join(domains, domains.c.id == slots.c.domain_id))
        .where(domains.c.fleet_id == fleet_id)
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


async def update_fleet_config(
    ex: Executor,
    fleet_id: UUID,
    *,
    revision: int,
    display_name: str | None,
    policy: dict[str, Any],
    at: datetime,
) -> int | None:
    stmt = (
        sa.update(fleets)
        .where(fleets.c.id == fleet_id, fleets.c.config_revision == revision)
        .values(
            display_name=display_name,
            policy=policy,
            config_revision=fleets.c.config_revision + 1,
            updated_at=aware(at),
        )
        .returning(fleets.c.config_revision)
    )
    rows = await ex.write(stmt)
    return int(rows[0]["config_revision"]) if rows else None


async def update_domain_config(
    ex: Executor,
    domain_id: UUID,
    *,
    revision: int,
    layout: DomainLayout,
    moves_traffic: bool,
    at: datetime,
) -> int | None:
    guards = [
        domains.c.id == domain_id,
        domains.c.config_revision == revision,
        _not_driven(domain_id),
    ]
    if moves_traffic:
        guards.append(_not_active(domain_id))
    values: dict[str, Any] = {
        "placement": layout.placement.model_dump(mode="json"),
        "config_revision": domains.c.config_revision + 1,
        "updated_at": aware(at),
    }
    if layout.provider is Provider.STATIC:
        values.update(
            supervisor_url=layout.supervisor_url, serving_base_url=layout.serving_base_url
        )
    else:
        # Its URLs are the ones recorded for its machine: kept.
        values["provisioning"] = layout.settings.model_dump(mode="json")
    stmt = sa.update(domains).where(*guards).values(**values).returning(domains.c.config_revision)
    rows = await ex.write(stmt)
    return int(rows[0]["config_revision"]) if rows else None


async def update_slot_spec(
    ex: Executor,
    slot_id: UUID,
    *,
    domain_id: UUID,
    revision: int,
    spec: SlotSpec,
    moves_traffic: bool,
    at: datetime,
) -> int | None:
    guards = [
        slots.c.id == slot_id,
        slots.c.domain_id == domain_id,
        slots.c.config_revision == revision,
        _not_driven(domain_id),
    ]
    if moves_traffic:
        guards.append(_not_active(domain_id))
    stmt = (
        sa.update(slots)
        .where(*guards)
        .values(
            spec=spec.model_dump(mode="json"),
            config_revision=slots.c.config_revision + 1,
            updated_at=aware(at),
        )
        .returning(slots.c.config_revision)
    )
    rows = await ex.write(stmt)
    return int(rows[0]["config_revision"]) if rows else None


async def add_domain(
    ex: Executor, fleet_id: UUID, layout: DomainLayout, *, at: datetime
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
        )
        .on_conflict_do_nothing(index_elements=[domains.c.fleet_id, domains.c.slug])
        .returning(domains.c.id)
    )
    if not await ex.write(stmt):
        return None
    for spec in layout.slots:
        await add_slot(ex, fleet_id, domain_id, spec, at=at)
    return domain_id


async def add_slot(
    ex: Executor, fleet_id: UUID, domain_id: UUID, spec: SlotSpec, *, at: datetime
) -> UUID | None:
    at = aware(at)
    state: Any = (
        initial_inference_state(fleet_id, domain_id, declared_active=False)
        if isinstance(spec, InferenceSlotSpec)
        else TrainingSlotState.IDLE.value
    )
    stmt = (
        ex.insert(slots)
        .values(
            id=uuid4(),
            domain_id=domain_id,
            gpu_index=spec.gpu_index,
            kind=spec.kind.value,
            state=state,
            spec=spec.model_dump(mode="json"),
            state_updated_at=at,
            created_at=at,
            updated_at=at,
        )
        .on_conflict_do_nothing(index_elements=[slots.c.domain_id, slots.c.gpu_index, slots.c.kind])
        .returning(slots.c.id)
    )
    rows = await ex.write(stmt)
    return rows[0]["id"] if rows else None
