"""A fleet snapshot built from a fleet layout, for orchestrators that keep no state store."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Final
from uuid import UUID, uuid5

from haru_protocol import (
    DomainSnapshot,
    DomainState,
    FleetLayout,
    FleetSnapshot,
    InferenceSlotSpec,
    InferenceSlotState,
    SlotSnapshot,
    TrainingSlotState,
    resolve_policy,
)

from haru_core._time import require_aware

LAYOUT_NAMESPACE: Final = UUID("6f1d3c9e-2b7a-5e3f-9a41-4c8d2e7b1a05")
"""Namespace of the ids :func:`snapshot_from_layout` derives (UUIDv5 of slugs)."""


def layout_id(*names: str) -> UUID:
    """The stable id of a fleet, domain or slot of a snapshot built from a layout.

    ``layout_id(fleet)``, ``layout_id(fleet, domain)``, ``layout_id(fleet, domain, kind, gpu)``.
    """
    return uuid5(LAYOUT_NAMESPACE, "/".join(names))


def snapshot_from_layout(
    layout: FleetLayout,
    *,
    now: datetime,
    states: Mapping[str, DomainState] | None = None,
    active: str | None = None,
    route_revision: int = 1,
) -> FleetSnapshot:
    """The snapshot the decision functions take, built from a layout and what was observed.

    Pure: the same arguments give the same snapshot (ids are UUIDv5 of the slugs, see
    :func:`layout_id`).

    Args:
        layout: The fleet layout document.
        now: When the observation was made (timezone-aware); it is every domain's
            ``stateUpdatedAt`` and, for the domains named in ``states``, ``lastSeenAt``.
        states: Domain slug -> its observed state. A domain not named is ``provisioning``
            with no heartbeat (as the server starts every new domain): nothing is promoted
            onto a domain nobody has seen.
        active: Slug of the active domain; default: the layout's ``activeDomainSlug``.
        route_revision: The routing pointer's revision (1 or more).

    Raises:
        ValueError: ``now`` is naive, or ``states``/``active`` name a domain the layout lacks.
    """
    require_aware("now", now)
    observed = dict(states or {})
    slugs = {domain.slug for domain in layout.domains}
    unknown = sorted(set(observed) - slugs)
    if unknown:
        raise ValueError(f"states name domains the layout lacks: {', '.join(unknown)}")
    active_slug = layout.active_domain_slug if active is None else active
    if active_slug is not None and active_slug not in slugs:
        raise ValueError(f"active domain {active_slug!r} is not in the layout")
    fleet_id = layout_id(layout.slug)
    domains: list[DomainSnapshot] = []
    for domain in layout.domains:
        domain_id = layout_id(layout.slug, domain.slug)
        is_active = domain.slug == active_slug
        slots = tuple(
            SlotSnapshot(
                id=layout_id(layout.slug, domain.slug, spec.kind.value, str(spec.gpu_index)),
                domain_id=domain_id,
                gpu_index=spec.gpu_index,
                kind=spec.kind,
                # The store's initial states: the active domain serves, a standby sleeps,
                # training is idle until a demotion starts it.
                state=(
                    (InferenceSlotState.SERVING if is_active else InferenceSlotState.SLEEPING)
                    if isinstance(spec, InferenceSlotSpec)
                    else TrainingSlotState.IDLE
                ),
                spec=spec,
            )
            for spec in domain.slots
        )
        seen = domain.slug in observed
        domains.append(
            DomainSnapshot(
                id=domain_id,
                fleet_id=fleet_id,
                slug=domain.slug,
                state=observed.get(domain.slug, DomainState.PROVISIONING),
                provider=domain.provider,
                placement=domain.placement,
                supervisor_url=domain.supervisor_url,
                serving_base_url=domain.serving_base_url,
                last_seen_at=now if seen else None,
                state_updated_at=now,
                slots=slots,
            )
        )
    return FleetSnapshot(
        id=fleet_id,
        slug=layout.slug,
        display_name=layout.display_name,
        active_domain_id=None if active_slug is None else layout_id(layout.slug, active_slug),
        route_revision=route_revision,
        policy=resolve_policy(layout.policy),
        domains=tuple(domains),
    )
