"""The reconcile tick against REAL supervisors, emulated vLLM servers and emulated trainers.

Every domain runs a real supervisor app on a 127.0.0.1 socket; every model an emulated vLLM
server on its own socket; trainers are real ``haru-sim-trainer`` processes stopped with real
signals. Budgets run on an injected clock.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import Any
from uuid import UUID

import aiohttp
import pytest
from haru_core import lease_guard_ms
from haru_db import StateStore, StateStoreUnavailableError
from haru_db.testing import confirm_domains
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    DomainState,
    EventType,
    FleetRef,
    FleetSnapshot,
    InferenceSlotSpec,
    Operation,
    OperationErrorCode,
    OperationKind,
    OperationState,
    OperationStep,
    PolicyPatch,
    SlotKind,
    SupervisorStatus,
    TrainingRunState,
)
from haru_server._clock import ManualClock
from haru_server._metrics import ServerMetrics
from haru_server._reconciler import Accepted, Reconciler, ReconcilerOptions
from haru_server._steps import StepTuning
from haru_sim import read_trainer_checkpoint
from haru_supervisor.api import process_name
from haru_supervisor_client import SupervisorClient

MakeFleet = Callable[..., Awaitable[LocalFleet]]
MakeReconciler = Callable[..., Reconciler]
SeededFleet = Callable[..., Awaitable[tuple[LocalFleet, FleetSnapshot, Reconciler]]]


def states(snapshot: FleetSnapshot, slug: str) -> tuple[DomainState, list[str], list[str]]:
    domain = next(d for d in snapshot.domains if d.slug == slug)
    inference = [s.state.value for s in domain.slots if s.kind is SlotKind.INFERENCE]
    training = [s.state.value for s in domain.slots if s.kind is SlotKind.TRAINING]
    return domain.state, inference, training


def domain_id(snapshot: FleetSnapshot, slug: str) -> UUID:
    return next(d.id for d in snapshot.domains if d.slug == slug)


async def snapshot_of(store: StateStore, ref: str = "local") -> FleetSnapshot:
    snapshot = await store.get_fleet_snapshot(ref)
    assert snapshot is not None
    return snapshot


async def event_types(store: StateStore, fleet_id: UUID) -> list[str]:
    return [e.type for e in await store.list_events(fleet_id, limit=1000)]


def last_heard(snapshot: FleetSnapshot) -> set[datetime | None]:
    """When the heartbeat rounds last heard each domain (one value: all heard together)."""
    return {d.last_seen_at for d in snapshot.domains}


async def test_a_kicked_tick_drives_a_just_accepted_operation_before_any_heartbeat(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    _, seeded, reconciler = await seeded_fleet(store, chaining=False, standby_training=True)
    heard_at = clock()  # the set-up's tick heard every domain
    beta = domain_id(seeded, "beta")
    pending, created = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    assert created
    clock.advance(ms=1)
    # The kick of an accepted promote: its first step runs with no heartbeat round first.
    first = await reconciler.tick("local", pending_first=True)
    assert last_heard(await snapshot_of(store)) == {heard_at}
    assert first.operation is not None
    assert first.operation.id == pending.id
    assert first.operation.state is OperationState.RUNNING
    # Without chaining: one step (the trainers' stop may be proven within it).
    assert first.operation.current_step in (OperationStep.STOP_TRAINING, OperationStep.VERIFY_GPU)
    # A kick while it runs (a passive failure seen by the proxy) is a whole tick: kicks
    # never starve the heartbeats.
    clock.advance(ms=1)
    await reconciler.tick("local", pending_first=True)
    assert last_heard(await snapshot_of(store)) == {clock()}
    await helpers.tick_until_settled(reconciler, "local")
    done = await store.get_operation(pending.id)
    assert done is not None
    assert done.state is OperationState.SUCCEEDED
    assert (await snapshot_of(store)).active_domain_id == beta


class FleetReadsFailStore(StateStore):
    """A store whose fleet and in-flight-operation reads fail while ``failing`` is set."""

    failing = False

    def _check(self) -> None:
        if self.failing:
            raise StateStoreUnavailableError("fleet reads fail (a test fault)")

    async def get_fleet_snapshot(self, ref: str | FleetRef) -> FleetSnapshot | None:
        self._check()
        return await super().get_fleet_snapshot(ref)

    async def get_in_flight_operation(self, fleet_id: UUID) -> Operation | None:
        self._check()
        return await super().get_in_flight_operation(fleet_id)


async def test_a_kick_that_brings_the_accepted_operation_starts_it_without_reading_the_fleet(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    # The kick carries the request's snapshot and operation: the promotion starts even while
    # the fleet cannot be read, and no supervisor is polled for a heartbeat first.
    faulty = FleetReadsFailStore.open(store.url)
    try:
        assert isinstance(faulty, FleetReadsFailStore)
        _, seeded, reconciler = await seeded_fleet(faulty, chaining=False, standby_training=True)
        heard_at = clock()
        validated = await snapshot_of(faulty)  # what the API read to validate the request
        beta = domain_id(seeded, "beta")
        pending, created = await faulty.create_operation(
            fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
        )
        assert created
        clock.advance(ms=1)
        faulty.failing = True
        first = await reconciler.tick(
            "local", pending_first=True, start=Accepted(fleet=validated, operation=pending)
        )
        assert first.operation is not None
        assert first.operation.id == pending.id
        assert first.operation.state is OperationState.RUNNING
        # A kick without the request's snapshot has to read the fleet: the fault stops it.
        with pytest.raises(StateStoreUnavailableError):
            await reconciler.tick("local", pending_first=True)
        faulty.failing = False
        assert last_heard(await snapshot_of(faulty)) == {heard_at}
        await helpers.tick_until_settled(reconciler, "local")
        done = await faulty.get_operation(pending.id)
        assert done is not None
        assert done.state is OperationState.SUCCEEDED
        assert (await snapshot_of(faulty)).active_domain_id == beta
    finally:
        await faulty.close()


async def test_an_accepted_operation_already_started_elsewhere_is_left_to_its_tick(
    store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    # Another replica claimed the operation first: the kick's copy says pending, the claim
    # CAS loses, and the tick reports the operation as it is now.
    _, seeded, reconciler = await seeded_fleet(store, chaining=False, standby_training=True)
    other = make_reconciler(store, chaining=False)
    validated = await snapshot_of(store)
    beta = domain_id(seeded, "beta")
    pending, _ = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    claimed = await other.tick("local")
    assert claimed.operation is not None
    assert claimed.operation.state is OperationState.RUNNING
    late = await reconciler.tick(
        "local", pending_first=True, start=Accepted(fleet=validated, operation=pending)
    )
    assert late.operation is not None
    assert late.operation.id == pending.id
    assert late.operation.state is not OperationState.PENDING
    started = [
        e
        for e in await store.list_events(seeded.id, limit=1000)
        if e.type == EventType.OPERATION_STARTED
    ]
    assert len(started) == 1
    await helpers.tick_until_settled(reconciler, "local")
    assert (await snapshot_of(store)).active_domain_id == beta


async def test_first_tick_mirrors_the_layout_posture(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    _, seeded, reconciler = await seeded_fleet(store)
    assert seeded.active_domain_id == domain_id(seeded, "alpha")
    result = await reconciler.tick("local")
    assert result.operation is None
    assert not result.in_flight
    snapshot = await snapshot_of(store)
    assert states(snapshot, "alpha") == (
        DomainState.READY,
        ["serving", "serving"],
        ["idle", "idle"],
    )
    assert states(snapshot, "beta") == (
        DomainState.READY,
        ["sleeping", "sleeping"],
        ["idle", "idle"],
    )
    assert all(d.last_seen_at == clock() for d in snapshot.domains)


async def test_full_promotion(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    fleet, seeded, reconciler = await seeded_fleet(store, standby_training=True)
    before = await snapshot_of(store)
    assert states(before, "beta") == (
        DomainState.READY,
        ["sleeping", "sleeping"],
        ["training", "training"],
    )
    trained = {}
    for directory in fleet.domain("beta").checkpoint_dirs.values():
        checkpoint = read_trainer_checkpoint(directory)
        assert checkpoint is not None
        trained[directory] = checkpoint.step
    beta = domain_id(seeded, "beta")
    _, created = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    assert created
    results = await helpers.tick_until_settled(reconciler, "local")
    final = results[-1].operation
    assert final is not None
    assert final.state is OperationState.SUCCEEDED, final.error
    assert final.routing_committed

    after = await snapshot_of(store)
    assert after.active_domain_id == beta
    assert after.route_revision == seeded.route_revision + 1
    assert states(after, "beta") == (DomainState.READY, ["serving", "serving"], ["idle", "idle"])
    assert states(after, "alpha") == (
        DomainState.READY,
        ["sleeping", "sleeping"],
        ["training", "training"],
    )
    # The real processes agree with the stored state.
    beta_sims = fleet.domain("beta").sims.values()
    alpha_sims = fleet.domain("alpha").sims.values()
    assert all(not sim.sleeping for sim in beta_sims)
    assert all(sim.sleeping for sim in alpha_sims)
    client = SupervisorClient(http, token=None)
    await helpers.wait_training(
        client, fleet.domain("alpha").supervisor_url, TrainingRunState.RUNNING
    )
    # The standby's trainers were stopped with SIGTERM and flushed a final checkpoint.
    for directory, step in trained.items():
        final_checkpoint = read_trainer_checkpoint(directory)
        assert final_checkpoint is not None
        assert final_checkpoint.step >= step
    # Each model was probed once (the warm-up request) before routing moved.
    assert all(sim.requests_served.get("/v1/chat/completions", 0) >= 1 for sim in beta_sims)

    types = await event_types(store, seeded.id)
    assert types.count(EventType.ROUTING_SWITCHED) == 1
    assert types.count(EventType.OPERATION_SUCCEEDED) == 1
    done = [
        e.payload["step"]
        for e in await store.list_events(seeded.id, limit=1000)
        if e.type == EventType.OPERATION_STEP_DONE
    ]
    assert done == [step.value for step in OperationStep][:7]


async def test_step_chaining_finishes_a_promotion_in_few_ticks(
    store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
    helpers: Any,
) -> None:
    _, seeded, _ = await seeded_fleet(store, training_gpus=())
    chained = make_reconciler(store)
    await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    results = await helpers.tick_until_settled(chained, "local")
    assert len(results) == 1
    assert results[0].operation is not None
    assert results[0].operation.state is OperationState.SUCCEEDED


async def test_without_chaining_each_tick_runs_one_step(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    store = sqlite_store
    _, seeded, reconciler = await seeded_fleet(store, training_gpus=(), chaining=False)
    await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    results = await helpers.tick_until_settled(reconciler, "local")
    assert len(results) == 7
    steps = [r.operation.current_step for r in results if r.operation is not None]
    assert steps[:-1] == list(OperationStep)[1:7]


async def test_full_demotion(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    fleet, seeded, reconciler = await seeded_fleet(store)
    beta = domain_id(seeded, "beta")
    await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.DEMOTE, target_domain_id=beta, at=clock()
    )
    results = await helpers.tick_until_settled(reconciler, "local")
    final = results[-1].operation
    assert final is not None
    assert final.state is OperationState.SUCCEEDED, final.error
    after = await snapshot_of(store)
    assert after.active_domain_id == seeded.active_domain_id
    assert states(after, "beta") == (
        DomainState.READY,
        ["sleeping", "sleeping"],
        ["training", "training"],
    )
    assert states(after, "alpha") == (DomainState.READY, ["serving", "serving"], ["idle", "idle"])
    client = SupervisorClient(http, token=None)
    await helpers.wait_training(
        client, fleet.domain("beta").supervisor_url, TrainingRunState.RUNNING
    )
    assert all(sim.sleeping for sim in fleet.domain("beta").sims.values())


async def test_a_slow_model_fails_the_probe_by_name_not_by_step_timeout(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    # Issue 12 item 3: when the supervisor got the whole remaining budget as its per-model
    # bound, the server's HTTP call (bounded by the same budget) gave up first, so the step
    # only ever saw a call timeout and the operation ended as step_timeout naming no model.
    fleet, seeded, reconciler = await seeded_fleet(
        store, training_gpus=(), policy=PolicyPatch(probe_timeout_ms=3000)
    )
    slow = "example-chat-medium"
    await fleet.domain("beta").sims[slow].set_faults(slow_first_token_ms=600_000)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    for _ in range(10):
        started = time.monotonic()
        await reconciler.tick("local")
        # The manual clock follows real time, so the probe step's budget runs out for real.
        clock.advance(seconds=time.monotonic() - started)
        current = await store.get_operation(promote.id)
        assert current is not None
        if helpers.finished(current):
            break
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.state is OperationState.FAILED
    assert failed.error is not None
    assert failed.error.step is OperationStep.PROBE
    assert failed.error.code == OperationErrorCode.PROBE_FAILED
    assert slow in failed.error.message
    assert "example-chat-small" not in failed.error.message
    events = await store.list_events(seeded.id, limit=1000)
    [event] = [
        e for e in events if e.type == EventType.OPERATION_FAILED and e.operation_id == promote.id
    ]
    assert event.payload["code"] == OperationErrorCode.PROBE_FAILED
    assert [m["model"] for m in event.payload["failedModels"]] == [slow]
    assert event.payload["failedModels"][0]["error"]


async def test_probe_failure_leaves_routing_and_restores_the_standby(
    store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    fleet, seeded, reconciler = await seeded_fleet(store, standby_training=True)
    await fleet.domain("beta").sims["example-chat-medium"].set_faults(error_500=True)
    beta = domain_id(seeded, "beta")
    promote, _ = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    result = await reconciler.tick("local")
    while (
        result.operation is not None
        and result.operation.kind is OperationKind.PROMOTE
        and (result.operation.state is OperationState.RUNNING)
    ):
        await asyncio.sleep(0.02)
        result = await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.state is OperationState.FAILED
    assert failed.error is not None
    assert failed.error.step is OperationStep.PROBE
    assert failed.error.code == OperationErrorCode.PROBE_FAILED
    assert "example-chat-medium" in failed.error.message
    assert "example-chat-small" not in failed.error.message
    # Routing never moved; the old active kept serving.
    mid = await snapshot_of(store)
    assert mid.active_domain_id == seeded.active_domain_id
    assert mid.route_revision == seeded.route_revision
    assert states(mid, "alpha")[1] == ["serving", "serving"]
    assert all(not sim.sleeping for sim in fleet.domain("alpha").sims.values())
    # The failed promote queued a demote that returns beta to standby posture.
    assert result.in_flight
    restore = await store.get_in_flight_operation(seeded.id)
    assert restore is not None
    assert restore.kind is OperationKind.DEMOTE
    assert restore.target_domain_id == beta
    await helpers.tick_until_settled(reconciler, "local")
    done = await store.get_operation(restore.id)
    assert done is not None
    assert done.state is OperationState.SUCCEEDED, done.error
    after = await snapshot_of(store)
    assert states(after, "beta") == (
        DomainState.READY,
        ["sleeping", "sleeping"],
        ["training", "training"],
    )
    assert all(sim.sleeping for sim in fleet.domain("beta").sims.values())
    types = await event_types(store, seeded.id)
    assert EventType.OPERATION_RESTORE_DEMOTE in types
    assert EventType.ROUTING_SWITCHED not in types


async def test_step_timeout_on_injected_clock_fails_and_cleans_up(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=())
    for sim in fleet.domain("beta").sims.values():
        await sim.set_faults(wake_fails=True)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.WAKE_VLLM
    assert result.operation.state is OperationState.RUNNING
    waking = await snapshot_of(store)
    assert states(waking, "beta")[1] == ["waking", "waking"]
    clock.advance(ms=seeded.policy.wake_timeout_ms - 1)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.state is OperationState.RUNNING
    clock.advance(ms=1)
    result = await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.state is OperationState.FAILED
    assert failed.error is not None
    assert failed.error.code == OperationErrorCode.STEP_TIMEOUT
    assert failed.error.step is OperationStep.WAKE_VLLM
    # The timeout says what the step last waited for (here: the wake call that kept failing).
    assert failed.error.message.startswith(
        f"step wake_vllm did not finish within its budget of {seeded.policy.wake_timeout_ms} ms"
        "; last seen waiting: POST http://127.0.0.1:"
    )
    assert "/v1/vllm/wake" in failed.error.message
    after = await snapshot_of(store)
    assert after.active_domain_id == seeded.active_domain_id
    # Cleanup in the same statement as the fail: the wake path is failed.
    assert states(after, "beta")[1] == ["failed", "failed"]


async def test_unauthorized_supervisor_fails_the_step(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    _, seeded, reconciler = await seeded_fleet(
        store, supervisor_token="right-token-0123456789", token="wrong-token-0123456789"
    )
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.state is OperationState.FAILED
    assert failed.error is not None
    assert failed.error.code == OperationErrorCode.SUPERVISOR_UNAUTHORIZED
    assert failed.error.step is OperationStep.STOP_TRAINING
    assert "wrong-token-0123456789" not in failed.error.message
    after = await snapshot_of(store)
    assert after.active_domain_id == seeded.active_domain_id
    # Heartbeats were refused too: a configuration error, never evidence either way, so no
    # domain was judged (new domains stay provisioning, unroutable, until one answers).
    assert {d.state for d in after.domains} == {DomainState.PROVISIONING}


async def test_supervisor_unreachable_mid_step_is_pending_until_the_budget_ends(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), chaining=False)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    for _ in range(3):  # stop_training, verify_gpu, wake_vllm
        await reconciler.tick("local")
    running = await store.get_operation(promote.id)
    assert running is not None
    assert running.current_step is OperationStep.PROBE
    await fleet.stop_supervisor("beta")
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.state is OperationState.RUNNING
    assert result.operation.current_step is OperationStep.PROBE
    mid = await snapshot_of(store)
    assert mid.active_domain_id == seeded.active_domain_id
    assert states(mid, "beta")[0] is DomainState.DEGRADED
    clock.advance(ms=seeded.policy.probe_timeout_ms)
    await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.error is not None
    assert failed.error.code == OperationErrorCode.STEP_TIMEOUT
    assert failed.error.step is OperationStep.PROBE
    after = await snapshot_of(store)
    assert after.active_domain_id == seeded.active_domain_id
    assert states(after, "beta")[1] == ["failed", "failed"]
    assert states(after, "alpha")[1] == ["serving", "serving"]


async def test_config_drift_is_judged_against_the_layout(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
    helpers: Any,
) -> None:
    store = sqlite_store
    fleet = await make_fleet(training_gpus=())
    # The layout binds a model that neither supervisor is configured with.
    layout = fleet.layout()
    domains = []
    for domain in layout.domains:
        first = domain.slots[0]
        assert isinstance(first, InferenceSlotSpec)
        ghost = (*first.models, first.models[0].model_copy(update={"name": "ghost-model"}))
        domains.append(
            domain.model_copy(
                update={"slots": (first.model_copy(update={"models": ghost}), *domain.slots[1:])}
            )
        )
    await store.apply_fleet_layout(
        layout.model_copy(update={"domains": tuple(domains)}), at=clock()
    )
    await confirm_domains(store, "local", at=clock())  # a fleet that was healthy before
    seeded = await snapshot_of(store)
    reconciler = make_reconciler(store)
    await reconciler.tick("local")
    snapshot = await snapshot_of(store)
    # Active: the slot with the unknown model is failed and the domain degraded (not ready).
    assert states(snapshot, "alpha") == (DomainState.DEGRADED, ["failed", "serving"], [])
    # Standby: an omitted model is not asleep.
    assert states(snapshot, "beta") == (DomainState.READY, ["failed", "sleeping"], [])
    not_ready = [
        e for e in await store.list_events(seeded.id) if e.type == EventType.DOMAIN_NOT_READY
    ]
    assert len(not_ready) == 1
    assert not_ready[0].payload["modelsNotAwake"] == ["ghost-model"]
    # A promotion can never prove the unknown model awake: the wake times out.
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.WAKE_VLLM
    clock.advance(ms=seeded.policy.wake_timeout_ms)
    await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.error is not None
    assert failed.error.step is OperationStep.WAKE_VLLM
    assert failed.error.code == OperationErrorCode.STEP_TIMEOUT
    assert (await snapshot_of(store)).active_domain_id == seeded.active_domain_id


AUTO = PolicyPatch(auto_failover=True, heartbeat_stale_ms=15_000, degraded_grace_ms=60_000)


async def test_auto_failover_from_a_stale_heartbeat(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), policy=AUTO)
    await reconciler.tick("local")
    await fleet.stop_supervisor("alpha")
    clock.advance(ms=10_000)
    result = await reconciler.tick("local")
    assert result.operation is None  # degraded, but not stale yet
    snapshot = await snapshot_of(store)
    assert states(snapshot, "alpha")[0] is DomainState.DEGRADED
    clock.advance(ms=6_000)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.kind is OperationKind.PROMOTE
    assert result.operation.target_domain_id == domain_id(seeded, "beta")
    # Routing switched; the unreachable old active cannot be put to sleep.
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    after = await snapshot_of(store)
    assert after.active_domain_id == domain_id(seeded, "beta")
    clock.advance(ms=after.policy.sleep_timeout_ms)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.state is OperationState.SUCCEEDED
    events = await store.list_events(seeded.id, limit=1000)
    auto = [e for e in events if e.type == EventType.OPERATION_AUTO_FAILOVER]
    assert len(auto) == 1
    assert auto[0].payload["reason"] == "active_stale"
    assert EventType.OPERATION_STEP_TIMEOUT_BEST_EFFORT in [e.type for e in events]


async def test_auto_failover_from_a_partly_dead_active_after_the_grace(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    # One model of several down is weak evidence (the others serve): the grace decides. A
    # wholly dead active fails after deadConfirmMs instead (test_detection.py).
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), policy=AUTO)
    await reconciler.tick("local")
    await fleet.domain("alpha").sims["example-chat-large"].set_faults(refuse=True)
    result = await reconciler.tick("local")
    assert result.operation is None
    snapshot = await snapshot_of(store)
    assert states(snapshot, "alpha")[:2] == (DomainState.DEGRADED, ["serving", "failed"])
    clock.advance(ms=60_000)
    result = await reconciler.tick("local")
    assert result.operation is None  # exactly the grace: not yet
    clock.advance(ms=1)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.target_domain_id == domain_id(seeded, "beta")
    after = await snapshot_of(store)
    assert after.active_domain_id == domain_id(seeded, "beta")
    assert states(after, "alpha")[0] is DomainState.FAILED
    assert states(after, "beta")[1] == ["serving", "serving"]
    types = await event_types(store, seeded.id)
    assert types.count(EventType.DOMAIN_DEGRADED_ESCALATED) == 1
    assert types.count(EventType.OPERATION_AUTO_FAILOVER) == 1


async def test_degraded_active_is_not_escalated_without_a_viable_standby(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), policy=AUTO)
    await reconciler.tick("local")
    await fleet.stop_supervisor("beta")
    for sim in fleet.domain("alpha").sims.values():
        await sim.set_faults(refuse=True)
    await reconciler.tick("local")
    clock.advance(ms=120_000)
    result = await reconciler.tick("local")
    assert result.operation is None
    snapshot = await snapshot_of(store)
    assert states(snapshot, "alpha")[0] is DomainState.DEGRADED
    assert states(snapshot, "beta")[0] is DomainState.DEGRADED
    assert snapshot.active_domain_id == seeded.active_domain_id
    assert EventType.DOMAIN_DEGRADED_ESCALATED not in await event_types(store, seeded.id)


async def test_best_effort_sleep_timeout_completes_without_training_next_to_awake_vllm(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store)
    for sim in fleet.domain("alpha").sims.values():
        await sim.set_faults(sleep_fails=True)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    clock.advance(ms=seeded.policy.sleep_timeout_ms)
    result = await reconciler.tick("local")
    done = await store.get_operation(promote.id)
    assert done is not None
    assert done.state is OperationState.SUCCEEDED
    assert done.current_step is OperationStep.DEMOTE_OLD_SLEEP
    after = await snapshot_of(store)
    assert after.active_domain_id == domain_id(seeded, "beta")
    assert states(after, "alpha") == (
        DomainState.DEGRADED,
        ["serving", "serving"],
        ["idle", "idle"],
    )
    client = SupervisorClient(http, token=None)
    status = await client.status(fleet.domain("alpha").supervisor_url, timeout_s=2)
    assert all(
        s.training is not None and s.training.state is TrainingRunState.IDLE
        for s in status.slots
        if s.kind is SlotKind.TRAINING
    )
    timeouts = [
        e
        for e in await store.list_events(seeded.id, limit=1000)
        if e.type == EventType.OPERATION_STEP_TIMEOUT_BEST_EFFORT
    ]
    assert len(timeouts) == 1
    assert timeouts[0].payload["sourceDegraded"] is True


async def test_best_effort_calls_are_bounded_by_the_remaining_budget(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
) -> None:
    """A hung old active never holds a tick longer than what remains of the step's budget."""
    store = sqlite_store
    fleet, seeded, _ = await seeded_fleet(store, training_gpus=())
    stepper = make_reconciler(store, chaining=False, heartbeat_timeout_s=0.2)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await stepper.tick("local")
    while result.operation is not None and result.operation.current_step is not (
        OperationStep.DEMOTE_OLD_SLEEP
    ):
        result = await stepper.tick("local")
    for sim in fleet.domain("alpha").sims.values():
        await sim.set_faults(hang=True)
    # Only 300 ms of the sleep step's budget are left when it runs against the hung vLLMs.
    clock.advance(ms=seeded.policy.sleep_timeout_ms - 300)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await stepper.tick("local")
    elapsed = loop.time() - started
    for sim in fleet.domain("alpha").sims.values():
        await sim.clear_faults()
    assert result.operation is not None
    assert result.operation.id == promote.id
    assert result.operation.state is OperationState.RUNNING
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    # Bounded by the 300 ms left (plus a 200 ms heartbeat), never by a 120 s sleep bound.
    assert elapsed < 10


