"""The application clock: an injectable source of aware UTC time."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

Clock = Callable[[], datetime]
"""Returns the current aware UTC time; injected so tests control budgets."""


def utc_now() -> datetime:
    """The real clock."""
    return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to (tests and benchmarks drive budgets with it).

    Args:
        start: The time it reads until advanced (aware).
    """

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("ManualClock needs an aware start time")
        self.now = start

    def __call__(self) -> datetime:
        """The current (manual) time."""
        return self.now

    def advance(self, *, ms: int = 0, seconds: float = 0) -> datetime:
        """Move the clock forward and return the new time."""
        self.now += timedelta(milliseconds=ms, seconds=seconds)
        return self.now
