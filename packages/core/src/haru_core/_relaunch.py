"""Relaunch of a lost provisioned domain: its streak, whether the next one is due, its backoff.

A failed provisioned domain whose cluster is lost is launched again after an exponential pause
counted from the failure, at most ``relaunchMaxAttempts`` times in a row. The streak is not a
counter kept beside the store: it is folded from the domain's own events, newest first, back to
the event it began after (the domain ``ready`` again, or ``haru domain up``), so a restarted
server continues it and its bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from haru_protocol import (
    MAX_DURATION_MS,
    AnyEventPayload,
    DomainRelaunch,
    DomainState,
    DomainStateChanged,
    DomainUpRequested,
    EventType,
    Policy,
)

from haru_core._time import require_aware

RELAUNCH_STREAK_EVENTS: frozenset[EventType] = frozenset(
    {EventType.DOMAIN_RELAUNCH, EventType.DOMAIN_STATE_CHANGED, EventType.DOMAIN_UP_REQUESTED}
)
"""The event types a relaunch streak is folded from: relaunches, and the ``ready`` or ``up``
it began after. Any other event given to :func:`fold_relaunch_streak` is skipped."""

_MAX_EXPONENT = MAX_DURATION_MS.bit_length()
"""Doubling a base of at least 1 ms this often exceeds any policy maximum: stop there."""


@dataclass(frozen=True, slots=True)
class RelaunchStreak:
    """A failed domain's relaunch streak, as folded so far from its events (newest first).

    Attributes:
        relaunches: Relaunches of the streak (``domain.relaunch`` events not ``exhausted``).
        exhausted: Giving up was already said (a ``domain.relaunch`` event ``exhausted``).
        complete: The fold reached the event the streak began after (the domain ``ready``
            again, or ``haru domain up``): older events do not count, folding more changes
            nothing.
    """

    relaunches: int = 0
    exhausted: bool = False
    complete: bool = False


@dataclass(frozen=True, slots=True)
class RelaunchPlan:
    """The next relaunch of a failed domain: relaunch ``relaunch`` of its streak.

    Attributes:
        relaunch: Its number in the streak (1: the first since the domain was last ready).
        backoff_ms: The pause after the failure it waits (:func:`relaunch_backoff_ms`).
        not_before: The failure plus the pause: the relaunch is due from then on.
    """

    relaunch: int
    backoff_ms: int
    not_before: datetime

    def due(self, now: datetime) -> bool:
        """Whether the pause is over at ``now``."""
        require_aware("now", now)
        return now >= self.not_before


@dataclass(frozen=True, slots=True)
class RelaunchesSpent:
    """``relaunchMaxAttempts`` relaunches are spent: the domain stays failed.

    Attributes:
        relaunches: The relaunches of the streak.
        announce: Giving up was not said yet: say it once (a ``domain.relaunch`` event
            ``exhausted``) and tear down what is left of the cluster.
    """

    relaunches: int
    announce: bool


def _begins_streak(payload: AnyEventPayload) -> bool:
    return isinstance(payload, DomainUpRequested) or (
        isinstance(payload, DomainStateChanged) and payload.to_state is DomainState.READY
    )


def fold_relaunch_streak(
    payloads: Iterable[AnyEventPayload], streak: RelaunchStreak | None = None
) -> RelaunchStreak:
    """``streak`` extended with older events of the domain: ``payloads``, newest first.

    Folding stops at the event the streak began after (the result is ``complete``); a
    complete ``streak`` is returned as it is. Folding a list in pieces, each continuing the
    last one's result, gives what folding it whole gives, so the events can be read page by
    page until the streak is complete.
    """
    streak = streak or RelaunchStreak()
    if streak.complete:
        return streak
    relaunches, exhausted = streak.relaunches, streak.exhausted
    for payload in payloads:
        if _begins_streak(payload):
            return RelaunchStreak(relaunches, exhausted, complete=True)
        if isinstance(payload, DomainRelaunch):
            exhausted |= payload.exhausted
            relaunches += not payload.exhausted
    return RelaunchStreak(relaunches, exhausted)


def relaunch_backoff_ms(policy: Policy, relaunches: int) -> int:
    """The pause after a failure before relaunch ``relaunches + 1`` of a streak.

    ``relaunchBackoffBaseMs`` before the first, doubling with each further one, never more
    than ``relaunchBackoffMaxMs``.
    """
    if relaunches < 0:
        raise ValueError("relaunches must not be negative")
    delay: int = policy.relaunch_backoff_base_ms << min(relaunches, _MAX_EXPONENT)
    return min(delay, policy.relaunch_backoff_max_ms)


def plan_relaunch(
    policy: Policy, streak: RelaunchStreak, *, launched: bool, failed_at: datetime
) -> RelaunchPlan | RelaunchesSpent | None:
    """What a failed domain's relaunch ``streak`` allows.

    Args:
        policy: The fleet's policy (``relaunchMaxAttempts`` and the backoff bounds).
        streak: The domain's streak (:func:`fold_relaunch_streak`).
        launched: Whether the domain's last launch went through.
        failed_at: When the domain failed (the pause counts from then).

    Returns:
        None when a first launch failed (never launched, no relaunch yet): that is the
        operator's call, not a relaunch. :class:`RelaunchesSpent` once the streak holds
        ``relaunchMaxAttempts`` relaunches; else the next :class:`RelaunchPlan`. A relaunch
        whose launch failed (a capacity error right after a preemption) stays in the streak.
    """
    require_aware("failed_at", failed_at)
    if not launched and streak.relaunches == 0:
        return None
    if streak.relaunches >= policy.relaunch_max_attempts:
        return RelaunchesSpent(streak.relaunches, announce=not streak.exhausted)
    backoff_ms = relaunch_backoff_ms(policy, streak.relaunches)
    return RelaunchPlan(
        relaunch=streak.relaunches + 1,
        backoff_ms=backoff_ms,
        not_before=failed_at + timedelta(milliseconds=backoff_ms),
    )