async def run_to_step(
    reconciler: Reconciler, store: StateStore, operation_id: UUID, step: OperationStep
) -> None:
    for _ in range(20):
        current = await store.get_operation(operation_id)
        assert current is not None
        if current.current_step is step:
            return
        await reconciler.tick("local")
    raise AssertionError(f"never reached {step}")


async def test_verify_gpu_waits_for_released_memory_then_times_out(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store)
    # GPU 1 keeps 40 % of its memory after training stopped (a leaked context).
    fleet.domain("beta").gpu_used_mib[1] = 0.4 * 81_920
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.VERIFY_GPU
    clock.advance(ms=seeded.policy.verify_gpu_timeout_ms)
    await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.error is not None
    assert (failed.error.step, failed.error.code) == (
        OperationStep.VERIFY_GPU,
        OperationErrorCode.STEP_TIMEOUT,
    )
    # The tick that found the budget spent ran no step: the message is what the step last
    # reported while it waited.
    assert failed.error.message == (
        f"step verify_gpu did not finish within its budget of "
        f"{seeded.policy.verify_gpu_timeout_ms} ms; last seen waiting: GPU(s) [1] still hold "
        "more than 25% of memory; held by GPU 1: no compute process listed"
    )
    # Training was stopped: a restore demote returns beta to standby posture (its trainers
    # run again) without ever waking its vLLM.
    restore = await store.get_in_flight_operation(seeded.id)
    assert restore is not None
    assert (restore.kind, restore.target_domain_id) == (
        OperationKind.DEMOTE,
        domain_id(seeded, "beta"),
    )
    await helpers.tick_until_settled(reconciler, "local")
    done = await store.get_operation(restore.id)
    assert done is not None
    assert done.state is OperationState.SUCCEEDED, done.error
    assert states(await snapshot_of(store), "beta")[2] == ["training", "training"]
    assert all(sim.sleeping for sim in fleet.domain("beta").sims.values())


