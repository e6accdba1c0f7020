"""Time arguments: core never reads a clock, so every instant it compares must be aware.

Stored times and ``now`` come from one clock, the database's, but a stored time may still lie
ahead of ``now``: written by a process whose clock ran fast (an older release, or one the skew
bound has not caught yet), or by hand. Such a time counts as ``now`` (:func:`clamp_to_now`)
wherever a decision measures time since it, so it can never hold a decision back longer than
the same time written now would; the reconciler also writes ``now`` over it in the store, so
the time elapsed since it then grows as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from uuid import UUID

from haru_protocol import FleetSnapshot, Operation

FUTURE_TOLERANCE = timedelta(seconds=1)
"""How far a stored time may lie ahead before it is repaired: processes read the database's
clock each with a small error (milliseconds), so a time a peer wrote a moment ago can lie a
little ahead of this process's ``now`` and is no sign of a fast clock."""


def require_aware(name: str, value: datetime) -> datetime:
    """Return ``value``, or raise ValueError when it carries no UTC offset."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got {value!r}")
    return value


def clamp_to_now(stored: datetime, *, now: datetime) -> datetime:
    """``stored``, or ``now`` when ``stored`` is later: a stored time from the future is now.

    Raises:
        ValueError: ``stored`` or ``now`` is a naive datetime.
    """
    require_aware("stored", stored)
    return min(stored, require_aware("now", now))


def elapsed_since(stored: datetime, *, now: datetime) -> timedelta:
    """Time from ``stored`` (clamped to ``now``) to ``now``: never negative.

    Raises:
        ValueError: ``stored`` or ``now`` is a naive datetime.
    """
    return now - clamp_to_now(stored, now=now)


def lies_ahead(stored: datetime | None, *, now: datetime) -> bool:
    """Whether ``stored`` is later than ``now`` by more than :data:`FUTURE_TOLERANCE`."""
    return stored is not None and stored - require_aware("now", now) > FUTURE_TOLERANCE


def fleet_times_ahead(fleet: FleetSnapshot, *, now: datetime) -> bool:
    """Whether a domain of ``fleet`` holds a time that :func:`lies_ahead` of ``now``."""
    return any(
        lies_ahead(value, now=now)
        for d in fleet.domains
        for value in (
            d.last_seen_at,
            d.state_updated_at,
            d.launch_started_at,
            d.launched_at,
            d.connect_failed_at,
        )
    )


def operations_ahead(operations: Iterable[Operation], *, now: datetime) -> frozenset[UUID]:
    """The ids of ``operations`` holding a time that :func:`lies_ahead` of ``now``."""
    return frozenset(
        op.id
        for op in operations
        if any(
            lies_ahead(value, now=now)
            for value in (op.created_at, op.step_started_at, op.finished_at)
        )
    )
