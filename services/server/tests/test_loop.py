"""The background loop: independent fleets, no self-overlap, quick re-ticks, kicks, boot warning."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from uuid import UUID

import aiohttp
import pytest
from aiohttp import web
from haru_core import lease_guard_ms
from haru_db import StateStore, StateStoreUnavailableError
from haru_db.testing import confirm_domains
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    FleetLayout,
    Operation,
    OperationKind,
    OperationState,
    OperationStep,
    load_example_layout,
)
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._keys import control_plane_key
from haru_server._loop import LoopOptions, ReconcileLoop
from haru_server._reconciler import Accepted, Reconciler, TickResult
from haru_server._settings import Settings
from pytest_aiohttp import AiohttpClient, AiohttpServer

MakeFleet = Callable[..., Awaitable[LocalFleet]]


class Recording(Reconciler):
    """Counts ticks per fleet and notices a fleet ticking twice at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ticks: Counter[str] = Counter()
        self.running: set[str] = set()
        self.overlaps = 0
        self.ticked = asyncio.Event()

    async def tick(
        self, fleet_ref: str, *, pending_first: bool = False, start: Accepted | None = None
    ) -> TickResult:
        if fleet_ref in self.running:
            self.overlaps += 1
        self.running.add(fleet_ref)
        try:
            return await super().tick(fleet_ref, pending_first=pending_first, start=start)
        finally:
            self.running.discard(fleet_ref)
            self.ticks[fleet_ref] += 1
            self.ticked.set()


