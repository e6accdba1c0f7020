"""Step executors driven directly: what a process that stood still mid-tick may and may not do.

A worker paused inside a tick resumes with the fleet snapshot it loaded before the pause, which
another process may have made stale by whole operations. The steps that decide who is active
(``switch_active``, ``demote_old_sleep``, ``sleep_vllm``) must read the route pointer itself.
Real supervisors and emulated vLLM servers (the local fleet) and a real SQLite store.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from haru_db import StateStore
from haru_protocol import (
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationStep,
    SlotKind,
)
from haru_server._clock import ManualClock
from haru_server._steps import Done, StepContext, StepTuning, route_guard_until, run_step
from haru_supervisor_client import SupervisorClient

pytestmark = pytest.mark.slow


def _domain_id(fleet: FleetSnapshot, slug: str) -> Any:
    return next(d.id for d in fleet.domains if d.slug == slug)


async def _promote(
    store: StateStore, fleet: FleetSnapshot, slug: str, clock: ManualClock
) -> Operation:
    op, created = await store.create_operation(
        fleet_id=fleet.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=_domain_id(fleet, slug),
        at=clock(),
    )
    assert created
    assert await store.claim_operation(op.id, first_step=OperationStep.STOP_TRAINING, at=clock())
    claimed = await store.get_operation(op.id)
    assert claimed is not None
    return claimed


def _context(
    store: StateStore,
    http: aiohttp.ClientSession,
    fleet: FleetSnapshot,
    op: Operation,
    step: OperationStep,
    clock: ManualClock,
) -> StepContext:
    target = fleet.domain(op.target_domain_id)
    assert target is not None
    return StepContext(
        store=store,
        client=SupervisorClient(http, token=None),
        tuning=StepTuning(settle_s=0.2, first_poll_s=0.01, max_poll_s=0.05),
        fleet=fleet,
        operation=op,
        step=step,
        target=target,
        now=clock(),
        remaining_ms=10_000,
        deadline=time.monotonic() + 10,
    )


async def _awake(http: aiohttp.ClientSession, url: str) -> list[bool | None]:
    status = await SupervisorClient(http, token=None).status(url, timeout_s=5)
    return [
        m.sleeping is False
        for s in status.slots
        if s.kind is SlotKind.INFERENCE
        for m in s.models or ()
    ]


async def test_switch_active_moves_the_pointer_a_stale_snapshot_says_moved(
    sqlite_store: StateStore,
    make_fleet: Any,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    local = await make_fleet()
    fleet = await helpers.seed(sqlite_store, local, clock)
    alpha, beta = _domain_id(fleet, "alpha"), _domain_id(fleet, "beta")
    assert fleet.active_domain_id == alpha
    op = await _promote(sqlite_store, fleet, "beta", clock)
    # The snapshot a paused worker kept says beta is active already; the store says alpha.
    stale = fleet.model_copy(update={"active_domain_id": beta})
    result = await run_step(
        _context(sqlite_store, http, stale, op, OperationStep.SWITCH_ACTIVE, clock)
    )
    assert isinstance(result, Done)
    pointer = await sqlite_store.get_fleet_route_pointer(str(fleet.id))
    assert pointer is not None
    assert pointer.active_domain_id == beta  # the flip really happened
    assert pointer.route_revision == fleet.route_revision + 1
    done = await sqlite_store.get_operation(op.id)
    assert done is not None
    assert done.routing_committed


async def test_demote_old_sleep_never_sleeps_the_domain_routing_names(
    sqlite_store: StateStore,
    make_fleet: Any,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    local = await make_fleet()
    fleet = await helpers.seed(sqlite_store, local, clock)
    alpha = fleet.domain(_domain_id(fleet, "alpha"))
    assert alpha is not None
    assert alpha.supervisor_url is not None
    assert all(await _awake(http, alpha.supervisor_url))
    # A promote of beta whose flip never landed (its worker stood still past the flip of a
    # later operation, say): routing still names alpha, the operation's source.
    op = await _promote(sqlite_store, fleet, "beta", clock)
    assert op.source_domain_id == alpha.id
    result = await run_step(
        _context(sqlite_store, http, fleet, op, OperationStep.DEMOTE_OLD_SLEEP, clock)
    )
    assert isinstance(result, Done)
    assert result.complete  # no demote_old_train beside an awake vLLM either
    assert result.detail.skipped
    assert all(await _awake(http, alpha.supervisor_url))  # alpha still serves


async def test_sleep_vllm_refuses_the_domain_routing_names_whatever_the_snapshot(
    sqlite_store: StateStore,
    make_fleet: Any,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    local = await make_fleet()
    fleet = await helpers.seed(sqlite_store, local, clock)
    alpha = fleet.domain(_domain_id(fleet, "alpha"))
    assert alpha is not None
    assert alpha.supervisor_url is not None
    op, created = await sqlite_store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=alpha.id, at=clock()
    )
    assert created
    assert await sqlite_store.claim_operation(
        op.id, first_step=OperationStep.SLEEP_VLLM, at=clock()
    )
    claimed = await sqlite_store.get_operation(op.id)
    assert claimed is not None
    op = claimed
    # A snapshot from before alpha became active again says beta is active.
    stale = fleet.model_copy(update={"active_domain_id": _domain_id(fleet, "beta")})
    result = await run_step(
        _context(sqlite_store, http, stale, op, OperationStep.SLEEP_VLLM, clock)
    )
    assert not isinstance(result, Done)
    assert all(await _awake(http, alpha.supervisor_url))


async def test_the_route_guard_counts_a_flip_from_the_future_from_now(
    sqlite_store: StateStore,
    make_fleet: Any,
    clock: ManualClock,
    helpers: Any,
) -> None:
    # A step start stored ahead of the database's clock (an older release, a clock fast
    # before the skew bound) counts as now, as the tick will rewrite it: the guard before
    # the former active sleeps is this process's own from now, not three hours on top.
    local = await make_fleet()
    fleet = await helpers.seed(sqlite_store, local, clock)
    op = await _promote(sqlite_store, fleet, "beta", clock)
    ahead = op.model_copy(update={"step_started_at": clock() + timedelta(hours=3)})
    tuning = StepTuning(route_guard_s=2.0)
    until = await route_guard_until(
        sqlite_store, tuning, fleet, ahead, OperationStep.DEMOTE_OLD_SLEEP, clock()
    )
    assert until == clock() + timedelta(seconds=2)
    on_time = op.model_copy(update={"step_started_at": clock() - timedelta(seconds=1)})
    until = await route_guard_until(
        sqlite_store, tuning, fleet, on_time, OperationStep.DEMOTE_OLD_SLEEP, clock()
    )
    assert until == clock() + timedelta(seconds=1)