async def test_verify_gpu_names_the_processes_holding_the_gpu_when_it_fails(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store)
    # Training stopped, but a process it left (or anything else) still holds GPU 1; this test
    # process stands for it, so the supervisor can read its name.
    beta = fleet.domain("beta")
    beta.gpu_used_mib[1] = 0.4 * 81_920
    beta.gpu_processes[1] = [(os.getpid(), 32_000.0)]
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.VERIFY_GPU
    # The last tick of the budget: its polling reaches the deadline.
    clock.advance(ms=seeded.policy.verify_gpu_timeout_ms - 200)
    await reconciler.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.error is not None
    assert (failed.error.step, failed.error.code) == (
        OperationStep.VERIFY_GPU,
        OperationErrorCode.STEP_TIMEOUT,
    )
    name = process_name(os.getpid())
    assert name
    holder = f"GPU 1: pid {os.getpid()} {name} 32000 MiB"
    assert holder in failed.error.message
    (event,) = [
        e
        for e in await store.list_events(seeded.id, limit=1000)
        if e.type == EventType.OPERATION_FAILED
    ]
    assert holder in str(event.payload["message"])


async def test_switch_active_over_budget_counts_as_done_when_routing_committed(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    _, seeded, _ = await seeded_fleet(store, training_gpus=())
    stepper = make_reconciler(store, chaining=False)
    beta = domain_id(seeded, "beta")
    promote, _ = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    await run_to_step(stepper, store, promote.id, OperationStep.SWITCH_ACTIVE)
    # A previous tick's pointer CAS landed, then that process died before advancing.
    assert await store.switch_active(
        fleet_id=seeded.id,
        expected_active_domain_id=seeded.active_domain_id,
        target_domain_id=beta,
        operation_id=promote.id,
        at=clock(),
    )
    clock.advance(ms=seeded.policy.switch_active_timeout_ms)
    result = await stepper.tick("local")
    assert result.operation is not None
    assert result.operation.state is OperationState.RUNNING
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    after = await snapshot_of(store)
    assert after.active_domain_id == beta
    assert after.route_revision == seeded.route_revision + 1


async def test_switch_active_fails_cas_lost_when_the_pointer_moved_elsewhere(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
    helpers: Any,
) -> None:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    store = sqlite_store
    _, seeded, _ = await seeded_fleet(store, training_gpus=())
    stepper = make_reconciler(store, chaining=False)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    await run_to_step(stepper, store, promote.id, OperationStep.SWITCH_ACTIVE)
    # Another writer (an operator's manual fix) cleared the pointer meanwhile.
    engine = create_async_engine(store.url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "UPDATE fleets SET active_domain_id = NULL, route_revision = route_revision + 1"
                )
            )
    finally:
        await engine.dispose()
    await stepper.tick("local")
    failed = await store.get_operation(promote.id)
    assert failed is not None
    assert failed.error is not None
    assert (failed.error.step, failed.error.code) == (
        OperationStep.SWITCH_ACTIVE,
        OperationErrorCode.CAS_LOST,
    )
    after = await snapshot_of(store)
    assert after.active_domain_id is None
    # The target was probed (serving) but never routed: the fail cleaned it up.
    assert states(after, "beta")[1] == ["failed", "failed"]


