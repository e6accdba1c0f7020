"""Operation plans: the ordered steps of a promote and a demote, and their budgets (DESIGN 4)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import assert_never

from haru_protocol import OperationKind, OperationStep, Policy

from haru_core._time import elapsed_since, require_aware

_S = OperationStep

PROMOTE_STEPS: tuple[OperationStep, ...] = (
    _S.STOP_TRAINING,
    _S.VERIFY_GPU,
    _S.WAKE_VLLM,
    _S.PROBE,
    _S.SWITCH_ACTIVE,
    _S.DEMOTE_OLD_SLEEP,
    _S.DEMOTE_OLD_TRAIN,
)
"""Steps of a promotion, in order; ``switch_active`` is the commit point."""

DEMOTE_STEPS: tuple[OperationStep, ...] = (_S.SLEEP_VLLM, _S.START_TRAINING)
"""Steps of a demotion, in order."""

BEST_EFFORT_STEPS: frozenset[OperationStep] = frozenset({_S.DEMOTE_OLD_SLEEP, _S.DEMOTE_OLD_TRAIN})
"""Steps after the commit point whose failure or timeout never fails the operation."""

_ONE_MS = timedelta(milliseconds=1)


def plan_for(kind: OperationKind) -> tuple[OperationStep, ...]:
    """The ordered steps of an operation of ``kind``."""
    match kind:
        case OperationKind.PROMOTE:
            return PROMOTE_STEPS
        case OperationKind.DEMOTE:
            return DEMOTE_STEPS
        case _:
            assert_never(kind)


def first_step(kind: OperationKind) -> OperationStep:
    """The step an operation of ``kind`` starts with."""
    return plan_for(kind)[0]


def next_step(kind: OperationKind, step: OperationStep) -> OperationStep | None:
    """The step after ``step`` in the plan of ``kind``; None when ``step`` is the last.

    Raises:
        ValueError: ``step`` is not part of the plan of ``kind``.
    """
    plan = plan_for(kind)
    if step not in plan:
        raise ValueError(f"step {step.value!r} is not part of a {kind.value} operation")
    index = plan.index(step)
    return plan[index + 1] if index + 1 < len(plan) else None


def is_best_effort(step: OperationStep) -> bool:
    """Whether ``step`` runs after the commit point and may fail without failing the operation."""
    return step in BEST_EFFORT_STEPS


def step_budget_ms(policy: Policy, step: OperationStep) -> int:
    """The time budget of ``step`` in milliseconds, from the fleet's resolved policy."""
    match step:
        case _S.STOP_TRAINING:
            return policy.stop_training_timeout_ms
        case _S.VERIFY_GPU:
            return policy.verify_gpu_timeout_ms
        case _S.WAKE_VLLM:
            return policy.wake_timeout_ms
        case _S.PROBE:
            return policy.probe_timeout_ms
        case _S.SWITCH_ACTIVE:
            return policy.switch_active_timeout_ms
        case _S.DEMOTE_OLD_SLEEP | _S.SLEEP_VLLM:
            return policy.sleep_timeout_ms
        case _S.DEMOTE_OLD_TRAIN | _S.START_TRAINING:
            return policy.start_training_timeout_ms
        case _:
            assert_never(step)


def step_remaining_ms(
    policy: Policy, step: OperationStep, *, started_at: datetime, now: datetime
) -> int:
    """Milliseconds left of the budget of ``step`` that started at ``started_at``.

    Elapsed time is counted in whole milliseconds from ``started_at`` clamped to ``now``
    (:func:`clamp_to_now`), so a ``started_at`` from the future never grants more than the
    budget.
    The result is floored at 0.

    Raises:
        ValueError: ``started_at`` or ``now`` is a naive datetime.
    """
    require_aware("started_at", started_at)
    elapsed_ms = elapsed_since(started_at, now=require_aware("now", now)) // _ONE_MS
    return max(0, step_budget_ms(policy, step) - elapsed_ms)


def is_step_overdue(
    policy: Policy, step: OperationStep, *, started_at: datetime, now: datetime
) -> bool:
    """Whether ``step`` has used its whole budget (no millisecond of it remains).

    Raises:
        ValueError: ``started_at`` or ``now`` is a naive datetime.
    """
    return step_remaining_ms(policy, step, started_at=started_at, now=now) == 0
