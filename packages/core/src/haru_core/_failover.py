"""Standby ranking, failover detection and degraded escalation (SPEC 7.3 step 2, 7.4).

Evidence about the active comes in two strengths. Strong: its supervisor answers and every
model the layout binds to the active refuses connections (nothing listens on the port: the
vLLM process is gone); once a later heartbeat, at least ``deadConfirmMs`` after the first,
still proves it, the active fails at once (:func:`detect_dead_active`). Weak: anything else
(an unanswered heartbeat, a slow or erroring server, one model of several down while the
others serve) keeps the ``degradedGraceMs`` grace and the ``heartbeatStaleMs`` staleness.
A server that reaches no domain of a fleet judges nothing (:func:`server_partitioned`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal
from uuid import UUID

from haru_protocol import (
    DomainSnapshot,
    DomainState,
    FleetSnapshot,
    InferenceSlotState,
    SupervisorStatus,
)

from haru_core._backoff import in_backoff
from haru_core._bindings import (
    has_inference_bindings,
    inference_bindings,
    inference_slots,
    is_active,
)
from haru_core._states import PROMOTABLE_DOMAIN_STATES
from haru_core._time import elapsed_since, require_aware

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_STATE_RANK = {DomainState.READY: 0, DomainState.DEGRADED: 1}
_NOT_RANKED = len(_STATE_RANK)


@dataclass(frozen=True, slots=True)
class FailoverDecision:
    """Promote ``target_domain_id`` because the active domain failed or went stale."""

    target_domain_id: UUID
    reason: Literal["active_failed", "active_stale"]
    active_domain_id: UUID
    """The domain that was active when the decision was taken."""


def is_stale(domain: DomainSnapshot, *, now: datetime, heartbeat_stale_ms: int) -> bool:
    """Whether the last heartbeat of ``domain`` is older than ``heartbeat_stale_ms``.

    A domain that was never seen is NOT stale: its supervisor may simply not have been polled
    yet, and failing over away from it would be a guess. A ``lastSeenAt`` after ``now``
    counts as ``now`` (:func:`clamp_to_now`).
    """
    require_aware("now", now)
    if domain.last_seen_at is None:
        return False
    stale = timedelta(milliseconds=heartbeat_stale_ms)
    return elapsed_since(domain.last_seen_at, now=now) > stale


def is_viable_standby(fleet: FleetSnapshot, domain: DomainSnapshot, *, now: datetime) -> bool:
    """Whether ``domain`` is a standby known to be healthy enough to take over right now.

    Viable: not the active, state ready, a supervisor URL that accepts the server's token,
    seen within the policy's ``heartbeatStaleMs``, at least one inference slot, and no
    inference slot failed.
    """
    require_aware("now", now)
    slots = inference_slots(domain)
    return (
        not is_active(fleet, domain)
        and domain.state is DomainState.READY
        and not domain.auth_failing
        and domain.supervisor_url is not None
        and domain.last_seen_at is not None
        and not is_stale(domain, now=now, heartbeat_stale_ms=fleet.policy.heartbeat_stale_ms)
        and bool(slots)
        and all(s.state is not InferenceSlotState.FAILED for s in slots)
    )


def _rank_key(domain: DomainSnapshot) -> tuple[int, int, timedelta, str, str]:
    # Newer heartbeats first: a larger distance before the epoch sorts first. timedelta keys
    # compare exactly (float timestamps could tie or misorder at microsecond resolution).
    if domain.last_seen_at is None:
        seen_rank, recency = 1, timedelta(0)
    else:
        seen_rank, recency = 0, _EPOCH - domain.last_seen_at
    # Slugs are unique per fleet; the id only keeps the order total on malformed input.
    return (
        _STATE_RANK.get(domain.state, _NOT_RANKED),
        seen_rank,
        recency,
        domain.slug,
        str(domain.id),
    )


def rank_standbys(fleet: FleetSnapshot) -> tuple[DomainSnapshot, ...]:
    """Every standby of ``fleet``, best candidate first.

    Order: state ready, then degraded, then any other state; then the most recent
    ``lastSeenAt`` (never seen last); then slug by code point (never locale). The order is total
    and does not depend on the order of ``fleet.domains``.
    """
    return tuple(sorted((d for d in fleet.domains if not is_active(fleet, d)), key=_rank_key))


def _is_fallback_candidate(domain: DomainSnapshot) -> bool:
    return (
        domain.state in PROMOTABLE_DOMAIN_STATES
        and not domain.auth_failing
        and domain.supervisor_url is not None
        and has_inference_bindings(domain)
    )


def detect_failover(
    fleet: FleetSnapshot, *, now: datetime, answered: frozenset[UUID] = frozenset()
) -> FailoverDecision | None:
    """Decide an automatic failover (SPEC 7.3 step 2).

    Needs ``autoFailover`` on and an active domain that is failed or stale. An active whose
    supervisor refuses the server's token (``authFailing``) is never stale: a configuration
    error is no evidence that it is down. Neither is an active in ``answered``, the domains
    whose supervisors answered the caller's own heartbeat round of this tick: their
    ``lastSeenAt`` can lag ``now`` only because the caller was slow (a store write that waited
    out a lock, a stalled event loop), which is no evidence either.

    The target is the first viable standby of :func:`rank_standbys`, else the first ranked
    standby that is ready or degraded, has a supervisor URL that accepts the token and has
    inference bindings; a standby whose promotions are backing off (``promotionBackoffUntil``
    after ``now``) is skipped. The caller checks that no operation is in flight.

    Returns:
        The decision, or None when no failover is due or no standby could take over.
    """
    require_aware("now", now)
    if not fleet.policy.auto_failover:
        return None
    active = fleet.active_domain
    if active is None:
        return None
    reason: Literal["active_failed", "active_stale"]
    if active.state is DomainState.FAILED:
        reason = "active_failed"
    elif (
        not active.auth_failing
        and active.id not in answered
        and is_stale(active, now=now, heartbeat_stale_ms=fleet.policy.heartbeat_stale_ms)
    ):
        reason = "active_stale"
    else:
        return None
    ranked = tuple(
        d for d in rank_standbys(fleet) if not in_backoff(d.promotion_backoff_until, now=now)
    )
    target = next((d for d in ranked if is_viable_standby(fleet, d, now=now)), None)
    if target is None:
        target = next((d for d in ranked if _is_fallback_candidate(d)), None)
    if target is None:
        return None
    return FailoverDecision(target_domain_id=target.id, reason=reason, active_domain_id=active.id)


def detect_degraded_escalation(fleet: FleetSnapshot, *, now: datetime) -> UUID | None:
    """The id of an active domain that stayed degraded past ``degradedGraceMs``, if any.

    Escalation (degraded to failed) needs ``autoFailover`` on, the active degraded for strictly
    longer than the grace since its ``stateUpdatedAt``, and a viable standby to fail over to:
    without one (a standby backing off does not count), failing the active would only stop the
    traffic it still serves. An active
    whose supervisor refuses the server's token is never escalated: nothing can be judged.
    """
    require_aware("now", now)
    if not fleet.policy.auto_failover:
        return None
    active = fleet.active_domain
    if active is None or active.state is not DomainState.DEGRADED or active.auth_failing:
        return None
    grace = timedelta(milliseconds=fleet.policy.degraded_grace_ms)
    if elapsed_since(active.state_updated_at, now=now) <= grace:
        return None
    if not any(
        is_viable_standby(fleet, d, now=now) and not in_backoff(d.promotion_backoff_until, now=now)
        for d in fleet.domains
    ):
        return None
    return active.id


def active_proven_dead(
    fleet: FleetSnapshot, domain: DomainSnapshot, status: SupervisorStatus
) -> tuple[str, ...]:
    """The active's bound models, when its supervisor's answer proves them ALL dead.

    Proof: every model the layout binds to ``domain`` (the active) is reported ``down`` (its
    server refused the connection) with no sleep or wake under way, and no report of the same
    name says otherwise. One model of several down while the others answer is no proof: the
    others still serve, and failing over would cost the standby's training for a partial loss
    (the grace decides it). A timeout or an error answer is never ``down``.

    Returns:
        The dead models in layout order, or an empty tuple when nothing is proven.
    """
    if not is_active(fleet, domain):
        return ()
    names = tuple(dict.fromkeys(b.name for b in inference_bindings(domain)))
    if not names:
        return ()
    down: dict[str, bool] = {}
    for slot in status.slots:
        for model in slot.models or ():
            proven = model.down and model.action is None
            down[model.name] = down.get(model.name, True) and proven
    return names if all(down.get(name, False) for name in names) else ()


def dead_since(previous: datetime | None, *, proven: bool, now: datetime) -> datetime | None:
    """When the unbroken run of heartbeats proving the active dead began (None: no run).

    A heartbeat that proves it keeps ``previous`` (or starts the run at ``now``); any other
    answer, or none, ends the run: a server back within the confirmation interval is alive.
    """
    require_aware("now", now)
    if not proven:
        return None
    return previous if previous is not None else now


def detect_dead_active(
    fleet: FleetSnapshot, *, now: datetime, since: datetime | None
) -> UUID | None:
    """The id of an active domain proven dead long enough to fail now, without the grace.

    ``since``: when the caller's unbroken run of heartbeats proving the active dead began
    (:func:`dead_since`). Needs ``autoFailover`` on, the active ``degraded`` (the first proof
    degraded it) and not refusing the token, the run at least ``deadConfirmMs`` old, and a
    viable standby that is not backing off: without one, failing the active changes nothing
    but its state, and the grace path keeps the same guard.
    """
    require_aware("now", now)
    if since is None or not fleet.policy.auto_failover:
        return None
    active = fleet.active_domain
    if active is None or active.state is not DomainState.DEGRADED or active.auth_failing:
        return None
    if now - since < timedelta(milliseconds=fleet.policy.dead_confirm_ms):
        return None
    if not any(
        is_viable_standby(fleet, d, now=now) and not in_backoff(d.promotion_backoff_until, now=now)
        for d in fleet.domains
    ):
        return None
    return active.id


def awaiting_confirmation(fleet: FleetSnapshot, *, now: datetime, since: datetime | None) -> bool:
    """Whether a fresh heartbeat soon could confirm the active dead (come back quickly).

    True while a run of proofs (``since``) is younger than ``deadConfirmMs`` and
    ``autoFailover`` is on. Past that, a run that did not fail the active (no viable standby,
    say) waits for the regular ticks: a dead vLLM never makes the server poll its fleet at
    the busy pace for long.
    """
    require_aware("now", now)
    if since is None or not fleet.policy.auto_failover:
        return False
    return now - since < timedelta(milliseconds=fleet.policy.dead_confirm_ms)


def server_partitioned(polled: Collection[UUID], reached: Collection[UUID]) -> bool:
    """Whether a heartbeat round says more about the server's network than the fleet's.

    True when at least two domains were polled and not one supervisor was reached (an answer
    or a token refusal both count as reached). From there, every domain lost together and the
    server cut off look the same; the server takes it as its own partition and judges no
    domain, fails nothing and fails nothing over until a supervisor answers again.
    """
    return len(set(polled)) >= 2 and not set(polled) & set(reached)
