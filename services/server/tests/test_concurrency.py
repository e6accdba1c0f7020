"""Several reconcilers (separate engines, like separate processes) racing one fleet on PG."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import EventType, OperationKind, OperationState, OperationStep
from haru_server._clock import ManualClock
from haru_server._reconciler import Reconciler, ReconcilerOptions
from haru_server._steps import StepTuning
from haru_supervisor_client import SupervisorClient

MakeFleet = Callable[..., Awaitable[LocalFleet]]
UrlFactory = Callable[[], Awaitable[str]]

RACERS = 4


async def test_racing_reconcilers_promote_exactly_once(
    postgres_url_factory: UrlFactory, make_fleet: MakeFleet, clock: ManualClock, helpers: Any
) -> None:
    url = await postgres_url_factory()
    stores = [StateStore.open(url) for _ in range(RACERS)]
    sessions = [aiohttp.ClientSession() for _ in range(RACERS)]
    try:
        fleet = await make_fleet()
        seeded = await helpers.seed(stores[0], fleet, clock)
        beta = next(d.id for d in seeded.domains if d.slug == "beta")
        reconcilers = [
            Reconciler(
                store,
                SupervisorClient(session, token=None),
                clock=clock,
                options=ReconcilerOptions(tuning=helpers_tuning()),
            )
            for store, session in zip(stores, sessions, strict=True)
        ]
        # Every racer both requests the promotion and ticks: one operation, joined by all.
        created = await asyncio.gather(
            *(
                store.create_operation(
                    fleet_id=seeded.id,
                    kind=OperationKind.PROMOTE,
                    target_domain_id=beta,
                    at=clock(),
                )
                for store in stores
            )
        )
        assert sum(1 for _, was_created in created if was_created) == 1
        assert len({operation.id for operation, _ in created}) == 1
        operation_id = created[0][0].id

        async def race(reconciler: Reconciler) -> None:
            for _ in range(200):
                await reconciler.tick(str(seeded.id))
                current = await stores[0].get_operation(operation_id)
                assert current is not None
                if current.state not in (OperationState.PENDING, OperationState.RUNNING):
                    return
                await asyncio.sleep(0.005)
            raise AssertionError("the operation never ended")

        await asyncio.gather(*(race(r) for r in reconcilers))

        final = await stores[1].get_operation(operation_id)
        assert final is not None
        assert final.state is OperationState.SUCCEEDED, final.error
        snapshot = await stores[2].get_fleet_snapshot("local")
        assert snapshot is not None
        assert snapshot.active_domain_id == beta
        assert snapshot.route_revision == seeded.route_revision + 1
        events = await stores[3].list_events(seeded.id, limit=1000)
        types = Counter(e.type for e in events)
        assert types[EventType.ROUTING_SWITCHED] == 1
        assert types[EventType.OPERATION_STARTED] == 1
        assert types[EventType.OPERATION_SUCCEEDED] == 1
        assert types[EventType.OPERATION_FAILED] == 0
        done = Counter(e.payload["step"] for e in events if e.type == EventType.OPERATION_STEP_DONE)
        assert done == Counter(step.value for step in list(OperationStep)[:7])
        assert await stores[0].get_in_flight_operation(seeded.id) is None
    finally:
        for session in sessions:
            await session.close()
        for store in stores:
            await store.close()


def helpers_tuning() -> StepTuning:
    return StepTuning(settle_s=0.3, first_poll_s=0.01, max_poll_s=0.05)
