"""Promotion backoff: how long automatic promotions of a target wait after it failed.

Computed from the recent operations of the fleet alone (no mutable counter to keep in step
with them): the number of consecutive failed promotions of the target since its last
successful one sets an exponential pause, bounded by the policy, counted from when the last of
them finished. An identical failure is then retried at most once per pause, never at tick
rate; one success of the target resets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from haru_protocol import Operation, OperationKind, OperationState, Policy

from haru_core._time import clamp_to_now, require_aware

MAX_BACKOFF_EXPONENT = 30
"""Doubling stops here; the policy's maximum bounds the pause long before."""


@dataclass(frozen=True, slots=True)
class PromotionBackoff:
    """Automatic promotions of ``target_domain_id`` wait until ``until``.

    Attributes:
        target_domain_id: The domain whose promotions failed.
        consecutive_failures: Failed promotions of it since its last successful one.
        delay_ms: The pause after the last failure.
        until: When the pause ends (the last failure's end plus ``delay_ms``).
    """

    target_domain_id: UUID
    consecutive_failures: int
    delay_ms: int
    until: datetime


def backoff_delay_ms(policy: Policy, consecutive_failures: int) -> int:
    """The pause after ``consecutive_failures`` (>= 1) failed promotions of one target.

    ``promotionBackoffBaseMs`` after the first, doubling with each further failure, never
    more than ``promotionBackoffMaxMs``.
    """
    if consecutive_failures < 1:
        raise ValueError("consecutive_failures must be at least 1")
    exponent = min(consecutive_failures - 1, MAX_BACKOFF_EXPONENT)
    delay: int = policy.promotion_backoff_base_ms << exponent
    return min(policy.promotion_backoff_max_ms, delay)


def promotion_backoff(
    policy: Policy,
    target_domain_id: UUID,
    operations: Iterable[Operation],
    *,
    now: datetime | None = None,
) -> PromotionBackoff | None:
    """The backoff of ``target_domain_id`` given the fleet's recent ``operations`` (any order).

    Only finished promotions of the target count: failed ones add up, newest first, until a
    succeeded one; in-flight and cancelled ones and demotes are ignored. With ``now``, a
    ``finishedAt`` after it counts as ``now`` (:func:`clamp_to_now`).

    Returns:
        The backoff, or None when the target's last finished promotion did not fail.
    """
    promotions = sorted(
        (
            op
            for op in operations
            if op.kind is OperationKind.PROMOTE
            and op.target_domain_id == target_domain_id
            and op.state in (OperationState.FAILED, OperationState.SUCCEEDED)
            and op.finished_at is not None
        ),
        key=lambda op: (op.finished_at or op.created_at, op.created_at),
        reverse=True,
    )
    failures = 0
    for op in promotions:
        if op.state is OperationState.SUCCEEDED:
            break
        failures += 1
    if failures == 0:
        return None
    last = promotions[0].finished_at or promotions[0].created_at  # finished: filtered above
    if now is not None:
        last = clamp_to_now(last, now=now)
    delay = backoff_delay_ms(policy, failures)
    return PromotionBackoff(
        target_domain_id=target_domain_id,
        consecutive_failures=failures,
        delay_ms=delay,
        until=last + timedelta(milliseconds=delay),
    )


def in_backoff(until: datetime | None, *, now: datetime) -> bool:
    """Whether a backoff ending at ``until`` (None: no backoff) still holds at ``now``."""
    require_aware("now", now)
    return until is not None and now < until
