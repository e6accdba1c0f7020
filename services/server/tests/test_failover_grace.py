"""An automatic failover stops the standby's trainers with its own short grace; a planned
promotion keeps the long one. The step records how each trainer stopped.

Real supervisors and ``haru-sim-trainer`` processes that ignore SIGTERM, so only SIGKILL at the
grace ends them; the reconcile clock is a :class:`ManualClock` (no budget runs out).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    EventType,
    FleetSnapshot,
    OperationKind,
    OperationStep,
    OperationStepDone,
    PolicyPatch,
)
from haru_server._clock import ManualClock
from haru_server._reconciler import Reconciler

SeededFleet = Callable[..., Awaitable[tuple[LocalFleet, FleetSnapshot, Reconciler]]]

STUBBORN = ("--step-ms", "20", "--checkpoint-every", "5", "--ignore-sigterm")
FAILOVER_GRACE_MS = 300
PLANNED_GRACE_MS = 1_500


async def _stop_training_done(
    store: StateStore, reconciler: Reconciler, fleet_id: Any
) -> OperationStepDone:
    """Tick until the promotion's ``stop_training`` step is done; its event."""
    for _ in range(200):
        for event in await store.list_events(fleet_id, limit=1000):
            data = event.data
            if isinstance(data, OperationStepDone) and data.step is OperationStep.STOP_TRAINING:
                return data
        await reconciler.tick("local")
    raise AssertionError("stop_training never finished")


async def test_an_automatic_failover_kills_the_trainers_at_its_short_grace(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    # The planned grace is ten minutes: the failover only finishes because it does not use it.
    policy = PolicyPatch(
        auto_failover=True,
        heartbeat_stale_ms=15_000,
        training_stop_grace_ms=600_000,
        failover_training_stop_grace_ms=FAILOVER_GRACE_MS,
    )
    fleet, seeded, reconciler = await seeded_fleet(
        store, trainer_args=STUBBORN, policy=policy, standby_training=True
    )
    await fleet.stop_supervisor("alpha")
    clock.advance(ms=16_000)
    done = await _stop_training_done(store, reconciler, seeded.id)
    assert done.automatic is True
    assert done.grace_ms == FAILOVER_GRACE_MS
    assert done.training_stops is not None
    assert {s.gpu_index for s in done.training_stops} == {0, 1}
    for stop in done.training_stops:
        assert stop.killed is True
        assert stop.stop_ms >= FAILOVER_GRACE_MS
    types = [e.type for e in await store.list_events(seeded.id, limit=1000)]
    assert types.count(EventType.OPERATION_AUTO_FAILOVER) == 1


async def test_a_planned_promotion_gives_the_trainers_the_long_grace(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    policy = PolicyPatch(
        auto_failover=True,
        training_stop_grace_ms=PLANNED_GRACE_MS,
        failover_training_stop_grace_ms=FAILOVER_GRACE_MS,
    )
    _, seeded, reconciler = await seeded_fleet(
        store, trainer_args=STUBBORN, policy=policy, standby_training=True
    )
    beta = next(d.id for d in seeded.domains if d.slug == "beta")
    _operation, created = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    assert created
    done = await _stop_training_done(store, reconciler, seeded.id)
    assert done.automatic is False
    assert done.grace_ms == PLANNED_GRACE_MS
    assert done.training_stops is not None
    assert {s.gpu_index for s in done.training_stops} == {0, 1}
    for stop in done.training_stops:
        assert stop.killed is True
        assert stop.stop_ms >= PLANNED_GRACE_MS