async def sleeps_only_after(
    reconciler: Reconciler,
    clock: ManualClock,
    guard_ms: int,
    alpha_sims: Iterable[Any],
    helpers: Any,
) -> None:
    """The old active (``alpha_sims``) is still awake 1 ms before the guard, asleep after it."""
    clock.advance(ms=guard_ms - 1)
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    assert all(not sim.sleeping and sim.sleeps == 0 for sim in alpha_sims)
    clock.advance(ms=1)
    results = await helpers.tick_until_settled(reconciler, "local")
    final = results[-1].operation
    assert final is not None
    assert final.state is OperationState.SUCCEEDED, final.error
    assert all(sim.sleeping and sim.sleeps == 1 for sim in alpha_sims)


async def test_old_active_sleeps_only_after_the_route_guard_on_the_reconcile_clock(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    """``demote_old_sleep`` starts its drain no earlier than flip + lease + margin.

    The wait is a pending step re-evaluated on each tick, so a frozen clock holds it however
    many ticks run, and advancing the clock past the guard releases it.
    """
    store = sqlite_store
    guard_ms = 1_050
    tuning = StepTuning(
        settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05, route_guard_s=guard_ms / 1000
    )
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), tuning=tuning)
    beta = domain_id(seeded, "beta")
    promote, _ = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    alpha_sims = fleet.domain("alpha").sims.values()
    # Chaining runs every step up to the flip in one tick; the demote then waits.
    for _ in range(3):
        result = await reconciler.tick("local")
        assert result.operation is not None
        assert result.operation.state is OperationState.RUNNING
        assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    operation = await store.get_operation(promote.id)
    assert operation is not None
    assert operation.routing_committed
    flipped = operation.step_started_at
    assert flipped is not None
    switched = [
        e
        for e in await store.list_events(seeded.id, limit=1000)
        if e.type == EventType.ROUTING_SWITCHED
    ]
    assert len(switched) == 1
    assert switched[0].created_at <= flipped
    assert (await snapshot_of(store)).active_domain_id == beta
    assert all(not sim.sleeping and sim.sleeps == 0 for sim in alpha_sims)

    await sleeps_only_after(reconciler, clock, guard_ms, alpha_sims, helpers)
    slept = [
        e
        for e in await store.list_events(seeded.id, limit=1000)
        if e.type == EventType.OPERATION_STEP_DONE
        and e.payload.get("step") == OperationStep.DEMOTE_OLD_SLEEP.value
    ]
    assert len(slept) == 1
    assert "timedOut" not in slept[0].payload


