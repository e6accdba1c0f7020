"""Operation plans: step order, budgets from the policy, best-effort steps, remaining time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from haru_core import (
    BEST_EFFORT_STEPS,
    DEMOTE_STEPS,
    PROMOTE_STEPS,
    first_step,
    is_best_effort,
    is_step_overdue,
    next_step,
    plan_for,
    step_budget_ms,
    step_remaining_ms,
)
from haru_protocol import OperationKind, OperationStep, Policy

S = OperationStep

# Every budget differs from its default and from every other, so a wrong mapping shows.
POLICY = Policy(
    stop_training_timeout_ms=1_001,
    verify_gpu_timeout_ms=2_002,
    wake_timeout_ms=3_003,
    probe_timeout_ms=4_004,
    switch_active_timeout_ms=5_005,
    sleep_timeout_ms=6_006,
    start_training_timeout_ms=7_007,
    heartbeat_stale_ms=8_008,
    degraded_grace_ms=9_009,
    training_stop_grace_ms=10_010,
)

EXPECTED_BUDGETS = {
    S.STOP_TRAINING: 1_001,
    S.VERIFY_GPU: 2_002,
    S.WAKE_VLLM: 3_003,
    S.PROBE: 4_004,
    S.SWITCH_ACTIVE: 5_005,
    S.DEMOTE_OLD_SLEEP: 6_006,
    S.SLEEP_VLLM: 6_006,
    S.DEMOTE_OLD_TRAIN: 7_007,
    S.START_TRAINING: 7_007,
}

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def test_promote_order() -> None:
    assert PROMOTE_STEPS == (
        S.STOP_TRAINING,
        S.VERIFY_GPU,
        S.WAKE_VLLM,
        S.PROBE,
        S.SWITCH_ACTIVE,
        S.DEMOTE_OLD_SLEEP,
        S.DEMOTE_OLD_TRAIN,
    )
    assert plan_for(OperationKind.PROMOTE) == PROMOTE_STEPS


def test_demote_order() -> None:
    assert DEMOTE_STEPS == (S.SLEEP_VLLM, S.START_TRAINING)
    assert plan_for(OperationKind.DEMOTE) == DEMOTE_STEPS


def test_plans_cover_every_step_once() -> None:
    assert sorted(PROMOTE_STEPS + DEMOTE_STEPS) == sorted(OperationStep)


def test_first_step() -> None:
    assert first_step(OperationKind.PROMOTE) is S.STOP_TRAINING
    assert first_step(OperationKind.DEMOTE) is S.SLEEP_VLLM


@pytest.mark.parametrize("kind", list(OperationKind))
def test_next_step_walks_the_plan(kind: OperationKind) -> None:
    walked = [first_step(kind)]
    while (step := next_step(kind, walked[-1])) is not None:
        walked.append(step)
    assert tuple(walked) == plan_for(kind)


def test_next_step_examples() -> None:
    assert next_step(OperationKind.PROMOTE, S.PROBE) is S.SWITCH_ACTIVE
    assert next_step(OperationKind.PROMOTE, S.SWITCH_ACTIVE) is S.DEMOTE_OLD_SLEEP
    assert next_step(OperationKind.PROMOTE, S.DEMOTE_OLD_TRAIN) is None
    assert next_step(OperationKind.DEMOTE, S.SLEEP_VLLM) is S.START_TRAINING
    assert next_step(OperationKind.DEMOTE, S.START_TRAINING) is None


@pytest.mark.parametrize(
    ("kind", "step"),
    [(OperationKind.PROMOTE, s) for s in DEMOTE_STEPS]
    + [(OperationKind.DEMOTE, s) for s in PROMOTE_STEPS],
)
def test_next_step_rejects_foreign_step(kind: OperationKind, step: OperationStep) -> None:
    with pytest.raises(ValueError, match=step.value):
        next_step(kind, step)


def test_best_effort_steps() -> None:
    assert {S.DEMOTE_OLD_SLEEP, S.DEMOTE_OLD_TRAIN} == BEST_EFFORT_STEPS
    for step in OperationStep:
        assert is_best_effort(step) is (step in {S.DEMOTE_OLD_SLEEP, S.DEMOTE_OLD_TRAIN})
    # Best-effort steps come after the commit point.
    commit = PROMOTE_STEPS.index(S.SWITCH_ACTIVE)
    assert all(PROMOTE_STEPS.index(s) > commit for s in BEST_EFFORT_STEPS)


@pytest.mark.parametrize(("step", "budget"), sorted(EXPECTED_BUDGETS.items()))
def test_budget_per_step(step: OperationStep, budget: int) -> None:
    assert step_budget_ms(POLICY, step) == budget


def test_budgets_with_defaults() -> None:
    defaults = Policy()
    assert step_budget_ms(defaults, S.STOP_TRAINING) == 90_000
    assert step_budget_ms(defaults, S.WAKE_VLLM) == 120_000
    assert step_budget_ms(defaults, S.SWITCH_ACTIVE) == 10_000


def test_remaining_counts_down() -> None:
    started = T0
    assert step_remaining_ms(POLICY, S.PROBE, started_at=started, now=started) == 4_004
    assert (
        step_remaining_ms(POLICY, S.PROBE, started_at=started, now=started + timedelta(seconds=1))
        == 3_004
    )
    assert (
        step_remaining_ms(
            POLICY, S.PROBE, started_at=started, now=started + timedelta(microseconds=1_500)
        )
        == 4_003
    )


def test_remaining_boundary_and_overdue() -> None:
    budget = timedelta(milliseconds=4_004)
    just_before = T0 + budget - timedelta(microseconds=1)
    assert step_remaining_ms(POLICY, S.PROBE, started_at=T0, now=just_before) == 1
    assert not is_step_overdue(POLICY, S.PROBE, started_at=T0, now=just_before)
    assert step_remaining_ms(POLICY, S.PROBE, started_at=T0, now=T0 + budget) == 0
    assert is_step_overdue(POLICY, S.PROBE, started_at=T0, now=T0 + budget)
    long_after = T0 + timedelta(hours=5)
    assert step_remaining_ms(POLICY, S.PROBE, started_at=T0, now=long_after) == 0
    assert is_step_overdue(POLICY, S.PROBE, started_at=T0, now=long_after)


def test_remaining_never_exceeds_budget_under_clock_skew() -> None:
    earlier = T0 - timedelta(seconds=30)
    assert step_remaining_ms(POLICY, S.WAKE_VLLM, started_at=T0, now=earlier) == 3_003
    assert not is_step_overdue(POLICY, S.WAKE_VLLM, started_at=T0, now=earlier)


def test_remaining_across_offsets() -> None:
    tokyo = timezone(timedelta(hours=9))
    started = T0.astimezone(tokyo)
    now = T0 + timedelta(milliseconds=1_000)
    assert step_remaining_ms(POLICY, S.STOP_TRAINING, started_at=started, now=now) == 1


@pytest.mark.parametrize("naive", ["now", "started_at"])
def test_naive_times_rejected(naive: str) -> None:
    naive_time = datetime(2026, 3, 1, 12, 0, 0)  # noqa: DTZ001 -- the point of the test
    now = naive_time if naive == "now" else T0
    started = naive_time if naive == "started_at" else T0
    with pytest.raises(ValueError, match=naive):
        step_remaining_ms(POLICY, S.PROBE, started_at=started, now=now)
    with pytest.raises(ValueError, match=naive):
        is_step_overdue(POLICY, S.PROBE, started_at=started, now=now)
