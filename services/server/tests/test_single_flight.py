"""Unit tests of the generic bounded, coalesced reads (``haru_server._single_flight``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from haru_server._single_flight import BoundedReads, SingleFlight


class Source:
    """A value whose reads block until released, counting how many started."""

    def __init__(self) -> None:
        self.value = "v1"
        self.started: list[tuple[str, int]] = []
        self.gate = asyncio.Event()
        self.error: Exception | None = None
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def fetch(self, key: str, seq: int) -> str:
        self.started.append((key, seq))
        value, error = self.value, self.error
        await self.gate.wait()
        if error is not None:
            raise error
        return f"{key}={value}"


async def settle(predicate: object) -> None:
    for _ in range(1000):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never reached")


async def test_callers_arriving_during_a_read_share_the_next_one() -> None:
    source = Source()
    flight: SingleFlight[str, str] = SingleFlight(source.fetch, next_seq=source.next_seq)
    first = asyncio.create_task(flight.read("a", 10))
    await settle(lambda: len(source.started) == 1)
    source.value = "v2"  # committed after the first read started
    later = [asyncio.create_task(flight.read("a", 10)) for _ in range(5)]
    for _ in range(3):
        await asyncio.sleep(0)  # let them queue
    assert len(source.started) == 1  # queued behind the read in flight, not a read each
    source.gate.set()
    assert await first == ("a=v1", 1)
    # None of them is answered from the read that began before they asked.
    assert [await t for t in later] == [("a=v2", 2)] * 5
    assert source.started == [("a", 1), ("a", 2)]
    assert flight.tasks() == []


async def test_keys_do_not_share_reads() -> None:
    source = Source()
    source.gate.set()
    flight: SingleFlight[str, str] = SingleFlight(source.fetch, next_seq=source.next_seq)
    a, b = await asyncio.gather(flight.read("a", 10), flight.read("b", 10))
    assert {a[0], b[0]} == {"a=v1", "b=v1"}
    assert sorted(key for key, _ in source.started) == ["a", "b"]


async def test_a_failed_read_fails_every_caller_of_it_and_the_next_read_starts_clean() -> None:
    source = Source()
    source.error = ConnectionError("down")
    flight: SingleFlight[str, str] = SingleFlight(source.fetch, next_seq=source.next_seq)
    callers = [asyncio.create_task(flight.read("a", 10)) for _ in range(3)]
    await settle(lambda: len(source.started) == 1)
    source.error = None
    source.gate.set()
    outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert isinstance(outcomes[0], ConnectionError)
    # The two that arrived while the failing read ran share the next (healthy) read.
    assert outcomes[1:] == [("a=v1", 2)] * 2
    assert await flight.read("a", 10) == ("a=v1", 3)


async def test_a_caller_that_stops_waiting_leaves_the_read_to_the_others() -> None:
    source = Source()
    flight: SingleFlight[str, str] = SingleFlight(source.fetch, next_seq=source.next_seq)
    patient = asyncio.create_task(flight.read("a", 60))
    await settle(lambda: len(source.started) == 1)
    with pytest.raises(TimeoutError):
        await flight.read("a", 0.001)
    assert not patient.done()
    source.gate.set()
    assert await patient == ("a=v1", 1)


async def hang(cancelled: asyncio.Event) -> str:
    """A read that never answers; sets ``cancelled`` once it is cancelled."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return "never"


async def test_a_read_past_its_bound_is_abandoned_and_cancelled() -> None:
    reads = BoundedReads()
    cancelled = asyncio.Event()
    with pytest.raises(TimeoutError):
        await reads.run(hang(cancelled), 0.001)
    await asyncio.wait_for(cancelled.wait(), timeout=5)
    await settle(lambda: reads.tasks() == [])


async def test_a_bounded_read_that_answers_returns_its_value_and_raises_its_error() -> None:
    reads = BoundedReads()

    async def answer() -> int:
        return 7

    async def fail() -> int:
        raise ValueError("bad row")

    assert await reads.run(answer(), 60) == 7
    with pytest.raises(ValueError, match="bad row"):
        await reads.run(fail(), 60)
    assert reads.tasks() == []


@dataclass
class HandTimer:
    delay: float
    callback: Callable[[], object]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class HandTimers:
    """``call_later`` whose timers fire only when the test says so, however late."""

    def __init__(self) -> None:
        self.armed: list[HandTimer] = []

    def call_later(self, delay: float, callback: Callable[[], object]) -> HandTimer:
        timer = HandTimer(delay, callback)
        self.armed.append(timer)
        return timer

    def pending(self) -> list[HandTimer]:
        return [t for t in self.armed if not t.cancelled]

    def fire(self) -> HandTimer:
        (timer,) = self.pending()
        self.armed.remove(timer)
        timer.callback()
        return timer


async def test_a_bound_is_counted_in_quarters_so_a_stall_costs_only_one() -> None:
    timers = HandTimers()
    reads = BoundedReads(call_later=timers.call_later)
    cancelled = asyncio.Event()
    read = asyncio.create_task(reads.run(hang(cancelled), 2.0))
    for _ in range(3):
        await settle(timers.pending)
        assert [t.delay for t in timers.pending()] == [0.5]
        # Fired as late as it may be (the process stood still): one quarter gone, no more.
        fired = timers.fire()
        await settle(lambda fired=fired: fired.cancelled)
        assert not read.done()
    await settle(timers.pending)
    timers.fire()
    with pytest.raises(TimeoutError):
        await read
    await asyncio.wait_for(cancelled.wait(), timeout=5)
    await settle(lambda: reads.tasks() == [])


async def test_a_caller_s_bound_on_a_shared_read_counts_on_the_injected_timer() -> None:
    timers = HandTimers()
    source = Source()
    flight: SingleFlight[str, str] = SingleFlight(
        source.fetch, next_seq=source.next_seq, call_later=timers.call_later
    )
    caller = asyncio.create_task(flight.read("a", 1.0))
    for _ in range(4):
        await settle(timers.pending)
        fired = timers.fire()
        await settle(lambda fired=fired: fired.cancelled or caller.done())
    with pytest.raises(TimeoutError):
        await caller
    # The read goes on for whoever asks next, and answers it.
    assert flight.tasks() != []
    source.gate.set()
    assert await flight.read("a", 60) == ("a=v1", 2)