LONG_LEASE_MS = 10_000
"""``HARU_ROUTE_LEASE_MS`` of some process: its route guard outlasts a 3 s sleep budget."""


async def test_a_route_guard_longer_than_the_sleep_budget_still_holds_the_old_active(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    """The guard wait does not consume ``sleepTimeoutMs``: the old active sleeps after it.

    Were the wait counted against the sleep budget, ``demote_old_sleep`` would time out
    3 s after the flip and its restore demote would sleep the old active at once, while a
    process with the long lease may still route to it.
    """
    store = sqlite_store
    guard_ms = lease_guard_ms(LONG_LEASE_MS)
    tuning = StepTuning(
        settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05, route_guard_s=guard_ms / 1000
    )
    fleet, seeded, reconciler = await seeded_fleet(
        store, training_gpus=(), policy=PolicyPatch(sleep_timeout_ms=3_000), tuning=tuning
    )
    await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    alpha_sims = fleet.domain("alpha").sims.values()
    # Past the sleep budget, well inside the guard: still waiting, nothing asleep.
    clock.advance(ms=3_500)
    for _ in range(3):
        result = await reconciler.tick("local")
        assert result.operation is not None
        assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    assert all(not sim.sleeping and sim.sleeps == 0 for sim in alpha_sims)
    clock.advance(ms=-3_500)
    await sleeps_only_after(reconciler, clock, guard_ms, alpha_sims, helpers)
    types = await event_types(store, seeded.id)
    assert EventType.OPERATION_RESTORE_DEMOTE not in types
    assert EventType.OPERATION_STEP_TIMEOUT_BEST_EFFORT not in types


async def test_a_restore_demote_of_the_old_active_waits_out_the_stored_route_guard(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    """A demote of a domain that was active within the guard sleeps it only after the guard.

    Another replica (whose own budget ran out) ends the promotion right after the flip and
    queues the restore demote of the old active, as a best-effort timeout does. The demote's
    ``sleep_vllm`` waits until the flip plus the longest lease any process recorded.
    """
    store = sqlite_store
    tuning = StepTuning(settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05, route_guard_s=0.01)
    fleet, seeded, reconciler = await seeded_fleet(
        store, training_gpus=(), policy=PolicyPatch(sleep_timeout_ms=3_000), tuning=tuning
    )
    assert await store.record_route_lease(seeded.id, LONG_LEASE_MS)  # a proxy process's lease
    alpha, beta = domain_id(seeded, "alpha"), domain_id(seeded, "beta")
    promote, _ = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
    )
    result = await reconciler.tick("local")
    assert result.operation is not None
    assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
    flipped = result.operation.step_started_at
    assert flipped == clock()
    # The other replica: its step ran out, it ends the promotion and queues the restore.
    clock.advance(ms=100)
    assert await store.complete_operation(
        promote.id, from_step=OperationStep.DEMOTE_OLD_SLEEP, at=clock()
    )
    demote, created = await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.DEMOTE, target_domain_id=alpha, at=clock()
    )
    assert created
    alpha_sims = fleet.domain("alpha").sims.values()
    guard_ms = lease_guard_ms(LONG_LEASE_MS)
    clock.advance(ms=guard_ms - 1 - 100)
    for _ in range(3):
        result = await reconciler.tick("local")
        assert result.operation is not None
        assert result.operation.id == demote.id
        assert result.operation.current_step is OperationStep.SLEEP_VLLM
    assert all(not sim.sleeping and sim.sleeps == 0 for sim in alpha_sims)
    clock.advance(ms=1)
    results = await helpers.tick_until_settled(reconciler, "local")
    final = results[-1].operation
    assert final is not None
    assert final.id == demote.id
    assert final.state is OperationState.SUCCEEDED, final.error
    assert all(sim.sleeping and sim.sleeps == 1 for sim in alpha_sims)


