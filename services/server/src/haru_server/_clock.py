"""The application clock: an injectable source of aware UTC time."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

logger = logging.getLogger(__name__)

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


class OffsetFileClock:
    """The real clock plus an offset read from a file: a test and fault-injection hook.

    ``HARU_CLOCK_OFFSET_FILE`` names the file; it holds the offset in milliseconds (a
    decimal number, may be negative). A missing, empty or unreadable file is offset 0. The
    file's identity (inode, size, mtime) is checked at most every ``check_interval_s`` on the
    monotonic clock and the offset re-read only when it changed, so a harness can make one
    server process's clock jump while it runs (write a new file and rename it over the old).

    Args:
        path: The offset file.
        check_interval_s: Least time between two checks of the file.
        monotonic: Monotonic seconds (injected by tests).
    """

    def __init__(
        self,
        path: Path,
        *,
        check_interval_s: float = 0.05,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._interval = check_interval_s
        self._mono = monotonic
        self._next_check = float("-inf")
        self._identity: tuple[int, int, int] | None = None
        self._offset = timedelta(0)

    @property
    def offset(self) -> timedelta:
        """The offset in force (as of the last check)."""
        return self._offset

    def _refresh(self) -> None:
        try:
            stat = os.stat(self.path)
        except OSError:
            identity = None
        else:
            identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if identity == self._identity:
            return
        self._identity = identity
        offset = timedelta(0)
        if identity is not None:
            try:
                text = self.path.read_text(encoding="utf-8").strip()
                offset = timedelta(milliseconds=float(text)) if text else timedelta(0)
            except (OSError, ValueError, OverflowError) as exc:
                logger.warning("clock offset file %s unreadable (%s): offset 0", self.path, exc)
        if offset != self._offset:
            logger.warning(
                "clock offset now %.0f ms (%s)", offset / timedelta(milliseconds=1), self.path
            )
        self._offset = offset

    def __call__(self) -> datetime:
        """The real UTC time plus the file's offset."""
        mono = self._mono()
        if mono >= self._next_check:
            self._next_check = mono + self._interval
            self._refresh()
        return datetime.now(UTC) + self._offset
