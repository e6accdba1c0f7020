"""Helpers for tests of code that embeds the control server (as `haru_db.testing` is for stores).

- :class:`ManualClock`: the application clock, moved by hand (``clock.advance(ms=...)``).
- :func:`seed_layout`: apply a fleet layout to a store and return the stored snapshot.
- :func:`tick_until_settled`: tick a :class:`~haru_server.api.Reconciler` until no operation
  is in flight.
- :func:`wait_training`: poll a supervisor until every training run is in a state.

They use only what production code exposes; the repository's own server tests use them through
their ``conftest.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

from haru_db import StateStore
from haru_protocol import FleetLayout, FleetSnapshot, SlotKind, TrainingRunState
from haru_supervisor_client import SupervisorClient

from haru_server._clock import ManualClock
from haru_server._reconciler import Reconciler, TickResult

__all__ = ["ManualClock", "seed_layout", "tick_until_settled", "wait_training"]


async def seed_layout(
    store: StateStore, layout: FleetLayout, clock: Callable[[], datetime]
) -> FleetSnapshot:
    """Apply ``layout`` at ``clock()`` and return the stored snapshot of its fleet."""
    await store.apply_fleet_layout(layout, at=clock())
    snapshot = await store.get_fleet_snapshot(layout.slug)
    if snapshot is None:
        raise AssertionError(f"fleet {layout.slug!r} was not stored")
    return snapshot


async def tick_until_settled(
    reconciler: Reconciler, ref: str, *, max_ticks: int = 60, pause_s: float = 0.02
) -> list[TickResult]:
    """Tick until no operation is in flight (or ``max_ticks``); returns every tick's result."""
    results: list[TickResult] = []
    for _ in range(max_ticks):
        result = await reconciler.tick(ref)
        results.append(result)
        if not result.in_flight:
            return results
        await asyncio.sleep(pause_s)
    raise AssertionError(f"still in flight after {max_ticks} ticks: {results[-1]}")


async def wait_training(
    client: SupervisorClient, url: str, state: TrainingRunState, *, timeout_s: float = 10
) -> None:
    """Poll the supervisor at ``url`` until every training run is in ``state``."""
    async with asyncio.timeout(timeout_s):
        while True:
            status = await client.status(url, timeout_s=2)
            runs = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
            if runs and all(r is not None and r.state is state for r in runs):
                return
            await asyncio.sleep(0.02)
