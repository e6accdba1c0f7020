"""Fixtures: an injectable clock, a local fleet (emulated vLLM + real supervisors), reconcilers.

The ``store`` / ``sqlite_store`` / ``postgres_store`` / ``database_url_factory`` fixtures come
from the haru_db pytest plugin (a freshly migrated database per test, on both engines).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet, LocalFleetOptions
from haru_protocol import FleetSnapshot, Operation, OperationState, PolicyPatch
from haru_server._clock import ManualClock
from haru_server._metrics import ServerMetrics
from haru_server._reconciler import Reconciler, ReconcilerOptions, TickResult
from haru_server._steps import StepTuning
from haru_supervisor_client import SupervisorClient

START = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
async def make_fleet(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[LocalFleet]]]:
    """``fleet = await make_fleet(**LocalFleetOptions fields)``: started, closed after the test."""
    started: list[LocalFleet] = []

    async def make(**options: Any) -> LocalFleet:
        fleet = LocalFleet(tmp_path / f"fleet-{len(started)}", LocalFleetOptions(**options))
        started.append(fleet)
        await fleet.start()
        return fleet

    yield make
    for fleet in reversed(started):
        await fleet.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


FAST_TUNING = StepTuning(settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05)


@pytest.fixture
def make_reconciler(clock: ManualClock, http: aiohttp.ClientSession) -> Callable[..., Reconciler]:
    def make(
        store: StateStore,
        *,
        token: str | None = None,
        chaining: bool = True,
        tuning: StepTuning = FAST_TUNING,
        heartbeat_timeout_s: float = 2.0,
        metrics: ServerMetrics | None = None,
    ) -> Reconciler:
        return Reconciler(
            store,
            SupervisorClient(http, token=token),
            clock=clock,
            options=ReconcilerOptions(
                chaining=chaining, tuning=tuning, heartbeat_timeout_s=heartbeat_timeout_s
            ),
            metrics=metrics,
        )

    return make


async def seed(
    store: StateStore,
    fleet: LocalFleet,
    clock: ManualClock,
    *,
    policy: PolicyPatch | None = None,
) -> FleetSnapshot:
    """Apply the local fleet's layout and return the stored snapshot."""
    await store.apply_fleet_layout(fleet.layout(policy=policy), at=clock())
    snapshot = await store.get_fleet_snapshot(fleet.options.slug)
    assert snapshot is not None
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


def finished(operation: Operation | None) -> bool:
    return operation is not None and operation.state not in (
        OperationState.PENDING,
        OperationState.RUNNING,
    )


@pytest.fixture
def helpers() -> Any:
    """The module-level helpers above, for tests (importlib mode forbids importing conftest)."""

    class Helpers:
        seed = staticmethod(seed)
        tick_until_settled = staticmethod(tick_until_settled)
        finished = staticmethod(finished)

    return Helpers
