"""Where traffic may go: routable models of the active domain and the route intent (DESIGN 7.4)."""

from __future__ import annotations

from datetime import datetime

from haru_protocol import (
    DomainSnapshot,
    FleetSnapshot,
    InferenceSlotState,
    ModelBinding,
    RouteIntent,
    RouteModel,
    RouteTarget,
    SlotSnapshot,
)

from haru_core._bindings import inference_slots, slot_bindings
from haru_core._failover import rank_standbys
from haru_core._states import ROUTABLE_DOMAIN_STATES
from haru_core._time import require_aware


def _slot_eligible(domain: DomainSnapshot, slot: SlotSnapshot) -> bool:
    return domain.state in ROUTABLE_DOMAIN_STATES and slot.state is InferenceSlotState.SERVING


def _route_models(domain: DomainSnapshot, *, active: bool) -> tuple[RouteModel, ...]:
    # A standby's models are never eligible, even if one of its slots happens to be serving
    # (say, after a promotion failed past its wake): standbys take no traffic.
    return tuple(
        RouteModel(
            name=binding.name,
            serving_url=binding.serving_url,
            # A provisioned domain's model has no URL until its machine's address is recorded.
            eligible=active and binding.serving_url is not None and _slot_eligible(domain, slot),
        )
        for slot in inference_slots(domain)
        for binding in slot_bindings(slot)
    )


def _routable_domain(fleet: FleetSnapshot) -> DomainSnapshot | None:
    active = fleet.active_domain
    if active is None or active.state not in ROUTABLE_DOMAIN_STATES:
        return None
    return active


def routable_models(fleet: FleetSnapshot) -> tuple[RouteModel, ...]:
    """The eligible models of the active domain, in layout order (empty when none can serve)."""
    active = _routable_domain(fleet)
    if active is None:
        return ()
    return tuple(m for m in _route_models(active, active=True) if m.eligible)


def find_routable_binding(fleet: FleetSnapshot, model: str) -> ModelBinding | None:
    """The binding that serves ``model`` right now, if any.

    Needs an active domain that is ready or degraded and binds ``model`` on a ``serving`` slot.
    """
    active = _routable_domain(fleet)
    if active is None:
        return None
    for slot in inference_slots(active):
        if slot.state is not InferenceSlotState.SERVING:
            continue
        for binding in slot_bindings(slot):
            if binding.name == model and binding.serving_url is not None:
                return binding
    return None


def _target(domain: DomainSnapshot, *, active: bool) -> RouteTarget:
    models = _route_models(domain, active=active)
    eligible = active and domain.serving_base_url is not None and any(m.eligible for m in models)
    return RouteTarget(
        domain_id=domain.id,
        domain_slug=domain.slug,
        endpoint_url=domain.serving_base_url,
        eligible=eligible,
        weight=1 if active else 0,
        models=models,
    )


def build_route_intent(fleet: FleetSnapshot, *, now: datetime) -> RouteIntent:
    """The provider-neutral route intent of ``fleet`` at ``now`` (DESIGN 7.4).

    A model is eligible when its domain is ready or degraded and its slot is serving. The active
    target has weight 1 and is eligible when it has an endpoint URL and at least one eligible
    model. Standbys are never eligible (nor are their models), have weight 0, and are ranked
    like :func:`~haru_core.rank_standbys`.

    Raises:
        ValueError: ``now`` is a naive datetime.
    """
    require_aware("now", now)
    active = fleet.active_domain
    return RouteIntent(
        fleet_id=fleet.id,
        fleet_slug=fleet.slug,
        revision=fleet.route_revision,
        generated_at=now,
        active=None if active is None else _target(active, active=True),
        standbys=tuple(_target(d, active=False) for d in rank_standbys(fleet)),
    )
