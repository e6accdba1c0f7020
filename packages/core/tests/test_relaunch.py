"""Relaunch of a lost provisioned domain: the streak folded from events, the backoff, the plan."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from haru_core import (
    RELAUNCH_STREAK_EVENTS,
    RelaunchesSpent,
    RelaunchPlan,
    RelaunchStreak,
    fold_relaunch_streak,
    plan_relaunch,
    relaunch_backoff_ms,
)
from haru_protocol import (
    MAX_DURATION_MS,
    AnyEventPayload,
    DomainLaunchStarted,
    DomainRelaunch,
    DomainState,
    DomainStateChanged,
    DomainUpRequested,
    Policy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

FAILED_AT = datetime(2030, 1, 1, tzinfo=UTC)
POLICY = Policy(
    relaunch_max_attempts=3, relaunch_backoff_base_ms=1_000, relaunch_backoff_max_ms=5_000
)
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, database=None)


def relaunch(n: int, *, exhausted: bool = False) -> DomainRelaunch:
    return DomainRelaunch(
        cluster="c", relaunch=n, max_attempts=3, backoff_ms=0, exhausted=exhausted
    )


def changed(to: DomainState, frm: DomainState = DomainState.FAILED) -> DomainStateChanged:
    return DomainStateChanged(from_state=frm, to_state=to)


UP = DomainUpRequested(from_state=DomainState.FAILED)
READY = changed(DomainState.READY, DomainState.PROVISIONING)


def test_streak_events_are_the_relaunch_and_its_two_beginnings() -> None:
    assert {t.value for t in RELAUNCH_STREAK_EVENTS} == {
        "domain.relaunch",
        "domain.state.changed",
        "domain.up.requested",
    }


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], RelaunchStreak()),
        ([relaunch(2), relaunch(1)], RelaunchStreak(2)),
        ([relaunch(2), relaunch(1), READY, relaunch(1)], RelaunchStreak(2, complete=True)),
        ([relaunch(1), UP, relaunch(3), relaunch(2)], RelaunchStreak(1, complete=True)),
        # Giving up is said, not counted.
        ([relaunch(3, exhausted=True), relaunch(3), relaunch(2)], RelaunchStreak(2, True)),
        # Only a move to `ready` ends it; failing, provisioning and other events do not.
        (
            [
                changed(DomainState.FAILED, DomainState.PROVISIONING),
                changed(DomainState.PROVISIONING),
                relaunch(1),
                DomainLaunchStarted(cluster="c", attempt=2, role="active"),
                changed(DomainState.DEGRADED, DomainState.PROVISIONING),
            ],
            RelaunchStreak(1),
        ),
        ([READY], RelaunchStreak(complete=True)),
    ],
)
def test_fold(events: list[AnyEventPayload], expected: RelaunchStreak) -> None:
    assert fold_relaunch_streak(events) == expected


def test_a_complete_streak_takes_no_older_events() -> None:
    done = RelaunchStreak(1, complete=True)
    assert fold_relaunch_streak([relaunch(5), relaunch(4)], done) is done


@pytest.mark.parametrize(
    ("relaunches", "delay_ms"),
    [(0, 1_000), (1, 2_000), (2, 4_000), (3, 5_000), (1_000, 5_000), (10**6, 5_000)],
)
def test_backoff_doubles_and_is_bounded(relaunches: int, delay_ms: int) -> None:
    assert relaunch_backoff_ms(POLICY, relaunches) == delay_ms


def test_backoff_of_the_default_policy() -> None:
    policy = Policy()
    assert relaunch_backoff_ms(policy, 0) == policy.relaunch_backoff_base_ms == 60_000
    assert relaunch_backoff_ms(policy, 4) == policy.relaunch_backoff_max_ms == 900_000


def test_backoff_needs_a_count() -> None:
    with pytest.raises(ValueError, match="negative"):
        relaunch_backoff_ms(POLICY, -1)


def test_a_failed_first_launch_is_the_operators_call() -> None:
    assert plan_relaunch(POLICY, RelaunchStreak(), launched=False, failed_at=FAILED_AT) is None


def test_a_failed_relaunch_stays_in_the_streak() -> None:
    plan = plan_relaunch(POLICY, RelaunchStreak(1), launched=False, failed_at=FAILED_AT)
    assert plan == RelaunchPlan(2, 2_000, FAILED_AT + timedelta(seconds=2))


def test_the_first_relaunch_after_a_loss() -> None:
    plan = plan_relaunch(POLICY, RelaunchStreak(), launched=True, failed_at=FAILED_AT)
    assert plan == RelaunchPlan(1, 1_000, FAILED_AT + timedelta(seconds=1))
    assert not plan.due(FAILED_AT + timedelta(milliseconds=999))
    assert plan.due(FAILED_AT + timedelta(seconds=1))


def test_spent_relaunches_are_announced_once() -> None:
    spent = plan_relaunch(POLICY, RelaunchStreak(3), launched=True, failed_at=FAILED_AT)
    assert spent == RelaunchesSpent(3, announce=True)
    said = plan_relaunch(POLICY, RelaunchStreak(3, True), launched=True, failed_at=FAILED_AT)
    assert said == RelaunchesSpent(3, announce=False)


def test_no_relaunch_at_all_when_the_policy_allows_none() -> None:
    policy = Policy(relaunch_max_attempts=0)
    spent = plan_relaunch(policy, RelaunchStreak(), launched=True, failed_at=FAILED_AT)
    assert spent == RelaunchesSpent(0, announce=True)


def test_times_must_be_aware() -> None:
    naive = datetime(2030, 1, 1)  # noqa: DTZ001 -- the point of the test
    with pytest.raises(ValueError, match="timezone-aware"):
        plan_relaunch(POLICY, RelaunchStreak(), launched=True, failed_at=naive)
    plan = plan_relaunch(POLICY, RelaunchStreak(), launched=True, failed_at=FAILED_AT)
    assert isinstance(plan, RelaunchPlan)
    with pytest.raises(ValueError, match="timezone-aware"):
        plan.due(naive)


# ---- properties ------------------------------------------------------------------------------

STATES = st.sampled_from(list(DomainState))
PAYLOADS: st.SearchStrategy[AnyEventPayload] = st.one_of(
    st.tuples(st.integers(1, 5), st.booleans()).map(lambda t: relaunch(t[0], exhausted=t[1])),
    st.tuples(STATES, STATES).map(lambda t: changed(t[1], t[0])),
    STATES.map(lambda s: DomainUpRequested(from_state=s)),
    st.integers(1, 5).map(lambda n: DomainLaunchStarted(cluster="c", attempt=n, role="standby")),
)
DURATIONS = st.integers(1, MAX_DURATION_MS)


def policies() -> st.SearchStrategy[Policy]:
    return st.tuples(st.integers(0, 20), DURATIONS, DURATIONS).map(
        lambda t: Policy(
            relaunch_max_attempts=t[0], relaunch_backoff_base_ms=t[1], relaunch_backoff_max_ms=t[2]
        )
    )


@PROPERTY_SETTINGS
@given(events=st.lists(PAYLOADS, max_size=30), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_folding_page_by_page_is_folding_at_once(
    events: list[AnyEventPayload], cuts: list[int]
) -> None:
    bounds = [0, *sorted(min(c, len(events)) for c in cuts), len(events)]
    streak = RelaunchStreak()
    for start, end in itertools.pairwise(bounds):
        streak = fold_relaunch_streak(events[start:end], streak)
    assert streak == fold_relaunch_streak(events)


@PROPERTY_SETTINGS
@given(events=st.lists(PAYLOADS, max_size=30))
def test_the_streak_counts_the_relaunches_since_it_began(events: list[AnyEventPayload]) -> None:
    began = next(
        (
            i
            for i, e in enumerate(events)
            if isinstance(e, DomainUpRequested)
            or (isinstance(e, DomainStateChanged) and e.to_state is DomainState.READY)
        ),
        None,
    )
    inside = events if began is None else events[:began]
    relaunches = [e for e in inside if isinstance(e, DomainRelaunch)]
    assert fold_relaunch_streak(events) == RelaunchStreak(
        relaunches=sum(not e.exhausted for e in relaunches),
        exhausted=any(e.exhausted for e in relaunches),
        complete=began is not None,
    )


@PROPERTY_SETTINGS
@given(policy=policies(), relaunches=st.integers(0, 200))
def test_backoff_is_the_bounded_doubling(policy: Policy, relaunches: int) -> None:
    delay = relaunch_backoff_ms(policy, relaunches)
    base, most = policy.relaunch_backoff_base_ms, policy.relaunch_backoff_max_ms
    assert delay == min(base * 2**relaunches, most)
    assert min(base, most) <= delay <= most
    assert relaunch_backoff_ms(policy, relaunches + 1) in (delay * 2, most)


@PROPERTY_SETTINGS
@given(
    policy=policies(),
    relaunches=st.integers(0, 30),
    exhausted=st.booleans(),
    launched=st.booleans(),
    after_ms=st.integers(-(10**6), 10**10),
)
def test_plan(
    policy: Policy, relaunches: int, exhausted: bool, launched: bool, after_ms: int
) -> None:
    streak = RelaunchStreak(relaunches, exhausted)
    got = plan_relaunch(policy, streak, launched=launched, failed_at=FAILED_AT)
    if not launched and relaunches == 0:
        assert got is None
    elif relaunches >= policy.relaunch_max_attempts:
        assert got == RelaunchesSpent(relaunches, announce=not exhausted)
    else:
        assert isinstance(got, RelaunchPlan)
        assert got.relaunch == relaunches + 1 <= policy.relaunch_max_attempts
        assert got.backoff_ms == relaunch_backoff_ms(policy, relaunches)
        now = FAILED_AT + timedelta(milliseconds=after_ms)
        assert got.due(now) == (after_ms >= got.backoff_ms)