class LeaseBlindStore(StateStore):
    """Snapshots that predate every lease record (a tick that read before one landed)."""

    async def get_fleet_snapshot(self, ref: str | FleetRef) -> FleetSnapshot | None:
        snapshot = await super().get_fleet_snapshot(ref)
        return None if snapshot is None else snapshot.model_copy(update={"route_lease_ms": None})


@pytest.mark.parametrize("snapshot_knows", [True, False])
async def test_the_old_active_waits_out_the_longest_lease_any_process_recorded(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
    snapshot_knows: bool,
) -> None:
    """A proxy process with a longer ``HARU_ROUTE_LEASE_MS`` than the controller's own.

    The controller's guard alone (10 ms here) would drain the old active while that process
    may still route to it; the lease it recorded in the store lengthens the wait, even when
    the tick's snapshot was read before the record landed (the step reads it after the flip).
    """
    store = sqlite_store if snapshot_knows else LeaseBlindStore.open(sqlite_store.url)
    try:
        if not snapshot_knows:
            assert isinstance(store, LeaseBlindStore)
        tuning = StepTuning(settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05, route_guard_s=0.01)
        fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), tuning=tuning)
        assert await store.record_route_lease(seeded.id, 2_000)  # another process's lease
        beta = domain_id(seeded, "beta")
        await store.create_operation(
            fleet_id=seeded.id, kind=OperationKind.PROMOTE, target_domain_id=beta, at=clock()
        )
        alpha_sims = fleet.domain("alpha").sims.values()
        result = await reconciler.tick("local")
        assert result.operation is not None
        assert result.operation.current_step is OperationStep.DEMOTE_OLD_SLEEP
        await sleeps_only_after(reconciler, clock, lease_guard_ms(2_000), alpha_sims, helpers)
    finally:
        if store is not sqlite_store:
            await store.close()


