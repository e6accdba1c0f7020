"""Evidence-based failure detection, tick by tick, against REAL supervisors and emulated vLLM.

Every domain runs a real supervisor on a 127.0.0.1 socket and every model an emulated vLLM
server on its own socket. A "killed" vLLM is a server whose listening socket is gone (new
connects get ECONNREFUSED, exactly what a SIGKILLed process leaves). Time is the injected
clock: every case is counted in ticks and clock advances, never in wall time. The policy is
the default one with only ``autoFailover`` on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    DomainState,
    EventType,
    FleetSnapshot,
    OperationKind,
    PolicyPatch,
)
from haru_server._clock import ManualClock
from haru_server._metrics import ServerMetrics
from haru_server._reconciler import Reconciler
from prometheus_client import CollectorRegistry

SeededFleet = Callable[..., Awaitable[tuple[LocalFleet, FleetSnapshot, Reconciler]]]

DEFAULT_AUTO = PolicyPatch(auto_failover=True)
"""The default policy, with only automatic failover turned on."""


def gauge(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def state_of(snapshot: FleetSnapshot, slug: str) -> DomainState:
    return next(d.state for d in snapshot.domains if d.slug == slug)


def id_of(snapshot: FleetSnapshot, slug: str) -> Any:
    return next(d.id for d in snapshot.domains if d.slug == slug)


async def snapshot(store: StateStore) -> FleetSnapshot:
    found = await store.get_fleet_snapshot("local")
    assert found is not None
    return found


async def escalations(store: StateStore, fleet_id: Any) -> list[dict[str, Any]]:
    return [
        e.payload
        for e in await store.list_events(fleet_id, limit=1000)
        if e.type == EventType.DOMAIN_DEGRADED_ESCALATED
    ]


async def started(
    seeded_fleet: SeededFleet, store: StateStore, *, metrics: ServerMetrics | None = None
) -> tuple[LocalFleet, FleetSnapshot, Reconciler]:
    fleet, seeded, reconciler = await seeded_fleet(
        store, training_gpus=(), policy=DEFAULT_AUTO, metrics=metrics
    )
    first = await reconciler.tick("local")
    assert first.operation is None
    assert state_of(await snapshot(store), "alpha") is DomainState.READY
    return fleet, seeded, reconciler


async def test_a_killed_vllm_fails_over_after_the_confirmation_not_the_grace(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    fleet, seeded, reconciler = await started(seeded_fleet, store)
    confirm_ms = seeded.policy.dead_confirm_ms
    assert confirm_ms < seeded.policy.degraded_grace_ms
    for sim in fleet.domain("alpha").sims.values():
        await sim.stop()  # the process is gone: nothing listens on its port

    # First proof: degraded, and the loop is told to come back for a fresh heartbeat.
    result = await reconciler.tick("local")
    assert result.operation is None
    assert result.confirming
    assert state_of(await snapshot(store), "alpha") is DomainState.DEGRADED
    clock.advance(ms=confirm_ms - 1)
    result = await reconciler.tick("local")
    assert result.operation is None  # proven again, but not for deadConfirmMs yet
    assert result.confirming

    clock.advance(ms=1)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.kind is OperationKind.PROMOTE
    assert result.operation.target_domain_id == id_of(seeded, "beta")
    after = await snapshot(store)
    assert after.active_domain_id == id_of(seeded, "beta")
    assert state_of(after, "alpha") is DomainState.FAILED
    [escalated] = await escalations(store, seeded.id)
    assert set(escalated["deadModels"]) == set(fleet.domain("alpha").sims)
    assert escalated["deadConfirmMs"] == confirm_ms
    events = await store.list_events(seeded.id, limit=1000)
    [auto] = [e for e in events if e.type == EventType.OPERATION_AUTO_FAILOVER]
    assert auto.payload["reason"] == "active_failed"


async def test_a_vllm_back_within_the_confirmation_does_not_fail_over(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await started(seeded_fleet, store)
    sims = list(fleet.domain("alpha").sims.values())
    confirm_ms = seeded.policy.dead_confirm_ms
    for sim in sims:
        await sim.set_faults(refuse=True)
    assert (await reconciler.tick("local")).confirming
    for sim in sims:
        await sim.set_faults(refuse=False)  # restarted on the same port
    clock.advance(ms=confirm_ms)
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.confirming
    assert state_of(await snapshot(store), "alpha") is DomainState.READY
    # Down again: the earlier proof does not count, the confirmation starts over.
    for sim in sims:
        await sim.set_faults(refuse=True)
    clock.advance(ms=confirm_ms)
    result = await reconciler.tick("local")
    assert result.operation is None
    assert result.confirming
    assert await escalations(store, seeded.id) == []


async def test_the_confirmation_needs_a_fresh_answer_from_the_supervisor(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await started(seeded_fleet, store)
    for sim in fleet.domain("alpha").sims.values():
        await sim.set_faults(refuse=True)
    assert (await reconciler.tick("local")).confirming
    await fleet.stop_supervisor("alpha")  # no second proof can come
    for sim in fleet.domain("alpha").sims.values():
        # Its servers accept connections again: nor is the host proven gone.
        await sim.set_faults(refuse=False)
    clock.advance(ms=seeded.policy.dead_confirm_ms * 5)
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.confirming
    assert state_of(await snapshot(store), "alpha") is DomainState.DEGRADED
    assert await escalations(store, seeded.id) == []


async def test_a_slow_vllm_degrades_without_a_fast_failover(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    # The supervisor waits on the hung servers longer than the heartbeat waits for it.
    fleet, seeded, reconciler = await seeded_fleet(
        store, training_gpus=(), policy=DEFAULT_AUTO, heartbeat_timeout_s=0.3
    )
    await reconciler.tick("local")
    sims = list(fleet.domain("alpha").sims.values())
    for sim in sims:
        await sim.set_faults(hang=True)
    for _ in range(3):
        result = await reconciler.tick("local")
        assert result.operation is None
        assert not result.confirming
        clock.advance(ms=seeded.policy.dead_confirm_ms * 10)
    result = await reconciler.tick("local")
    assert result.operation is None
    assert state_of(await snapshot(store), "alpha") is DomainState.DEGRADED
    assert await escalations(store, seeded.id) == []
    for sim in sims:
        await sim.set_faults(hang=False)


async def test_one_dead_model_of_several_keeps_the_grace(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await started(seeded_fleet, store)
    await fleet.domain("alpha").sims["example-chat-large"].stop()
    policy = seeded.policy
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.confirming  # the other models still serve: no proof
    assert state_of(await snapshot(store), "alpha") is DomainState.DEGRADED
    clock.advance(ms=policy.degraded_grace_ms)
    result = await reconciler.tick("local")
    assert result.operation is None  # exactly the grace: not yet
    clock.advance(ms=1)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.target_domain_id == id_of(seeded, "beta")
    [escalated] = await escalations(store, seeded.id)
    assert "deadModels" not in escalated


async def test_a_server_that_reaches_no_domain_judges_nothing_and_never_fails_over(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    metrics = ServerMetrics(CollectorRegistry())
    fleet, seeded, reconciler = await started(seeded_fleet, store, metrics=metrics)
    # Everything of the active is gone (supervisor and servers refuse), but so is every
    # other domain: from here that is this server's own network.
    for sim in fleet.domain("alpha").sims.values():
        await sim.stop()
    await fleet.stop_supervisor("alpha")
    await fleet.stop_supervisor("beta")
    policy = seeded.policy
    for advance_ms in (0, policy.heartbeat_stale_ms + 1, policy.degraded_grace_ms + 1):
        clock.advance(ms=advance_ms)
        result = await reconciler.tick("local")
        assert result.operation is None
        now = await snapshot(store)
        assert now.active_domain_id == id_of(seeded, "alpha")
        assert (state_of(now, "alpha"), state_of(now, "beta")) == (
            DomainState.READY,
            DomainState.READY,
        )
    assert gauge(metrics, "haru_reconcile_partitioned", fleet="local") == 1
    cut_off = [e.type for e in await store.list_events(seeded.id, limit=1000)]
    assert EventType.DOMAIN_DEAD_SUSPECTED not in cut_off
    await fleet.restart_supervisor("alpha")
    await fleet.restart_supervisor("beta")
    result = await reconciler.tick("local")
    assert result.operation is None
    assert (await snapshot(store)).active_domain_id == id_of(seeded, "alpha")
    assert gauge(metrics, "haru_reconcile_partitioned", fleet="local") == 0
    types = [e.type for e in await store.list_events(seeded.id, limit=1000)]
    assert EventType.OPERATION_AUTO_FAILOVER not in types
    assert EventType.DOMAIN_HEARTBEAT_FAILED not in types
    # Visible to every replica and operator: once when it began, once when it ended.
    partition = [
        t for t in types if t in (EventType.SERVER_PARTITIONED, EventType.SERVER_PARTITION_HEALED)
    ]
    assert partition == [EventType.SERVER_PARTITIONED, EventType.SERVER_PARTITION_HEALED]


async def test_a_dead_active_without_a_viable_standby_is_not_failed_nor_polled_at_the_busy_pace(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await started(seeded_fleet, store)
    await fleet.stop_supervisor("beta")
    for sim in fleet.domain("alpha").sims.values():
        await sim.stop()
    assert (await reconciler.tick("local")).confirming
    clock.advance(ms=seeded.policy.dead_confirm_ms)
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.confirming  # back to the regular ticks
    after = await snapshot(store)
    assert (state_of(after, "alpha"), after.active_domain_id) == (
        DomainState.DEGRADED,
        id_of(seeded, "alpha"),
    )
    assert await escalations(store, seeded.id) == []


# ---- a lost host ----


async def test_a_lost_host_fails_over_after_the_confirmation_not_the_staleness(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    metrics = ServerMetrics(CollectorRegistry())
    fleet, seeded, reconciler = await started(seeded_fleet, store, metrics=metrics)
    confirm_ms = seeded.policy.dead_confirm_ms
    assert confirm_ms < seeded.policy.heartbeat_stale_ms
    # The host is gone: its supervisor and every server refuse connections; beta answers.
    await fleet.stop_supervisor("alpha")
    for sim in fleet.domain("alpha").sims.values():
        await sim.stop()

    result = await reconciler.tick("local")
    assert result.operation is None
    assert result.confirming  # a fresh observation now, not the next regular tick
    assert state_of(await snapshot(store), "alpha") is DomainState.DEGRADED
    events = await store.list_events(seeded.id, limit=1000)
    [suspected] = [e for e in events if e.type == EventType.DOMAIN_DEAD_SUSPECTED]
    assert suspected.domain_id == id_of(seeded, "alpha")
    assert suspected.payload["evidence"] == "host_unreachable"
    assert suspected.payload["endpoints"] == len(fleet.domain("alpha").sims)
    assert set(suspected.payload["models"]) == set(fleet.domain("alpha").sims)

    clock.advance(ms=confirm_ms - 1)
    result = await reconciler.tick("local")
    assert result.operation is None
    clock.advance(ms=1)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.kind is OperationKind.PROMOTE
    assert result.operation.target_domain_id == id_of(seeded, "beta")
    after = await snapshot(store)
    assert after.active_domain_id == id_of(seeded, "beta")
    [escalated] = await escalations(store, seeded.id)
    assert escalated["evidence"] == "host_unreachable"
    assert escalated["deadConfirmMs"] == confirm_ms
    assert (
        metrics.registry.get_sample_value(
            "haru_reconcile_dead_suspected_total",
            {"fleet": "local", "evidence": "host_unreachable", "outcome": "confirmed"},
        )
        == 1
    )


async def test_a_lost_supervisor_whose_servers_still_listen_keeps_the_staleness(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    metrics = ServerMetrics(CollectorRegistry())
    fleet, seeded, reconciler = await started(seeded_fleet, store, metrics=metrics)
    await fleet.stop_supervisor("alpha")  # the servers still listen: they may still serve
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.confirming
    assert state_of(await snapshot(store), "alpha") is DomainState.DEGRADED
    clock.advance(ms=seeded.policy.dead_confirm_ms * 5)
    result = await reconciler.tick("local")
    assert result.operation is None
    types = [e.type for e in await store.list_events(seeded.id, limit=1000)]
    assert EventType.DOMAIN_DEAD_SUSPECTED not in types
    assert await escalations(store, seeded.id) == []
    weak = metrics.registry.get_sample_value(
        "haru_reconcile_weak_evidence_total", {"fleet": "local", "kind": "heartbeat_unreachable"}
    )
    assert weak == 2


async def test_a_host_back_within_the_confirmation_is_cleared_not_failed(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await started(seeded_fleet, store)
    sims = list(fleet.domain("alpha").sims.values())
    await fleet.stop_supervisor("alpha")
    for sim in sims:
        await sim.set_faults(refuse=True)
    assert (await reconciler.tick("local")).confirming
    await fleet.restart_supervisor("alpha")
    for sim in sims:
        await sim.set_faults(refuse=False)
    clock.advance(ms=seeded.policy.dead_confirm_ms)
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.confirming
    events = await store.list_events(seeded.id, limit=1000)
    kinds = [e.type for e in events if e.type.startswith("domain.dead_")]
    assert kinds == [EventType.DOMAIN_DEAD_SUSPECTED, EventType.DOMAIN_DEAD_CLEARED]
    assert await escalations(store, seeded.id) == []
