"""Staleness, viability, standby ranking, failover detection and degraded escalation."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

import pytest
from haru_core import (
    FailoverDecision,
    detect_degraded_escalation,
    detect_failover,
    is_stale,
    is_viable_standby,
    rank_standbys,
)
from haru_protocol import DomainSnapshot, DomainState, FleetSnapshot, InferenceSlotState, Policy

if TYPE_CHECKING:
    from conftest import FleetFactory

STALE_MS = 30_000
AUTO = Policy(auto_failover=True, heartbeat_stale_ms=STALE_MS, degraded_grace_ms=60_000)


def ago(make: FleetFactory, ms: int) -> datetime:
    return make.now - timedelta(milliseconds=ms)


# ---- staleness ----


def test_never_seen_is_not_stale(make: FleetFactory) -> None:
    domain = make.domain("alpha", last_seen_at=None)
    assert not is_stale(domain, now=make.now, heartbeat_stale_ms=1)


@pytest.mark.parametrize(
    ("age_ms", "stale"),
    [(0, False), (29_999, False), (30_000, False), (30_001, True), (3_600_000, True)],
)
def test_stale_boundary(make: FleetFactory, age_ms: int, stale: bool) -> None:
    domain = make.domain("alpha", last_seen_at=ago(make, age_ms))
    assert is_stale(domain, now=make.now, heartbeat_stale_ms=STALE_MS) is stale


def test_seen_in_the_future_is_not_stale(make: FleetFactory) -> None:
    domain = make.domain("alpha", last_seen_at=make.now + timedelta(seconds=5))
    assert not is_stale(domain, now=make.now, heartbeat_stale_ms=STALE_MS)


def test_naive_now_rejected(make: FleetFactory) -> None:
    naive = datetime(2026, 3, 1)  # noqa: DTZ001 -- the point of the test
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"), active="alpha", policy=AUTO)
    with pytest.raises(ValueError, match="timezone"):
        is_stale(fleet.domains[0], now=naive, heartbeat_stale_ms=1)
    with pytest.raises(ValueError, match="timezone"):
        is_viable_standby(fleet, fleet.domains[1], now=naive)
    with pytest.raises(ValueError, match="timezone"):
        detect_failover(fleet, now=naive)
    with pytest.raises(ValueError, match="timezone"):
        detect_degraded_escalation(fleet, now=naive)


# ---- viability ----


def test_viable_standby(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha"),
        make.domain(
            "beta", slots=[make.inference(0, state=InferenceSlotState.SLEEPING), make.training(0)]
        ),
        active="alpha",
        policy=AUTO,
    )
    assert is_viable_standby(fleet, fleet.domains[1], now=make.now)
    # The active itself is never a viable standby.
    assert not is_viable_standby(fleet, fleet.domains[0], now=make.now)


@pytest.mark.parametrize(
    "breaks",
    [
        "degraded",
        "provisioning",
        "failed",
        "no_supervisor",
        "never_seen",
        "stale",
        "no_inference_slot",
        "failed_slot",
    ],
)
def test_not_viable(make: FleetFactory, breaks: str) -> None:
    sleeping = InferenceSlotState.SLEEPING
    slots = [make.inference(0, state=sleeping), make.inference(1, state=sleeping)]
    if breaks == "no_inference_slot":
        slots = [make.training(0)]
    if breaks == "failed_slot":
        slots = [
            make.inference(0, state=sleeping),
            make.inference(1, state=InferenceSlotState.FAILED),
        ]
    beta = make.domain(
        "beta",
        slots=slots,
        state=DomainState(breaks)
        if breaks in {"degraded", "provisioning", "failed"}
        else DomainState.READY,
        supervisor=breaks != "no_supervisor",
        last_seen_at={"never_seen": None, "stale": ago(make, STALE_MS + 1)}.get(breaks, make.now),
    )
    fleet = make.fleet(make.domain("alpha"), beta, active="alpha", policy=AUTO)
    assert not is_viable_standby(fleet, beta, now=make.now)


def test_viable_at_stale_boundary(make: FleetFactory) -> None:
    beta = make.domain("beta", last_seen_at=ago(make, STALE_MS))
    fleet = make.fleet(make.domain("alpha"), beta, active="alpha", policy=AUTO)
    assert is_viable_standby(fleet, beta, now=make.now)


# ---- ranking ----


def slugs(domains: tuple[DomainSnapshot, ...]) -> list[str]:
    return [d.slug for d in domains]


def test_rank_by_state_then_recency_then_slug(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("active"),
        make.domain("f-old", state=DomainState.FAILED, last_seen_at=ago(make, 5)),
        make.domain("d-new", state=DomainState.DEGRADED, last_seen_at=ago(make, 1)),
        make.domain("r-never", last_seen_at=None),
        make.domain("r-old", last_seen_at=ago(make, 10_000)),
        make.domain("r-new", last_seen_at=ago(make, 10)),
        make.domain("p-new", state=DomainState.PROVISIONING, last_seen_at=make.now),
        make.domain("d-never", state=DomainState.DEGRADED, last_seen_at=None),
        active="active",
    )
    assert slugs(rank_standbys(fleet)) == [
        "r-new",
        "r-old",
        "r-never",
        "d-new",
        "d-never",
        "p-new",
        "f-old",
    ]


def test_rank_other_states_share_one_tier(make: FleetFactory) -> None:
    # provisioning, failed, stopping and stopped are "the rest": only recency and slug order them.
    fleet = make.fleet(
        make.domain("a-stopped", state=DomainState.STOPPED, last_seen_at=ago(make, 30)),
        make.domain("b-failed", state=DomainState.FAILED, last_seen_at=ago(make, 20)),
        make.domain("c-stopping", state=DomainState.STOPPING, last_seen_at=ago(make, 10)),
        make.domain("d-prov", state=DomainState.PROVISIONING, last_seen_at=ago(make, 20)),
    )
    assert slugs(rank_standbys(fleet)) == ["c-stopping", "b-failed", "d-prov", "a-stopped"]


def test_rank_microsecond_recency(make: FleetFactory) -> None:
    earlier = make.now - timedelta(microseconds=1)
    fleet = make.fleet(
        make.domain("aaa", last_seen_at=earlier),
        make.domain("zzz", last_seen_at=make.now),
    )
    assert slugs(rank_standbys(fleet)) == ["zzz", "aaa"]


def test_rank_recency_across_offsets(make: FleetFactory) -> None:
    tokyo = timezone(timedelta(hours=9))
    # Same wall clock digits would mislead: compare instants, not local times.
    fleet = make.fleet(
        make.domain("aaa", last_seen_at=ago(make, 1000).astimezone(tokyo)),
        make.domain("bbb", last_seen_at=ago(make, 10)),
    )
    assert slugs(rank_standbys(fleet)) == ["bbb", "aaa"]


def test_rank_slug_by_code_point(make: FleetFactory) -> None:
    # Code point order: "-" (0x2d) < digits (0x30-0x39) < letters. A locale-aware or
    # "natural" sort would put "a10" after "a9" or ignore the hyphen.
    names = ["b", "a9", "a-1", "a10", "a1", "aa", "0z", "a"]
    fleet = make.fleet(*(make.domain(n, last_seen_at=None) for n in names))
    assert slugs(rank_standbys(fleet)) == ["0z", "a", "a-1", "a1", "a10", "a9", "aa", "b"]


def test_rank_excludes_the_active(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"), active="beta")
    assert slugs(rank_standbys(fleet)) == ["alpha"]
    assert slugs(rank_standbys(make.fleet(make.domain("alpha"), active="alpha"))) == []


# ---- failover ----


def test_failover_on_failed_active(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        make.domain("beta", slots=[make.inference(0, state=InferenceSlotState.SLEEPING)]),
        active="alpha",
        policy=AUTO,
    )
    assert detect_failover(fleet, now=make.now) == FailoverDecision(
        target_domain_id=make.domain_id("beta"),
        reason="active_failed",
        active_domain_id=make.domain_id("alpha"),
    )


def test_failover_on_stale_active(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", last_seen_at=ago(make, STALE_MS + 1)),
        make.domain("beta"),
        active="alpha",
        policy=AUTO,
    )
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.reason == "active_stale"
    assert decision.target_domain_id == make.domain_id("beta")


def test_an_active_that_answered_this_tick_is_not_stale(make: FleetFactory) -> None:
    # Its recorded heartbeat lags because the caller was slow to record it (sqlite-single:506).
    fleet = make.fleet(
        make.domain("alpha", last_seen_at=ago(make, STALE_MS + 1)),
        make.domain("beta"),
        active="alpha",
        policy=AUTO,
    )
    answered = frozenset({make.domain_id("alpha")})
    assert detect_failover(fleet, now=make.now, answered=answered) is None
    # Another domain's answer says nothing about the active.
    others = frozenset({make.domain_id("beta")})
    decision = detect_failover(fleet, now=make.now, answered=others)
    assert decision is not None
    assert decision.reason == "active_stale"


def test_an_answer_does_not_excuse_a_failed_active(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        make.domain("beta"),
        active="alpha",
        policy=AUTO,
    )
    decision = detect_failover(fleet, now=make.now, answered=frozenset({make.domain_id("alpha")}))
    assert decision is not None
    assert decision.reason == "active_failed"


def test_failed_wins_over_stale_as_reason(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED, last_seen_at=ago(make, STALE_MS + 1)),
        make.domain("beta"),
        active="alpha",
        policy=AUTO,
    )
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.reason == "active_failed"


@pytest.mark.parametrize(
    "last_seen_ms", [None, 0, STALE_MS], ids=["never-seen", "fresh", "at-threshold"]
)
def test_no_failover_for_healthy_or_never_seen_active(
    make: FleetFactory, last_seen_ms: int | None
) -> None:
    seen = None if last_seen_ms is None else ago(make, last_seen_ms)
    fleet = make.fleet(
        make.domain("alpha", last_seen_at=seen), make.domain("beta"), active="alpha", policy=AUTO
    )
    assert detect_failover(fleet, now=make.now) is None


@pytest.mark.parametrize("state", [DomainState.DEGRADED, DomainState.PROVISIONING])
def test_no_failover_for_other_active_states(make: FleetFactory, state: DomainState) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=state), make.domain("beta"), active="alpha", policy=AUTO
    )
    assert detect_failover(fleet, now=make.now) is None


def test_no_failover_when_auto_failover_off(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        make.domain("beta"),
        active="alpha",
        policy=Policy(auto_failover=False),
    )
    assert detect_failover(fleet, now=make.now) is None


def test_no_failover_without_active(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"), policy=AUTO)
    assert detect_failover(fleet, now=make.now) is None


def test_failover_prefers_viable_over_better_ranked(make: FleetFactory) -> None:
    # The first ranked standby is promotable but not viable; the second is viable.
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        # Ranks first (ready, newest heartbeat) but a failed inference slot makes it non-viable.
        make.domain(
            "b-broken",
            last_seen_at=make.now,
            slots=[make.inference(0, state=InferenceSlotState.FAILED)],
        ),
        # Ranks second and is viable.
        make.domain("c-good", last_seen_at=ago(make, 1_000)),
        active="alpha",
        policy=AUTO,
    )
    assert slugs(rank_standbys(fleet)) == ["b-broken", "c-good"]
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.target_domain_id == make.domain_id("c-good")


def test_failover_falls_back_to_promotable_candidate(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        make.domain("b-failed", state=DomainState.FAILED),
        make.domain("c-nosup", state=DomainState.DEGRADED, supervisor=False),
        make.domain("d-nobind", state=DomainState.DEGRADED, slots=[make.training(0)]),
        make.domain("e-degraded", state=DomainState.DEGRADED, last_seen_at=ago(make, 5_000)),
        make.domain("f-stale", state=DomainState.DEGRADED, last_seen_at=ago(make, 999_000)),
        active="alpha",
        policy=AUTO,
    )
    assert not any(is_viable_standby(fleet, d, now=make.now) for d in fleet.domains)
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.target_domain_id == make.domain_id("e-degraded")


def test_failover_fallback_accepts_stale_ready_standby(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        make.domain("beta", last_seen_at=None),
        active="alpha",
        policy=AUTO,
    )
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.target_domain_id == make.domain_id("beta")


def test_no_failover_without_candidate(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED),
        make.domain("b-failed", state=DomainState.FAILED),
        make.domain("c-nosup", supervisor=False),
        make.domain("d-nobind", slots=[make.training(0)]),
        make.domain("e-prov", state=DomainState.PROVISIONING),
        active="alpha",
        policy=AUTO,
    )
    assert detect_failover(fleet, now=make.now) is None


def test_no_failover_in_single_domain_fleet(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha", state=DomainState.FAILED), active="alpha", policy=AUTO)
    assert detect_failover(fleet, now=make.now) is None


# ---- degraded escalation ----


def escalation_fleet(
    make: FleetFactory,
    *,
    degraded_for_ms: int,
    state: DomainState = DomainState.DEGRADED,
    policy: Policy = AUTO,
    standby_viable: bool = True,
) -> FleetSnapshot:
    return make.fleet(
        make.domain("alpha", state=state, state_updated_at=ago(make, degraded_for_ms)),
        make.domain("beta", last_seen_at=make.now if standby_viable else None),
        active="alpha",
        policy=policy,
    )


@pytest.mark.parametrize(
    ("degraded_for_ms", "escalates"),
    [(0, False), (59_999, False), (60_000, False), (60_001, True), (600_000, True)],
)
def test_escalation_grace_boundary(
    make: FleetFactory, degraded_for_ms: int, escalates: bool
) -> None:
    fleet = escalation_fleet(make, degraded_for_ms=degraded_for_ms)
    expected = make.domain_id("alpha") if escalates else None
    assert detect_degraded_escalation(fleet, now=make.now) == expected


def test_escalation_needs_auto_failover(make: FleetFactory) -> None:
    fleet = escalation_fleet(make, degraded_for_ms=600_000, policy=Policy())
    assert detect_degraded_escalation(fleet, now=make.now) is None


def test_escalation_needs_viable_standby(make: FleetFactory) -> None:
    fleet = escalation_fleet(make, degraded_for_ms=600_000, standby_viable=False)
    assert detect_degraded_escalation(fleet, now=make.now) is None


@pytest.mark.parametrize(
    "state", [s for s in DomainState if s is not DomainState.DEGRADED], ids=str
)
def test_escalation_only_for_degraded_active(make: FleetFactory, state: DomainState) -> None:
    fleet = escalation_fleet(make, degraded_for_ms=600_000, state=state)
    assert detect_degraded_escalation(fleet, now=make.now) is None


def test_escalation_ignores_degraded_standby(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha"),
        make.domain("beta", state=DomainState.DEGRADED, state_updated_at=ago(make, 600_000)),
        make.domain("gamma"),
        active="alpha",
        policy=AUTO,
    )
    assert detect_degraded_escalation(fleet, now=make.now) is None
    assert detect_degraded_escalation(make.fleet(*fleet.domains, policy=AUTO), now=make.now) is None


def test_escalation_custom_grace(make: FleetFactory) -> None:
    policy = Policy(auto_failover=True, degraded_grace_ms=1_000)
    fleet = escalation_fleet(make, degraded_for_ms=1_001, policy=policy)
    assert detect_degraded_escalation(fleet, now=make.now) == make.domain_id("alpha")


# ---- supervisor auth failures and promotion backoff ----


def test_auth_failing_active_is_never_stale(make: FleetFactory) -> None:
    # A rotated token made the active's heartbeats 401: no evidence it is down.
    alpha = make.domain("alpha", last_seen_at=ago(make, STALE_MS * 10))
    alpha = alpha.model_copy(update={"auth_failing": True})
    fleet = make.fleet(alpha, make.domain("beta"), active="alpha", policy=AUTO)
    assert detect_failover(fleet, now=make.now) is None


def test_auth_failing_active_still_fails_over_when_failed(make: FleetFactory) -> None:
    # Failed is a verdict other evidence reached (e.g. before the token broke).
    alpha = make.domain("alpha", state=DomainState.FAILED).model_copy(update={"auth_failing": True})
    fleet = make.fleet(alpha, make.domain("beta"), active="alpha", policy=AUTO)
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.reason == "active_failed"


def test_auth_failing_standby_is_no_target(make: FleetFactory) -> None:
    beta = make.domain("beta").model_copy(update={"auth_failing": True})
    assert not is_viable_standby(
        make.fleet(make.domain("alpha"), beta, active="alpha"), beta, now=make.now
    )
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED), beta, active="alpha", policy=AUTO
    )
    assert detect_failover(fleet, now=make.now) is None


def test_auth_failing_active_is_never_escalated(make: FleetFactory) -> None:
    fleet = escalation_fleet(make, degraded_for_ms=600_000)
    alpha = fleet.domains[0].model_copy(update={"auth_failing": True})
    fleet = fleet.model_copy(update={"domains": (alpha, fleet.domains[1])})
    assert detect_degraded_escalation(fleet, now=make.now) is None


@pytest.mark.parametrize(
    ("until_ms", "skipped"), [(1, True), (60_000, True), (0, False), (-1, False)]
)
def test_failover_skips_a_standby_in_backoff(
    make: FleetFactory, until_ms: int, skipped: bool
) -> None:
    beta = make.domain("beta").model_copy(
        update={"promotion_backoff_until": make.now + timedelta(milliseconds=until_ms)}
    )
    gamma = make.domain("gamma", last_seen_at=ago(make, 1_000))
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED), beta, gamma, active="alpha", policy=AUTO
    )
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.target_domain_id == make.domain_id("gamma" if skipped else "beta")


def test_no_failover_while_every_standby_backs_off(make: FleetFactory) -> None:
    beta = make.domain("beta").model_copy(
        update={"promotion_backoff_until": make.now + timedelta(seconds=30)}
    )
    fleet = make.fleet(
        make.domain("alpha", state=DomainState.FAILED), beta, active="alpha", policy=AUTO
    )
    assert detect_failover(fleet, now=make.now) is None
    # ... and a degraded active is not escalated to failed for a standby that cannot take over.
    degraded = escalation_fleet(make, degraded_for_ms=600_000)
    standby = degraded.domains[1].model_copy(
        update={"promotion_backoff_until": make.now + timedelta(seconds=30)}
    )
    degraded = degraded.model_copy(update={"domains": (degraded.domains[0], standby)})
    assert detect_degraded_escalation(degraded, now=make.now) is None