async def test_a_hung_supervisor_delays_no_other_domains_heartbeat_nor_the_failover(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    """One standby's supervisor accepts TCP but never answers; the others are healthy.

    Its poll is bounded by the heartbeat timeout (as good as forever here), yet every tick
    records the healthy domains' heartbeats and the failover to the healthy standby happens:
    no tick waits for the hung poll beyond the round it was started in.
    """
    held: list[asyncio.StreamReader] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(reader)
        await reader.read()  # until the client gives up and closes
        writer.close()

    hung = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    store = sqlite_store
    fleet = await make_fleet(training_gpus=(), domains=("alpha", "beta", "gamma"))
    port = hung.sockets[0].getsockname()[1]
    fleet.domain("beta").supervisor_url = f"http://127.0.0.1:{port}"
    seeded = await helpers.seed(store, fleet, clock, policy=AUTO)
    reconciler = Reconciler(
        store,
        SupervisorClient(http, token=None),
        clock=clock,
        options=ReconcilerOptions(heartbeat_timeout_s=3_600, heartbeat_round_s=0.2),
    )
    try:
        # A failure detector for the old behaviour (a tick waiting out the hung poll), not a
        # timing assertion: every tick below needs milliseconds.
        async with asyncio.timeout(60):
            for _ in range(5):
                clock.advance(ms=1_000)
                await reconciler.tick("local")
                snapshot = await snapshot_of(store)
                seen = {d.slug: d.last_seen_at for d in snapshot.domains}
                assert seen["alpha"] == clock()
                assert seen["gamma"] == clock()
                assert seen["beta"] is None
            assert held  # the hung supervisor was polled (and never answered)
            await fleet.stop_supervisor("alpha")
            clock.advance(ms=(AUTO.heartbeat_stale_ms or 0) + 1)
            result = await reconciler.tick("local")
    finally:
        await reconciler.close()
        hung.close()
        await hung.wait_closed()
    assert result.operation is not None
    assert result.operation.kind is OperationKind.PROMOTE
    assert result.operation.target_domain_id == domain_id(seeded, "gamma")
    events = await store.list_events(seeded.id, limit=1000)
    auto = [e for e in events if e.type == EventType.OPERATION_AUTO_FAILOVER]
    assert [e.payload["reason"] for e in auto] == ["active_stale"]


class HeldStatus(SupervisorClient):
    """A client whose status polls of one supervisor wait until the test releases each one."""

    def __init__(self, session: aiohttp.ClientSession, held_url: str) -> None:
        super().__init__(session, token=None)
        self.held_url = held_url
        self.gates: list[asyncio.Event] = []
        self.finished = asyncio.Event()

    async def status(self, base_url: str, *, timeout_s: float) -> SupervisorStatus:
        if base_url != self.held_url:
            return await super().status(base_url, timeout_s=timeout_s)
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        try:
            return await super().status(base_url, timeout_s=timeout_s)
        finally:
            self.finished.set()


async def test_an_answer_a_later_tick_takes_is_recorded_at_its_own_time(
    sqlite_store: StateStore,
    make_fleet: MakeFleet,
    clock: ManualClock,
    http: aiohttp.ClientSession,
    helpers: Any,
) -> None:
    """A standby's poll outlives its round and answers between two ticks.

    The next tick takes that answer (its own new poll is still out): the domain's heartbeat
    is recorded at the time the answer came, not at the later tick's, while the domain that
    answered in the round is recorded at the tick's time.
    """
    store = sqlite_store
    fleet = await make_fleet(training_gpus=(), domains=("alpha", "beta"))
    await helpers.seed(store, fleet, clock, policy=AUTO)
    beta_url = fleet.domain("beta").supervisor_url
    assert beta_url is not None
    client = HeldStatus(http, beta_url)
    reconciler = Reconciler(
        store,
        client,
        clock=clock,
        options=ReconcilerOptions(heartbeat_timeout_s=60, heartbeat_round_s=0.05),
    )
    try:
        async with asyncio.timeout(30):
            answered_at = clock.advance(ms=1_000)
            await reconciler.tick("local")
            seen = {d.slug: d.last_seen_at for d in (await snapshot_of(store)).domains}
            assert seen["alpha"] == answered_at
            assert seen["beta"] != answered_at  # its poll is held: not judged this tick
            assert len(client.gates) == 1
            client.gates[0].set()
            await client.finished.wait()  # the poll is done, before the clock moves on
            taken_at = clock.advance(ms=1_000)
            await reconciler.tick("local")
            assert len(client.gates) == 2  # the second tick's own poll is held
            seen = {d.slug: d.last_seen_at for d in (await snapshot_of(store)).domains}
    finally:
        for gate in client.gates:
            gate.set()
        await reconciler.close()
    assert seen["alpha"] == taken_at
    assert seen["beta"] == answered_at


async def test_a_probe_right_after_a_supervisor_restart_waits_for_not_ready_models(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    """The target's supervisor restarts between the wake and the probe; one vLLM still starts.

    The restarted supervisor cannot report that server awake (it does not answer yet): the
    probe step waits ("not ready yet") instead of failing ``probe_failed``, and the promotion
    succeeds once the server answers.
    """
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), chaining=False)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    for _ in range(3):  # stop_training, verify_gpu, wake_vllm
        await reconciler.tick("local")
    running = await store.get_operation(promote.id)
    assert running is not None
    assert running.current_step is OperationStep.PROBE
    starting = fleet.domain("beta").sims["example-chat-medium"]
    await starting.set_listening(False)
    await fleet.restart_supervisor("beta")
    for _ in range(2):
        result = await reconciler.tick("local")
        assert result.operation is not None
        assert result.operation.state is OperationState.RUNNING, result.operation.error
        assert result.operation.current_step is OperationStep.PROBE
    assert (await snapshot_of(store)).active_domain_id == seeded.active_domain_id
    await starting.set_listening(True)
    results = await helpers.tick_until_settled(reconciler, "local")
    final = results[-1].operation
    assert final is not None
    assert final.id == promote.id
    assert final.state is OperationState.SUCCEEDED, final.error
    assert (await snapshot_of(store)).active_domain_id == domain_id(seeded, "beta")


