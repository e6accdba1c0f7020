"""The offset-file clock (``HARU_CLOCK_OFFSET_FILE``): jumps when the file changes, cheaply."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from haru_db import StateStoreUnavailableError
from haru_server._clock import ManualClock, OffsetFileClock, StoreClock


class Mono:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def close_to(actual: datetime, expected: datetime) -> bool:
    return abs(actual - expected) < timedelta(seconds=0.25)


def test_offset_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "offset"
    mono = Mono()
    clock = OffsetFileClock(path, check_interval_s=0.05, monotonic=mono)
    assert clock.offset == timedelta(0)  # no file: the real clock
    assert close_to(clock(), datetime.now(UTC))
    write(path, "3000\n")
    # Within the check interval the file is not looked at again.
    mono.now += 0.01
    assert close_to(clock(), datetime.now(UTC))
    mono.now += 0.05
    assert close_to(clock(), datetime.now(UTC) + timedelta(seconds=3))
    assert clock.offset == timedelta(seconds=3)
    write(path, "-1500.5")
    mono.now += 0.05
    clock()
    assert clock.offset == timedelta(milliseconds=-1500.5)
    path.unlink()
    mono.now += 0.05
    clock()
    assert clock.offset == timedelta(0)


def test_garbage_or_empty_file_is_offset_zero(tmp_path: Path) -> None:
    path = tmp_path / "offset"
    mono = Mono()
    clock = OffsetFileClock(path, monotonic=mono)
    write(path, "2000")
    clock()
    assert clock.offset == timedelta(seconds=2)
    for text in ("soon", "", "1e400"):
        write(path, text)
        mono.now += 1
        clock()
        assert clock.offset == timedelta(0), text


def test_the_clock_is_aware_utc(tmp_path: Path) -> None:
    assert OffsetFileClock(tmp_path / "none")().tzinfo is UTC


class Database:
    """The database clock as :class:`StoreClock` reads it: a value per read, or a failure."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.down = False

    async def __call__(self) -> datetime:
        if self.down:
            raise StateStoreUnavailableError("down")
        return self.now


START = datetime(2030, 1, 1, tzinfo=UTC)


async def test_store_clock_answers_the_database_time_plus_monotonic_time() -> None:
    mono, db = Mono(), Database(START)
    local = ManualClock(START + timedelta(hours=3))
    clock = StoreClock(db, local=local, max_skew=timedelta(seconds=2), monotonic=mono)
    # Unread: the local clock, and a refusal that says so.
    assert clock() == local()
    assert clock.skew is None
    assert clock.refusal() == "the database clock has not been read yet"
    assert await clock.sample()
    mono.now += 1.5
    assert clock() == START + timedelta(seconds=1.5)
    assert clock.skew == timedelta(hours=3) - timedelta(seconds=1.5)
    assert "differs from the database's by 10798500 ms" in (clock.refusal() or "")
    local.advance(seconds=-3 * 3600)
    assert clock.refusal() is None  # 1.5 s behind: within the bound
    # A reading that lands earlier than what was already answered never moves time back.
    db.now = START
    assert await clock.sample()
    assert clock() == START + timedelta(seconds=1.5)
    # A failed reading keeps the anchor: time goes on.
    db.down = True
    assert not await clock.sample()
    mono.now += 10
    assert clock() == START + timedelta(seconds=10)
