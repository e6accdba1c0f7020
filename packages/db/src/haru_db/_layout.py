"""Layout apply: insert-if-absent for a fleet, its domains and slots, and the first pointer.

Each step is one statement that ignores rows a racer inserted, so concurrent applies are safe.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import sqlalchemy as sa
from haru_protocol import (
    DomainState,
    FleetLayout,
    FleetLayoutApplied,
    InferenceSlotSpec,
    InferenceSlotState,
    Provider,
    SlotKind,
    TrainingSlotState,
)

from haru_db._errors import HaruDbError, MalformedFleetStateError
from haru_db._events import append_event
from haru_db._exec import Executor, aware
from haru_db._tables import domains, fleets, slots

logger = logging.getLogger(__name__)

_I = InferenceSlotState
_T = TrainingSlotState


@dataclass(frozen=True, slots=True)
class LayoutApplyResult:
    """What :meth:`StateStore.apply_fleet_layout` created (all zero/False on a re-apply)."""

    fleet_id: UUID
    """The fleet the layout describes (created now or found by slug)."""
    fleet_created: bool
    domains_created: int
    slots_created: int
    pointer_set: bool
    """Whether this apply set the routing pointer to the declared active domain."""

    @property
    def changed(self) -> bool:
        """Whether the apply created or moved anything."""
        return (
            self.fleet_created
            or self.domains_created > 0
            or self.slots_created > 0
            or self.pointer_set
        )


async def apply_fleet_layout(
    ex: Executor, layout: FleetLayout, *, at: datetime
) -> LayoutApplyResult:
    at = aware(at)
    fleet_id, fleet_created = await ensure_fleet(ex, layout, at=at)
    domains_created = await ensure_domains(ex, fleet_id, layout, at=at)
    ids = await domain_ids(ex, fleet_id)
    declared = layout.active_domain_slug
    slots_created = await ensure_slots(ex, fleet_id, ids, layout, at=at)
    pointer_set = False
    if declared is not None and declared in ids:
        pointer_set = await set_initial_pointer(ex, fleet_id, ids[declared], at=at)
    result = LayoutApplyResult(
        fleet_id=fleet_id,
        fleet_created=fleet_created,
        domains_created=domains_created,
        slots_created=slots_created,
        pointer_set=pointer_set,
    )
    if result.changed:
        await append_event(
            ex,
            fleet_id=fleet_id,
            payload=FleetLayoutApplied(
                fleet_created=fleet_created,
                domains_created=domains_created,
                slots_created=slots_created,
                pointer_set=pointer_set,
            ),
            at=at,
        )
    logger.info(
        "layout %s applied: fleet created %s, %d domains, %d slots, pointer set %s",
        layout.slug,
        fleet_created,
        domains_created,
        slots_created,
        pointer_set,
    )
    return result


async def ensure_fleet(ex: Executor, layout: FleetLayout, *, at: datetime) -> tuple[UUID, bool]:
    policy = {} if layout.policy is None else layout.policy.stored()
    stmt = (
        ex.insert(fleets)
        .values(
            id=uuid4(),
            slug=layout.slug,
            display_name=layout.display_name,
            active_domain_id=None,
            route_revision=1,
            policy=policy,
            created_at=at,
            updated_at=at,
        )
        .on_conflict_do_nothing(index_elements=[fleets.c.slug])
        .returning(fleets.c.id)
    )
    rows = await ex.write(stmt)
    if rows:
        return rows[0]["id"], True
    found = await ex.read(sa.select(fleets.c.id).where(fleets.c.slug == layout.slug))
    if not found:  # pragma: no cover - fleets are never deleted
        raise HaruDbError(f"fleet {layout.slug!r} vanished while applying its layout")
    return found[0]["id"], False


async def ensure_domains(ex: Executor, fleet_id: UUID, layout: FleetLayout, *, at: datetime) -> int:
    values = [
        {
            "id": uuid4(),
            "fleet_id": fleet_id,
            "slug": d.slug,
            # Every new domain, static included, waits for its first good heartbeat:
            # nothing routes to endpoints no supervisor has confirmed.
            "state": DomainState.PROVISIONING.value,
            "provider": d.provider.value,
            "placement": d.placement.model_dump(mode="json"),
            "supervisor_url": d.supervisor_url,
            "serving_base_url": d.serving_base_url,
            "provisioning": None
            if d.provider is Provider.STATIC
            else d.settings.model_dump(mode="json"),
            "last_seen_at": None,
            "state_updated_at": at,
            "created_at": at,
            "updated_at": at,
        }
        for d in layout.domains
    ]
    stmt = (
        ex.insert(domains)
        .values(values)
        .on_conflict_do_nothing(
            index_elements=[domains.c.fleet_id, domains.c.slug],
            index_where=domains.c.removed_at.is_(None),
        )
        .returning(domains.c.id)
    )
    return len(await ex.write(stmt))


async def domain_ids(ex: Executor, fleet_id: UUID) -> dict[str, UUID]:
    rows = await ex.read(
        sa.select(domains.c.id, domains.c.slug).where(
            domains.c.fleet_id == fleet_id, domains.c.removed_at.is_(None)
        )
    )
    return {str(r["slug"]): r["id"] for r in rows}


async def ensure_slots(
    ex: Executor,
    fleet_id: UUID,
    domain_ids: Mapping[str, UUID],
    layout: FleetLayout,
    *,
    at: datetime,
) -> int:
    values: list[dict[str, Any]] = []
    for domain in layout.domains:
        domain_id = domain_ids[domain.slug]
        for spec in domain.slots:
            if isinstance(spec, InferenceSlotSpec):
                state: Any = initial_inference_state(
                    fleet_id,
                    domain_id,
                    declared_active=domain.slug == layout.active_domain_slug,
                )
            else:
                state = _T.IDLE.value
            values.append(
                {
                    "id": uuid4(),
                    "domain_id": domain_id,
                    "gpu_index": spec.gpu_index,
                    "kind": spec.kind.value,
                    "state": state,
                    "spec": spec.model_dump(mode="json"),
                    "state_updated_at": at,
                    "created_at": at,
                    "updated_at": at,
                }
            )
    if not values:  # pragma: no cover - a layout domain has at least one slot
        return 0
    stmt = (
        ex.insert(slots)
        .values(values)
        .on_conflict_do_nothing(
            index_elements=[slots.c.domain_id, slots.c.gpu_index, slots.c.kind],
            index_where=slots.c.removed_at.is_(None),
        )
        .returning(slots.c.id)
    )
    return len(await ex.write(stmt))


async def set_initial_pointer(
    ex: Executor, fleet_id: UUID, domain_id: UUID, *, at: datetime
) -> bool:
    inference = sa.and_(slots.c.domain_id == domain_id, slots.c.kind == SlotKind.INFERENCE.value)
    stmt = (
        sa.update(fleets)
        .where(
            fleets.c.id == fleet_id,
            fleets.c.active_domain_id.is_(None),
            sa.exists(sa.select(slots.c.id).where(inference)),
            ~sa.exists(sa.select(slots.c.id).where(inference, slots.c.state != _I.SERVING.value)),
        )
        .values(
            active_domain_id=domain_id,
            route_revision=fleets.c.route_revision + 1,
            # Not an operation's switch: keeps the SQLite routing trigger quiet.
            last_switch_operation_id=None,
            updated_at=at,
        )
        .returning(fleets.c.id)
    )
    return bool(await ex.write(stmt))


def initial_inference_state(
    fleet_id: UUID, domain_id: UUID, *, declared_active: bool
) -> sa.ScalarSelect[Any]:
    # Evaluated by the INSERT itself, so a pointer that moves between statements is honoured.
    on_active = fleets.c.active_domain_id == domain_id
    if declared_active:
        on_active = sa.or_(on_active, fleets.c.active_domain_id.is_(None))
    return (
        sa.select(sa.case((on_active, _I.SERVING.value), else_=_I.SLEEPING.value))
        .where(fleets.c.id == fleet_id)
        .scalar_subquery()
    )


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """A fleet's stored policy patch (the operator's values), read for a compare-and-swap."""

    fleet_id: UUID
    patch: dict[str, Any]
    """The operator's values as stored (camelCase); absent keys follow the current defaults."""
    version: str
    """The stored document's exact text: :meth:`StateStore.replace_fleet_policy` swaps only
    while it is unchanged."""


async def get_fleet_policy(ex: Executor, fleet_id: UUID) -> StoredPolicy | None:
    # The JSON column is read as its stored text: that text (not a re-serialisation, whose key
    # order or spacing could differ) is what the swap compares.
    stmt = sa.select(sa.cast(fleets.c.policy, sa.Text).label("policy")).where(
        fleets.c.id == fleet_id
    )
    rows = await ex.read(stmt)
    if not rows:
        return None
    text = str(rows[0]["policy"])
    patch = json.loads(text)
    if not isinstance(patch, dict):
        raise MalformedFleetStateError(f"fleet {fleet_id}: stored policy is not a JSON object")
    return StoredPolicy(fleet_id=fleet_id, patch=patch, version=text)