# ---- the standby duty cycle with several replicas ----------------------------------------

BETA = {"fleet": "local", "domain": "beta"}


def standby(metrics: ServerMetrics) -> tuple[float, float]:
    get = metrics.registry.get_sample_value
    return (
        get("haru_standby_seconds_total", BETA) or 0.0,
        get("haru_standby_training_seconds_total", BETA) or 0.0,
    )


async def beta_seen(store: StateStore) -> Any:
    snapshot = await snapshot_of(store)
    return next(d.last_seen_at for d in snapshot.domains if d.slug == "beta")


async def test_two_replicas_count_each_standby_second_once(
    store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    monkeypatch: pytest.MonkeyPatch,
    clock: ManualClock,
) -> None:
    first, second = ServerMetrics(version="test"), ServerMetrics(version="test")
    # beta trains; its first heartbeat is counted by replica a
    _, _, a = await seeded_fleet(store, metrics=first, standby_training=True)
    b = make_reconciler(store, metrics=second)
    start = await beta_seen(store)
    assert start is not None
    # The replicas take turns, one second apart: each write replaces the other's heartbeat.
    for replica in (b, a, b, a, b, a):
        clock.advance(seconds=1)
        await replica.tick("local")
    # A race: b records its heartbeat between a's read of the fleet and a's own write. a's
    # write no longer replaces what it read, so a counts nothing (b counted up to its write).
    record = store.record_heartbeats
    raced: list[bool] = []

    async def b_first(read: Any, *, at: Any) -> Any:
        if not raced:
            raced.append(True)
            await b.tick("local")
        return await record(read, at=at)

    clock.advance(seconds=1)
    monkeypatch.setattr(store, "record_heartbeats", b_first)
    await a.tick("local")
    monkeypatch.setattr(store, "record_heartbeats", record)
    assert raced
    end = await beta_seen(store)
    elapsed = (end - start).total_seconds()
    assert elapsed == 7
    (a_standby, a_training), (b_standby, b_training) = standby(first), standby(second)
    # Each replica counted its own turns (a: 3 s, b: 4 s with the race), none twice.
    assert a_standby == 3, (a_standby, b_standby)
    assert b_standby == 4, (a_standby, b_standby)
    assert a_standby + b_standby == elapsed
    # Beta trained throughout: every counted second was a training one.
    assert (a_training, b_training) == (a_standby, b_standby)
    for metrics in (first, second):
        ratio = metrics.registry.get_sample_value("haru_standby_duty_cycle_ratio", BETA)
        assert ratio == 1.0