async def wait_for(predicate: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
async def hanging_supervisor(aiohttp_server: AiohttpServer) -> AsyncIterator[str]:
    """A supervisor that accepts connections and never answers."""
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({}, status=503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    server = await aiohttp_server(app)
    yield str(server.make_url("/"))
    release.set()


def stuck_layout(url: str) -> FleetLayout:
    example = load_example_layout()
    domains = tuple(d.model_copy(update={"supervisor_url": url}) for d in example.domains)
    return example.model_copy(update={"slug": "stuck", "domains": domains})


def recording(
    store: StateStore, clock: ManualClock, http: aiohttp.ClientSession, **options: Any
) -> Recording:
    from haru_server._reconciler import ReconcilerOptions
    from haru_supervisor_client import SupervisorClient

    return Recording(
        store, SupervisorClient(http, token=None), clock=clock, options=ReconcilerOptions(**options)
    )


async def test_a_slow_fleet_never_delays_another(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
    hanging_supervisor: str,
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=())
    fast = await helpers.seed(store, fleet, clock)
    await store.apply_fleet_layout(stuck_layout(hanging_supervisor), at=clock())
    stuck = await store.get_fleet_snapshot("stuck")
    assert stuck is not None
    reconciler = recording(store, clock, http, heartbeat_timeout_s=30)
    # The stuck tick is cancelled at stop rather than waited for.
    loop = ReconcileLoop(reconciler, store, LoopOptions(interval_s=0.02, stop_grace_s=0.1))
    loop.start()
    try:
        await wait_for(lambda: reconciler.ticks[str(fast.id)] >= 5)
        # The stuck fleet's first tick is still waiting on its supervisor.
        assert reconciler.ticks[str(stuck.id)] == 0
        assert str(stuck.id) in reconciler.running
        assert loop.fleet_ids == {fast.id, stuck.id}
    finally:
        await loop.stop()
    assert reconciler.overlaps == 0


async def test_kicks_coalesce_and_a_fleet_never_overlaps_itself(
    sqlite_store: StateStore,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    hanging_supervisor: str,
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(stuck_layout(hanging_supervisor), at=clock())
    stuck = await store.get_fleet_snapshot("stuck")
    assert stuck is not None
    reconciler = recording(store, clock, http, heartbeat_timeout_s=0.3)
    loop = ReconcileLoop(reconciler, store, LoopOptions(interval_s=60, kick_gap_s=0.01))
    loop.start()
    try:
        await wait_for(lambda: str(stuck.id) in reconciler.running)
        for _ in range(200):
            loop.kick(stuck.id)
            await asyncio.sleep(0)
        # One tick was running during the flood; the flood caused exactly one more, and once
        # that one has ended no kick is left for a third (the next is `interval_s` away).
        await wait_for(
            lambda: reconciler.ticks[str(stuck.id)] >= 2 and str(stuck.id) not in reconciler.running
        )
        assert not loop.kick_pending(stuck.id)
        assert reconciler.ticks[str(stuck.id)] == 2
    finally:
        await loop.stop()
    assert reconciler.overlaps == 0


async def test_in_flight_operation_reticks_quickly_and_kick_reaches_new_fleets(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=())
    for sim in fleet.domain("beta").sims.values():
        await sim.set_faults(wake_fails=True)
    reconciler = recording(store, clock, http)
    loop = ReconcileLoop(
        reconciler, store, LoopOptions(interval_s=60, busy_interval_s=0.02, kick_gap_s=0.01)
    )
    loop.start()
    try:
        await asyncio.sleep(0.05)
        # Seeded after the loop's first discovery: a kick finds it at once.
        snapshot = await helpers.seed(store, fleet, clock)
        await store.create_operation(
            fleet_id=snapshot.id,
            kind=OperationKind.PROMOTE,
            target_domain_id=next(d.id for d in snapshot.domains if d.slug == "beta"),
            at=clock(),
        )
        loop.kick(snapshot.id)
        # The wake never succeeds, so the operation stays in flight: re-ticked quickly,
        # far more often than the 60 s interval would allow.
        await wait_for(lambda: reconciler.ticks[str(snapshot.id)] >= 4)
    finally:
        await loop.stop()


async def test_configured_fleets_only_and_missing_ones_warned(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=())
    snapshot = await helpers.seed(store, fleet, clock)
    await store.apply_fleet_layout(load_example_layout(), at=clock())
    reconciler = recording(store, clock, http)
    loop = ReconcileLoop(
        reconciler, store, LoopOptions(interval_s=0.05, fleets=("local", "not-seeded"))
    )
    with caplog.at_level(logging.WARNING, logger="haru_server"):
        loop.start()
        try:
            await wait_for(lambda: reconciler.ticks[str(snapshot.id)] >= 2)
            assert loop.fleet_ids == {snapshot.id}
        finally:
            await loop.stop()
    missing = [r for r in caplog.records if "not-seeded" in r.getMessage()]
    assert len(missing) == 1


async def test_promote_through_the_api_is_driven_by_the_kicked_loop(
    store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    helpers: Any,
    aiohttp_client: AiohttpClient,
) -> None:
    fleet = await make_fleet(training_gpus=())
    await helpers.seed(store, fleet, clock)
    # Confirmed as the first heartbeat would (the loop's first tick may come after the POST).
    await confirm_domains(store, "local", at=clock())
    snapshot = await store.get_fleet_snapshot("local")
    assert snapshot is not None
    # An interval far longer than the test: only the kick and the quick re-ticks can finish it.
    settings = Settings(reconcile_interval_ms=600_000)
    app = create_app(settings, store=store, clock=clock, busy_interval_s=0.02)
    client = await aiohttp_client(app)
    assert isinstance(app[control_plane_key].loop, ReconcileLoop)
    beta = next(d.id for d in snapshot.domains if d.slug == "beta")
    response = await client.post("/v1/fleets/local/promote", json={"targetDomainId": str(beta)})
    assert response.status == 202
    operation_id = UUID((await response.json())["operation"]["id"])

    async def operation() -> Operation:
        found = await store.get_operation(operation_id)
        assert found is not None
        return found

    # The loop re-ticks the pending demote until the route guard has passed on its clock.
    async with asyncio.timeout(20):
        while (await operation()).current_step is not OperationStep.DEMOTE_OLD_SLEEP:
            await asyncio.sleep(0.02)
    clock.advance(ms=lease_guard_ms(settings.route_lease_ms))
    async with asyncio.timeout(20):
        while (await operation()).state is not OperationState.SUCCEEDED:
            await asyncio.sleep(0.02)
    after = await store.get_fleet_snapshot("local")
    assert after is not None
    assert after.active_domain_id == beta


async def test_boot_warns_when_auto_failover_has_no_loop(
    store: StateStore,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    aiohttp_client: AiohttpClient,
) -> None:
    await store.apply_fleet_layout(load_example_layout(), at=clock())  # autoFailover: true
    with caplog.at_level(logging.WARNING, logger="haru_server"):
        app = create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
        client = await aiohttp_client(app)
    warnings = [r for r in caplog.records if "autoFailover is ON" in r.getMessage()]
    assert len(warnings) == 1
    assert "example" in warnings[0].getMessage()
    plane = app[control_plane_key]
    assert plane.loop is None
    # Without a loop, kicks are dropped without blocking or failing.
    plane.kick(UUID(int=1))
    assert (await client.get("/healthz")).status == 200


async def test_no_boot_warning_with_a_loop(
    store: StateStore,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    aiohttp_client: AiohttpClient,
) -> None:
    await store.apply_fleet_layout(load_example_layout(), at=clock())
    with caplog.at_level(logging.WARNING, logger="haru_server"):
        await aiohttp_client(
            create_app(Settings(reconcile_interval_ms=600_000), store=store, clock=clock)
        )
    assert not [r for r in caplog.records if "autoFailover is ON" in r.getMessage()]


async def test_a_proof_of_a_dead_active_is_confirmed_by_quick_fresh_heartbeats(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    from haru_protocol import PolicyPatch

    store = sqlite_store
    fleet = await make_fleet(training_gpus=())
    snapshot = await helpers.seed(store, fleet, clock, policy=PolicyPatch(auto_failover=True))
    beta = next(d.id for d in snapshot.domains if d.slug == "beta")
    reconciler = recording(store, clock, http)
    ref = str(snapshot.id)
    loop = ReconcileLoop(
        reconciler, store, LoopOptions(interval_s=60, busy_interval_s=0.02, kick_gap_s=0.01)
    )
    loop.start()
    try:
        await wait_for(lambda: reconciler.ticks[ref] >= 1)
        for sim in fleet.domain("alpha").sims.values():
            await sim.stop()
        loop.kick(snapshot.id)  # the one tick that sees the first proof
        seen = reconciler.ticks[ref]
        # Confirming: fresh heartbeats far more often than the 60 s interval would allow.
        await wait_for(lambda: reconciler.ticks[ref] >= seen + 4)
        clock.advance(ms=snapshot.policy.dead_confirm_ms)

        async def moved() -> None:
            while True:
                now = await store.get_fleet_snapshot(ref)
                assert now is not None
                if now.active_domain_id == beta:
                    return
                await asyncio.sleep(0.02)

        await asyncio.wait_for(moved(), timeout=10)
    finally:
        await loop.stop()
    assert reconciler.overlaps == 0


class Unavailable(Recording):
    """Every tick fails as on a store that does not answer, while ``down`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.down = True

    async def tick(
        self, fleet_ref: str, *, pending_first: bool = False, start: Accepted | None = None
    ) -> TickResult:
        if self.down:
            self.ticks[fleet_ref] += 1
            raise StateStoreUnavailableError("state store x unavailable: no answer within 5 s")
        return await super().tick(fleet_ref, pending_first=pending_first, start=start)


async def test_a_persisting_store_failure_is_warned_again_then_its_recovery_timed(
    sqlite_store: StateStore,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    hanging_supervisor: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = sqlite_store
    await store.apply_fleet_layout(stuck_layout(hanging_supervisor), at=clock())
    from haru_server._reconciler import ReconcilerOptions
    from haru_supervisor_client import SupervisorClient

    reconciler = Unavailable(
        store,
        SupervisorClient(http, token=None),
        clock=clock,
        options=ReconcilerOptions(heartbeat_timeout_s=0.05),
    )
    loop = ReconcileLoop(
        reconciler, store, LoopOptions(interval_s=0.01, kick_gap_s=0.0, repeat_warning_s=0.05)
    )

    def logged(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="haru_server"):
        loop.start()
        try:
            # The same failure, tick after tick: warned at its start, then again while it lasts.
            await wait_for(lambda: len(logged("no tick succeeded for")) >= 2)
            assert len(logged("no answer within 5 s")) >= 3
            reconciler.down = False
            await wait_for(lambda: bool(logged("recovered after")))
        finally:
            await loop.stop()
    assert len(logged("unavailable: state store x")) - len(logged("no tick succeeded")) == 1
