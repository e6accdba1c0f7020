"""Standby ranking, failover detection and degraded escalation (DESIGN 7.3 step 2, 7.4).

Evidence about the active comes in two strengths. Strong, of two kinds: its supervisor
answers and every model the layout binds to the active refuses connections (nothing listens
on the port: the vLLM process is gone; :func:`active_proven_dead`), or its supervisor AND
every serving endpoint of the active refuse the connection or have no route while another
domain of the fleet answers (the host is gone; :func:`host_unreachable`). Once a later
observation, at least ``deadConfirmMs`` after the first, still proves it, the active fails at
once (:func:`detect_dead_active`). Weak: anything else (an unanswered or slow heartbeat, a
connect that times out, a TLS failure, error answers, one model of several down while the
others serve, the proxies' failed connects on their own; :func:`weak_evidence`) keeps the
``degradedGraceMs`` grace and the ``heartbeatStaleMs`` staleness. A server that reaches no
domain of a fleet judges nothing (:func:`server_partitioned`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
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
    """Decide an automatic failover (DESIGN 7.3 step 2).

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


class Reach(StrEnum):
    """How one connection attempt to a domain (its supervisor, a serving endpoint) ended."""

    ANSWERED = "answered"
    """Connected; whatever came back (an error status included) came from the host."""
    REFUSED = "refused"
    """The host answered the connect with a reset: nothing listens on the port."""
    NO_ROUTE = "no_route"
    """No route to the host, or the host or its network is unreachable (ICMP)."""
    CONNECT_TIMEOUT = "connect_timeout"
    """No answer to the connect at all within the bound (dropped packets, a silent host)."""
    SLOW = "slow"
    """Connected, but no answer within the bound."""
    BROKEN = "broken"
    """Anything else: TLS refused or failed, a reset after connecting, an unusable answer."""


UNREACHABLE: frozenset[Reach] = frozenset({Reach.REFUSED, Reach.NO_ROUTE})
"""The outcomes that count as strong evidence a host is gone.

A connect timeout is not among them: packet loss and a congested link look the same for as
long as the bound, and a host that drops packets silently waits ``heartbeatStaleMs``."""


def serving_endpoints(domain: DomainSnapshot) -> tuple[tuple[str, int], ...]:
    """The ``(host, port)`` of every serving endpoint of ``domain``, in layout order, once.

    Each model binding's ``servingUrl`` and the domain's ``servingBaseUrl``: what the proxy
    connects to. A URL without a host is left out.
    """
    urls = [b.serving_url for b in inference_bindings(domain) if b.serving_url is not None]
    if domain.serving_base_url is not None:
        urls.append(domain.serving_base_url)
    found: dict[tuple[str, int], None] = {}
    for url in urls:
        endpoint = _host_port(url)
        if endpoint is not None:
            found[endpoint] = None
    return tuple(found)


def _host_port(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of an ``http(s)://`` URL (already validated).

    The scheme's default port when none is given; an IPv6 literal comes back bare.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rpartition("@")[2]
    default = 443 if scheme.lower() == "https" else 80
    if authority.startswith("["):
        host, _, tail = authority[1:].partition("]")
        port_text = tail.removeprefix(":")
    else:
        host, colon, port_text = authority.rpartition(":")
        if not colon:
            host, port_text = authority, ""
    if not host:
        return None
    if not port_text:
        return host, default
    return (host, int(port_text)) if port_text.isdigit() else None


def check_endpoints(
    fleet: FleetSnapshot,
    domain: DomainSnapshot,
    *,
    supervisor: Reach | None,
    reached: Collection[UUID],
) -> bool:
    """Whether the caller should connect to the active's serving endpoints now.

    Only when ``domain`` is the active, its supervisor refused the heartbeat's connection or
    had no route (``supervisor``), and another domain of the fleet was reached this round
    (``reached``): otherwise the answer could not make the evidence strong, and a server that
    lost its own network would only pile up connects.
    """
    return (
        is_active(fleet, domain)
        and supervisor in UNREACHABLE
        and bool(serving_endpoints(domain))
        and any(d != domain.id for d in reached)
    )


def host_unreachable(
    fleet: FleetSnapshot,
    domain: DomainSnapshot,
    *,
    supervisor: Reach | None,
    endpoints: Mapping[tuple[str, int], Reach],
    reached: Collection[UUID],
) -> bool:
    """Whether one observation proves the active's host gone (strong evidence).

    Proof: :func:`check_endpoints` holds, and every serving endpoint of the active
    (:func:`serving_endpoints`) refused the connection or had no route in ``endpoints``. One
    endpoint that connects (even slowly), times out or was not checked is no proof.
    """
    if not check_endpoints(fleet, domain, supervisor=supervisor, reached=reached):
        return False
    return all(endpoints.get(e) in UNREACHABLE for e in serving_endpoints(domain))


def proxy_connect_failed(domain: DomainSnapshot, *, now: datetime, window_ms: int) -> bool:
    """Whether a proxy recorded a refused connect to ``domain`` within ``window_ms`` of ``now``.

    Corroboration and a reason to look again at once; never proof on its own (a proxy's
    network, or one endpoint among several, may be the one at fault).
    """
    require_aware("now", now)
    failed = domain.connect_failed_at
    if failed is None:
        return False
    return elapsed_since(failed, now=now) <= timedelta(milliseconds=window_ms)


def proxy_kick(
    domain: DomainSnapshot, *, seen: datetime | None, now: datetime, window_ms: int
) -> bool:
    """Whether a proxy's record is new to the caller and recent: worth a fresh heartbeat now.

    ``seen``: the newest ``connectFailedAt`` of ``domain`` the caller already acted on.
    """
    failed = domain.connect_failed_at
    if failed is None or not proxy_connect_failed(domain, now=now, window_ms=window_ms):
        return False
    return seen is None or failed > seen


WeakEvidence = Literal[
    "heartbeat_unreachable",
    "heartbeat_timeout",
    "heartbeat_error",
    "partial_models_down",
    "proxy_connect_failed",
]


def weak_evidence(
    fleet: FleetSnapshot,
    domain: DomainSnapshot,
    *,
    status: SupervisorStatus | None,
    supervisor: Reach | None,
    proxy_failed: bool,
    proven: bool,
) -> WeakEvidence | None:
    """What ``domain`` (the active) showed that is NOT enough to fail it fast, if anything.

    ``status``: its supervisor's answer (None: none); ``supervisor``: how the heartbeat's
    connection ended; ``proxy_failed``: :func:`proxy_connect_failed`; ``proven``: this
    observation is strong evidence (then nothing is weak). Weak evidence keeps the grace and
    the staleness; callers count it so that a blip is visible without a failover.
    """
    if proven or not is_active(fleet, domain):
        return None
    if status is None:
        if supervisor in (Reach.SLOW, Reach.CONNECT_TIMEOUT):
            return "heartbeat_timeout"
        if supervisor in UNREACHABLE:
            return "heartbeat_unreachable"
        return "heartbeat_error"
    names = {b.name for b in inference_bindings(domain)}
    down = {
        model.name
        for slot in status.slots
        for model in slot.models or ()
        if model.name in names and model.down
    }
    if down:
        return "partial_models_down"
    if proxy_failed:
        return "proxy_connect_failed"
    return None
