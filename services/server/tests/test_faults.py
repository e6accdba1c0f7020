"""Faults operators meet, against REAL supervisors, emulated vLLM servers and trainers.

A rotated supervisor token, a standby whose probe keeps failing, a crash that left a standby
recorded ``serving``, a best-effort demote whose budget ran out while the server was down.
Budgets run on an injected clock.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

import aiohttp
import pytest
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    DomainState,
    EventType,
    FleetSnapshot,
    InferenceSlotState,
    OperationKind,
    OperationState,
    OperationStep,
    PolicyPatch,
    SlotKind,
    TrainingRunState,
)
from haru_server._clock import ManualClock
from haru_server._reconciler import Reconciler
from haru_supervisor_client import SupervisorClient

MakeReconciler = Callable[..., Reconciler]
SeededFleet = Callable[..., Awaitable[tuple[LocalFleet, FleetSnapshot, Reconciler]]]

TOKEN = "right-token-0123456789abcdef"
ROTATED = "rotated-token-0123456789abcdef"
AUTO = PolicyPatch(auto_failover=True, heartbeat_stale_ms=30_000, degraded_grace_ms=60_000)


def domain_id(snapshot: FleetSnapshot, slug: str) -> UUID:
    return next(d.id for d in snapshot.domains if d.slug == slug)


def slot_states(snapshot: FleetSnapshot, slug: str, kind: SlotKind) -> list[str]:
    domain = next(d for d in snapshot.domains if d.slug == slug)
    return [s.state.value for s in domain.slots if s.kind is kind]


async def snapshot_of(store: StateStore) -> FleetSnapshot:
    snapshot = await store.get_fleet_snapshot("local")
    assert snapshot is not None
    return snapshot


async def events_of(store: StateStore, fleet_id: UUID, type_: EventType) -> list[dict[str, Any]]:
    return [e.payload for e in await store.list_events(fleet_id, limit=1000) if e.type == type_]


async def test_refused_token_is_never_evidence_of_failure(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    _, seeded, _ = await seeded_fleet(store, supervisor_token=TOKEN, policy=AUTO)
    await make_reconciler(store, token=TOKEN).tick("local")  # seen, healthy
    # The supervisors were restarted with a rotated token; the server still has the old one.
    reconciler = make_reconciler(store, token=ROTATED)
    for _ in range(8):  # four minutes: far past heartbeatStaleMs and degradedGraceMs
        clock.advance(ms=30_000)
        result = await reconciler.tick("local")
        assert result.operation is None
    after = await snapshot_of(store)
    assert {d.state for d in after.domains} == {DomainState.READY}
    assert slot_states(after, "alpha", SlotKind.INFERENCE) == ["serving", "serving"]
    assert after.active_domain_id == seeded.active_domain_id
    assert await store.list_recent_operations(seeded.id) == []
    # Reported loudly: one event per domain (not per tick), and visible in the snapshot.
    refused = await events_of(store, seeded.id, EventType.DOMAIN_SUPERVISOR_UNAUTHORIZED)
    assert sorted(p["role"] for p in refused) == ["active", "standby"]
    assert all(ROTATED not in p["message"] and TOKEN not in p["message"] for p in refused)
    annotated = await reconciler.annotate(after)
    assert all(d.auth_failing for d in annotated.domains)
    assert all("401" in (d.last_supervisor_error or "") for d in annotated.domains)
    # The token is fixed: recovery is reported once and the flag clears.
    fixed = make_reconciler(store, token=TOKEN)
    await reconciler.tick("local")
    await fixed.tick("local")
    await fixed.tick("local")
    annotated = await fixed.annotate(await snapshot_of(store))
    assert not any(d.auth_failing for d in annotated.domains)


async def test_refused_token_recovery_is_reported_once(
    sqlite_store: StateStore, seeded_fleet: SeededFleet
) -> None:
    store = sqlite_store
    # The server reads its token at every call (a rotated token file).
    token = [ROTATED]
    _, seeded, reconciler = await seeded_fleet(
        store, supervisor_token=TOKEN, token=lambda: token[0]
    )
    await reconciler.tick("local")
    await reconciler.tick("local")
    # Same process, token fixed (e.g. the supervisors were rolled back).
    token[0] = TOKEN
    await reconciler.tick("local")
    await reconciler.tick("local")
    assert len(await events_of(store, seeded.id, EventType.DOMAIN_SUPERVISOR_UNAUTHORIZED)) == 2
    assert len(await events_of(store, seeded.id, EventType.DOMAIN_SUPERVISOR_AUTHORIZED)) == 2
    annotated = await reconciler.annotate(await snapshot_of(store))
    assert not any(d.auth_failing or d.last_supervisor_error for d in annotated.domains)


async def test_failed_promotion_of_a_target_backs_off(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, training_gpus=(), policy=AUTO)
    await reconciler.tick("local")
    # The active dies; the only standby's probe keeps failing.
    await fleet.stop_supervisor("alpha")
    await fleet.domain("beta").sims["example-chat-medium"].set_faults(error_500=True)
    clock.advance(ms=31_000)
    await helpers.tick_until_settled(reconciler, "local")
    beta = domain_id(seeded, "beta")

    async def promotes() -> list[OperationState]:
        ops = await store.list_recent_operations(seeded.id)
        return [o.state for o in ops if o.kind is OperationKind.PROMOTE]

    assert await promotes() == [OperationState.FAILED]
    first_backoff = await events_of(store, seeded.id, EventType.OPERATION_PROMOTION_BACKOFF)
    assert [(p["consecutiveFailures"], p["delayMs"]) for p in first_backoff] == [(1, 30_000)]
    # The restore demote put beta back to sleep; ticks inside the pause retry nothing.
    for _ in range(5):
        clock.advance(ms=5_000)
        await helpers.tick_until_settled(reconciler, "local")
    assert await promotes() == [OperationState.FAILED]
    annotated = await reconciler.annotate(await snapshot_of(store))
    until = annotated.domain(beta)
    assert until is not None
    assert until.promotion_backoff_until is not None
    assert until.promotion_backoff_until > clock()
    # After the pause one retry, which fails identically: the pause doubles.
    clock.advance(ms=6_000)
    await helpers.tick_until_settled(reconciler, "local")
    assert await promotes() == [OperationState.FAILED, OperationState.FAILED]
    backoffs = await events_of(store, seeded.id, EventType.OPERATION_PROMOTION_BACKOFF)
    assert [(p["consecutiveFailures"], p["delayMs"]) for p in backoffs] == [
        (1, 30_000),
        (2, 60_000),
    ]
    clock.advance(ms=59_000)
    await helpers.tick_until_settled(reconciler, "local")
    assert len(await promotes()) == 2


async def test_heartbeat_reconciles_a_standby_recorded_serving(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
) -> None:
    store = sqlite_store
    _, seeded, reconciler = await seeded_fleet(store)
    await reconciler.tick("local")
    beta = domain_id(seeded, "beta")
    # A crash left the standby recorded serving; its supervisor says every model sleeps.
    for frm, to in (
        (InferenceSlotState.SLEEPING, InferenceSlotState.WAKING),
        (InferenceSlotState.WAKING, InferenceSlotState.PROBING),
        (InferenceSlotState.PROBING, InferenceSlotState.SERVING),
    ):
        await store.transition_domain_slots(
            beta, kind=SlotKind.INFERENCE, from_states=(frm,), to=to, at=clock()
        )
    assert slot_states(await snapshot_of(store), "beta", SlotKind.INFERENCE) == [
        "serving",
        "serving",
    ]
    await reconciler.tick("local")
    assert slot_states(await snapshot_of(store), "beta", SlotKind.INFERENCE) == [
        "sleeping",
        "sleeping",
    ]


async def test_demote_old_sleep_timed_out_across_a_restart_restores_standby_posture(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    make_reconciler: MakeReconciler,
    clock: ManualClock,
    helpers: Any,
    http: aiohttp.ClientSession,
) -> None:
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, chaining=False)
    promote, _ = await store.create_operation(
        fleet_id=seeded.id,
        kind=OperationKind.PROMOTE,
        target_domain_id=domain_id(seeded, "beta"),
        at=clock(),
    )
    for _ in range(5):  # stop_training .. switch_active
        await reconciler.tick("local")
    running = await store.get_operation(promote.id)
    assert running is not None
    assert running.current_step is OperationStep.DEMOTE_OLD_SLEEP
    # The server's sleep call reached alpha's supervisor, then the server crashed and stayed
    # down longer than the step's budget.
    client = SupervisorClient(http, token=None)
    await client.sleep(fleet.domain("alpha").supervisor_url, timeout_s=10)
    clock.advance(ms=seeded.policy.sleep_timeout_ms + 1)
    restarted = make_reconciler(store)
    await helpers.tick_until_settled(restarted, "local")
    done = await store.get_operation(promote.id)
    assert done is not None
    assert done.state is OperationState.SUCCEEDED
    ops = await store.list_recent_operations(seeded.id)
    demotes = [o for o in ops if o.kind is OperationKind.DEMOTE]
    assert [(o.state, o.target_domain_id) for o in demotes] == [
        (OperationState.SUCCEEDED, domain_id(seeded, "alpha"))
    ]
    after = await snapshot_of(store)
    assert slot_states(after, "alpha", SlotKind.INFERENCE) == ["sleeping", "sleeping"]
    assert slot_states(after, "alpha", SlotKind.TRAINING) == ["training", "training"]
    status = await client.status(fleet.domain("alpha").supervisor_url, timeout_s=5)
    runs = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
    assert runs
    assert all(r is not None and r.state is TrainingRunState.RUNNING for r in runs)
    restore = await events_of(store, seeded.id, EventType.OPERATION_RESTORE_DEMOTE)
    assert [p["reason"] for p in restore] == ["demote_old_sleep timed out"]


async def test_standby_whose_training_stopped_gets_it_back_with_backoff(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
    http: aiohttp.ClientSession,
) -> None:
    # Fault schedule sqlite-single:1: a supervisor restart on a standby stopped its trainers;
    # the heartbeat recorded the training slots idle and nothing ever restarted them.
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store)
    beta = domain_id(seeded, "beta")
    beta_url = fleet.domain("beta").supervisor_url
    client = SupervisorClient(http, token=None)
    await reconciler.tick("local")
    # A fresh standby never trained: its first demote stays the operator's call.
    assert await store.list_recent_operations(seeded.id) == []
    await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.DEMOTE, target_domain_id=beta, at=clock()
    )
    await helpers.tick_until_settled(reconciler, "local")
    assert slot_states(await snapshot_of(store), "beta", SlotKind.TRAINING) == [
        "training",
        "training",
    ]

    async def demotes() -> list[OperationState]:
        ops = await store.list_recent_operations(seeded.id)
        return [o.state for o in reversed(ops) if o.kind is OperationKind.DEMOTE]

    async def training_running() -> bool:
        status = await client.status(beta_url, timeout_s=5)
        runs = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
        return bool(runs) and all(
            r is not None and r.state is TrainingRunState.RUNNING and r.pids for r in runs
        )

    async def stop_trainers() -> None:
        # What the supervisor's graceful restart does; the stop is asynchronous (SIGTERM,
        # then SIGKILL after the grace): wait for the supervisor to report every run idle.
        await client.stop_training(beta_url, timeout_s=10, grace_ms=2_000)
        runs: list[Any] = []
        for _ in range(200):
            status = await client.status(beta_url, timeout_s=5)
            runs = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
            if all(r is not None and r.state is TrainingRunState.IDLE for r in runs):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"trainers of beta still running: {runs}")

    await stop_trainers()
    # The first loss of training after the demote that put it in posture: restored at once.
    await helpers.tick_until_settled(reconciler, "local")
    assert await demotes() == [OperationState.SUCCEEDED, OperationState.SUCCEEDED]
    after = await snapshot_of(store)
    assert slot_states(after, "beta", SlotKind.INFERENCE) == ["sleeping", "sleeping"]
    assert slot_states(after, "beta", SlotKind.TRAINING) == ["training", "training"]
    assert await training_running()
    restore = await events_of(store, seeded.id, EventType.OPERATION_RESTORE_DEMOTE)
    assert restore == [
        {"causeOperationId": None, "targetDomainId": str(beta), "reason": "training_idle"}
    ]
    # A trainer that keeps stopping is restarted ever more slowly (30 s, then 60 s by
    # default), never at tick rate.
    for pause_ms in (30_000, 60_000):
        await stop_trainers()
        count = len(await demotes())
        clock.advance(ms=pause_ms - 1_000)
        await helpers.tick_until_settled(reconciler, "local")
        assert len(await demotes()) == count
        assert slot_states(await snapshot_of(store), "beta", SlotKind.TRAINING) == [
            "idle",
            "idle",
        ]
        clock.advance(ms=1_001)
        await helpers.tick_until_settled(reconciler, "local")
        assert len(await demotes()) == count + 1
        assert await training_running()


async def test_failover_whose_old_active_was_failed_puts_it_to_sleep_once_it_is_back(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
    http: aiohttp.ClientSession,
) -> None:
    # Fault schedule sqlite-single:105: the active's supervisor went away, the active was
    # failed over; demote_old_sleep on it ran out of budget (best effort) and its restore
    # demote was refused (a failed domain is not demotable). Once its supervisor was back the
    # domain was a ready standby with its vLLM awake, and nothing ever put it to sleep.
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, policy=AUTO, chaining=False)
    alpha, beta = domain_id(seeded, "alpha"), domain_id(seeded, "beta")
    client = SupervisorClient(http, token=None)
    await reconciler.tick("local")
    await fleet.stop_supervisor("alpha")
    clock.advance(ms=31_000)
    promote = None
    for _ in range(20):
        await reconciler.tick("local")
        promote = await store.get_in_flight_operation(seeded.id)
        if promote is not None and promote.current_step is OperationStep.DEMOTE_OLD_SLEEP:
            break
        await asyncio.sleep(0.02)
    assert promote is not None
    assert promote.current_step is OperationStep.DEMOTE_OLD_SLEEP
    assert promote.target_domain_id == beta
    # In the schedule the old active had been escalated to failed before its failover (a
    # degraded active past degradedGraceMs); here the stale one was failed over at once.
    assert await store.transition_domain(
        alpha, from_states=(DomainState.DEGRADED,), to=DomainState.FAILED, at=clock()
    )
    clock.advance(ms=seeded.policy.sleep_timeout_ms + 1)
    await helpers.tick_until_settled(reconciler, "local")
    done = await store.get_operation(promote.id)
    assert done is not None
    assert done.state is OperationState.SUCCEEDED
    assert await events_of(store, seeded.id, EventType.OPERATION_RESTORE_DEMOTE) == []
    # Its supervisor comes back (its vLLM servers never stopped: awake).
    await fleet.restart_supervisor("alpha")
    for _ in range(10):
        await helpers.tick_until_settled(reconciler, "local")
        await asyncio.sleep(0.02)
    restore = await events_of(store, seeded.id, EventType.OPERATION_RESTORE_DEMOTE)
    assert restore == [
        {"causeOperationId": None, "targetDomainId": str(alpha), "reason": "vllm_awake"}
    ]
    after = await snapshot_of(store)
    assert after.active_domain_id == beta
    assert after.domain(alpha).state is DomainState.READY  # type: ignore[union-attr]
    assert slot_states(after, "alpha", SlotKind.INFERENCE) == ["sleeping", "sleeping"]
    assert slot_states(after, "alpha", SlotKind.TRAINING) == ["training", "training"]
    assert all(sim.sleeping for sim in fleet.domain("alpha").sims.values())
    status = await client.status(fleet.domain("alpha").supervisor_url, timeout_s=5)
    runs = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
    assert runs
    assert all(r is not None and r.state is TrainingRunState.RUNNING for r in runs)
    ops = await store.list_recent_operations(seeded.id)
    assert [(o.kind, o.target_domain_id, o.state) for o in ops][:1] == [
        (OperationKind.DEMOTE, alpha, OperationState.SUCCEEDED)
    ]


async def test_a_standby_whose_vllm_crashed_gets_no_restore_demote(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
) -> None:
    # A crashed vLLM on a standby records its inference slot failed, like an awake one; a
    # demote could not sleep it and would hold the fleet's in-flight slot for its budget.
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store)
    beta = domain_id(seeded, "beta")
    await store.create_operation(
        fleet_id=seeded.id, kind=OperationKind.DEMOTE, target_domain_id=beta, at=clock()
    )
    await helpers.tick_until_settled(reconciler, "local")
    for sim in fleet.domain("beta").sims.values():
        await sim.stop()
    for _ in range(5):
        await helpers.tick_until_settled(reconciler, "local")
    assert slot_states(await snapshot_of(store), "beta", SlotKind.INFERENCE) == [
        "failed",
        "failed",
    ]
    demotes = [
        o for o in await store.list_recent_operations(seeded.id) if o.kind is OperationKind.DEMOTE
    ]
    assert len(demotes) == 1
    assert await events_of(store, seeded.id, EventType.OPERATION_RESTORE_DEMOTE) == []


async def test_a_store_write_lock_held_past_heartbeat_stale_ms_fails_nothing_over(
    sqlite_store: StateStore,
    seeded_fleet: SeededFleet,
    clock: ManualClock,
    helpers: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fault schedule sqlite-single:506: another process held SQLite's write lock (BEGIN
    # IMMEDIATE) for longer than heartbeatStaleMs. The tick's heartbeat round reached the
    # active, then waited for the lock to record the answer; by the time it judged failover,
    # the answer it had just recorded was older than heartbeatStaleMs, and a healthy active
    # was failed over with reason active_stale.
    store = sqlite_store
    fleet, seeded, reconciler = await seeded_fleet(store, policy=AUTO)
    await helpers.tick_until_settled(reconciler, "local")
    before = await store.list_recent_operations(seeded.id)
    database = store.url.removeprefix("sqlite+aiosqlite:///")
    waiting = asyncio.Event()
    record = store.record_heartbeats

    async def record_after_the_lock(domain_ids: Any, *, at: Any) -> Any:
        waiting.set()
        return await record(domain_ids, at=at)

    monkeypatch.setattr(store, "record_heartbeats", record_after_the_lock)
    lock = await asyncio.to_thread(_hold_write_lock, database)
    try:
        tick = asyncio.create_task(reconciler.tick("local"))
        await asyncio.wait_for(waiting.wait(), timeout=10)
        # The write has begun (its time is taken) and cannot finish while the lock is held
        # (busy timeout 5 s): the clock moves on meanwhile.
        clock.advance(ms=AUTO.heartbeat_stale_ms + 5_000)  # type: ignore[operator]
    finally:
        await asyncio.to_thread(_release, lock)
    result = await asyncio.wait_for(tick, timeout=10)
    assert result.operation is None
    assert await events_of(store, seeded.id, EventType.OPERATION_AUTO_FAILOVER) == []
    assert await store.list_recent_operations(seeded.id) == before
    # The rule is about this tick's own answers: an active that stops answering is still
    # failed over once its recorded heartbeat is older than heartbeatStaleMs.
    monkeypatch.setattr(store, "record_heartbeats", record)
    await fleet.stop_supervisor("alpha")
    clock.advance(ms=AUTO.heartbeat_stale_ms + 1_000)  # type: ignore[operator]
    await reconciler.tick("local")
    failovers = await events_of(store, seeded.id, EventType.OPERATION_AUTO_FAILOVER)
    assert [f["reason"] for f in failovers] == ["active_stale"]


def _hold_write_lock(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def _release(conn: sqlite3.Connection) -> None:
    conn.execute("ROLLBACK")
    conn.close()
