"""Promotion backoff computed from the fleet's recent operations (no mutable state)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from haru_core import PromotionBackoff, backoff_delay_ms, in_backoff, promotion_backoff
from haru_protocol import Operation, OperationKind, OperationState, Policy

NOW = datetime(2030, 1, 1, tzinfo=UTC)
FLEET = uuid.uuid4()
TARGET = uuid.uuid4()
OTHER = uuid.uuid4()
POLICY = Policy(promotion_backoff_base_ms=1_000, promotion_backoff_max_ms=10_000)

F = OperationState.FAILED
S = OperationState.SUCCEEDED
P = OperationKind.PROMOTE
D = OperationKind.DEMOTE


def op(
    minute: int,
    state: OperationState,
    *,
    kind: OperationKind = P,
    target: uuid.UUID = TARGET,
) -> Operation:
    created = NOW + timedelta(minutes=minute)
    finished = None if state in (OperationState.PENDING, OperationState.RUNNING) else created
    return Operation(
        id=uuid.uuid4(),
        fleet_id=FLEET,
        kind=kind,
        state=state,
        target_domain_id=target,
        current_step=None,
        step_started_at=None,
        error=None,
        created_at=created,
        finished_at=finished,
    )


@pytest.mark.parametrize(
    ("failures", "delay_ms"),
    [(1, 1_000), (2, 2_000), (3, 4_000), (4, 8_000), (5, 10_000), (60, 10_000), (10**6, 10_000)],
)
def test_delay_doubles_and_is_bounded(failures: int, delay_ms: int) -> None:
    assert backoff_delay_ms(POLICY, failures) == delay_ms


def test_delay_needs_a_failure() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        backoff_delay_ms(POLICY, 0)


def test_default_policy_bounds() -> None:
    policy = Policy()
    assert backoff_delay_ms(policy, 1) == policy.promotion_backoff_base_ms == 30_000
    assert backoff_delay_ms(policy, 100) == policy.promotion_backoff_max_ms == 900_000


CASES: list[tuple[str, list[Operation], int | None, int | None]] = [
    # (name, operations, expected consecutive failures, expected minute of the last failure)
    ("none", [], None, None),
    ("one success", [op(0, S)], None, None),
    ("one failure", [op(0, F)], 1, 0),
    ("three failures", [op(0, F), op(1, F), op(2, F)], 3, 2),
    ("success resets", [op(0, F), op(1, F), op(2, S), op(3, F)], 1, 3),
    ("success last", [op(0, F), op(1, S)], None, None),
    (
        "other targets and demotes ignored",
        [op(0, F), op(1, F, target=OTHER), op(2, S, target=OTHER), op(3, S, kind=D), op(4, F)],
        2,
        4,
    ),
    (
        "in-flight and cancelled ignored",
        [op(0, F), op(1, OperationState.CANCELLED), op(2, OperationState.RUNNING)],
        1,
        0,
    ),
]


@pytest.mark.parametrize(
    ("name", "operations", "failures", "last"), CASES, ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("reverse", [False, True])
def test_backoff_from_recent_operations(
    name: str, operations: list[Operation], failures: int | None, last: int | None, reverse: bool
) -> None:
    ordered = list(reversed(operations)) if reverse else operations
    backoff = promotion_backoff(POLICY, TARGET, ordered)
    if failures is None:
        assert backoff is None
        return
    assert last is not None
    delay = backoff_delay_ms(POLICY, failures)
    assert backoff == PromotionBackoff(
        target_domain_id=TARGET,
        consecutive_failures=failures,
        delay_ms=delay,
        until=NOW + timedelta(minutes=last, milliseconds=delay),
    )


@pytest.mark.parametrize(("offset_ms", "holds"), [(-1, True), (0, False), (1, False)])
def test_in_backoff_boundary(offset_ms: int, holds: bool) -> None:
    until = NOW + timedelta(seconds=1)
    assert in_backoff(until, now=until + timedelta(milliseconds=offset_ms)) is holds
    assert in_backoff(None, now=NOW) is False


def test_in_backoff_rejects_naive_now() -> None:
    with pytest.raises(ValueError, match="aware"):
        in_backoff(None, now=datetime(2030, 1, 1))  # noqa: DTZ001
