"""The application clock: an injectable source of aware UTC time.

The server's default is :class:`StoreClock`, the database's clock: every process sharing a
store writes and compares times on it. ``ManualClock`` drives budgets in tests.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

from haru_db import HaruDbError, StateStore
from haru_protocol import EventPayload, ServerClockRecovered, ServerClockSkewed

from haru_server._errors import ClockSkewedError, FleetNotFoundError

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


SAMPLE_INTERVAL_S = 5.0
"""How often the server re-reads the database clock (a monotonic clock drifts by ppm)."""


class StoreClock:
    """The database's clock, read without a round trip per call: the time of stored state.

    Every time a server stores or compares against stored times must come from one clock, or
    a replica whose wall clock is off times out steps others started and writes times from the
    future. That clock is the database's (``StateStore.database_now``). :meth:`sample` reads
    it and anchors the reading to ``time.monotonic()`` at the middle of the read; a call then
    answers the latest reading plus the monotonic time elapsed since, never less than it
    answered before (two readings may disagree by the read's own latency).

    The process's own wall clock (``local``, with ``HARU_CLOCK_OFFSET_FILE``'s offset) is only
    compared with it: :attr:`skew` is local minus database, and :meth:`refusal` says why the
    process must not act while that exceeds ``max_skew``. Before the first reading succeeded
    the clock answers ``local`` and :meth:`refusal` reports it unsynchronised.

    Args:
        read: Reads the database clock (aware).
        local: The process's wall clock.
        max_skew: The largest skew at which the process still acts.
        monotonic: Monotonic seconds (injected by tests).
    """

    def __init__(
        self,
        read: Callable[[], Awaitable[datetime]],
        *,
        local: Clock,
        max_skew: timedelta,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._local = local
        self.max_skew = max_skew
        self._mono = monotonic
        self._anchor: tuple[datetime, float] | None = None
        self._last: datetime | None = None
        self._failing = False

    @property
    def local(self) -> Clock:
        """The process's wall clock this one is compared with."""
        return self._local

    @property
    def synced(self) -> bool:
        """Whether one reading of the database clock succeeded."""
        return self._anchor is not None

    async def sample(self) -> bool:
        """Read the database clock once; False (and the previous reading kept) when it failed."""
        before = self._mono()
        try:
            value = await self._read()
        except HaruDbError as exc:  # a store outage must not stop the clock: the old anchor holds
            if not self._failing:
                self._failing = True
                logger.warning("could not read the database clock (previous reading kept): %s", exc)
            return False
        after = self._mono()
        if self._failing:
            self._failing = False
            logger.info("database clock readable again")
        self._anchor = (value, (before + after) / 2)
        return True

    def __call__(self) -> datetime:
        """The database's time now (the local clock until the first reading)."""
        if self._anchor is None:
            return self._local()
        value, at = self._anchor
        now = value + timedelta(seconds=self._mono() - at)
        if self._last is not None and now < self._last:
            return self._last
        self._last = now
        return now

    @property
    def skew(self) -> timedelta | None:
        """The local wall clock minus the database's; None before the first reading."""
        if self._anchor is None:
            return None
        return self._local() - self()

    def refusal(self) -> str | None:
        """Why this process must not act on stored state now, or None."""
        skew = self.skew
        if skew is None:
            return "the database clock has not been read yet"
        if abs(skew) > self.max_skew:
            return (
                f"this host's clock differs from the database's by {_ms(skew)} ms "
                f"(HARU_MAX_CLOCK_SKEW_MS is {_ms(self.max_skew)})"
            )
        return None


def _ms(value: timedelta) -> int:
    return round(value / timedelta(milliseconds=1))


class SkewGate:
    """Refuses reconcile ticks while :meth:`StoreClock.refusal` holds, with one event per change.

    Each fleet gets ``server.clock.skewed`` the first time this process refuses to tick it
    because of skew, and ``server.clock.recovered`` at its first tick once the skew is back
    within bounds. An unread database clock refuses too, without an event (nothing is known).

    Args:
        clock: The store clock.
        store: Where the events go.
    """

    def __init__(self, clock: StoreClock, store: StateStore) -> None:
        self._clock = clock
        self._store = store
        self._skewed: set[UUID] = set()
        self._host = socket.gethostname()[:255]

    async def check(self, fleet_ref: str) -> None:
        """Return when ``fleet_ref`` may be reconciled now.

        Raises:
            ClockSkewedError: It may not; the message says why.
            FleetNotFoundError: No such fleet (only while an event is due).
            haru_db.StateStoreUnavailableError: The store failed while recording an event.
        """
        reason = self._clock.refusal()
        skew = self._clock.skew
        if reason is None and not self._skewed:
            return
        if skew is None:
            raise ClockSkewedError(reason)
        pointer = await self._store.get_fleet_route_pointer(fleet_ref)
        if pointer is None:
            raise FleetNotFoundError(fleet_ref)
        payload: EventPayload
        if reason is not None:
            if pointer.id not in self._skewed:
                payload = ServerClockSkewed(**self._facts(skew))
                await self._store.append_event(
                    fleet_id=pointer.id, payload=payload, at=self._clock()
                )
                self._skewed.add(pointer.id)
                logger.error("fleet %s: not reconciled: %s", pointer.slug, reason)
            raise ClockSkewedError(reason)
        if pointer.id in self._skewed:
            payload = ServerClockRecovered(**self._facts(skew))
            await self._store.append_event(fleet_id=pointer.id, payload=payload, at=self._clock())
            self._skewed.discard(pointer.id)
            logger.warning("fleet %s: clock within bounds again; reconciling", pointer.slug)

    def _facts(self, skew: timedelta) -> dict[str, Any]:
        return {
            "skew_ms": _ms(skew),
            "max_skew_ms": _ms(self._clock.max_skew),
            "host": self._host,
            "pid": os.getpid(),
        }
