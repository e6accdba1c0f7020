"""Predicates on a fleet snapshot: heartbeats judged, standby posture, the active domain."""

from __future__ import annotations

from haru_protocol import (
    DomainState,
    FleetSnapshot,
    TrainingSlotState,
)


def heartbeats_judged(fleet: FleetSnapshot) -> bool:
    """Whether every domain answered a heartbeat and was judged on it (no longer provisioning).

    A tick records the heartbeats (``lastSeenAt``) in one statement and moves a provisioning
    domain to ready or degraded in the next; between the two a demote of that domain is
    refused (422: only a degraded or ready domain can be demoted), so waiting for
    ``lastSeenAt`` alone is not enough (fault schedules ``pg-replicas:2052`` and ``:2053``).
    """
    return all(
        d.last_seen_at is not None and d.state is not DomainState.PROVISIONING
        for d in fleet.domains
    )


def is_standby_posture(fleet: FleetSnapshot, slug: str) -> bool:
    """Whether domain ``slug`` is a standby whose vLLM sleeps and whose training runs."""
    domain = next((d for d in fleet.domains if d.slug == slug), None)
    if domain is None or domain.id == fleet.active_domain_id:
        return False
    inference = [s for s in domain.slots if s.inference_spec is not None]
    training = [s for s in domain.slots if s.training_spec is not None]
    return all(s.state.value == "sleeping" for s in inference) and all(
        s.state is TrainingSlotState.TRAINING for s in training
    )


def active_slug(fleet: FleetSnapshot) -> str | None:
    """Slug of the fleet's active domain."""
    return next((d.slug for d in fleet.domains if d.id == fleet.active_domain_id), None)
