"""A domain or slot transition, and the idle-fleet escalation, append their events in their own
statement (DESIGN 5.3): a landed one has exactly them, a lost one adds none, and an event that
cannot be stored keeps the transition from landing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta
from uuid import uuid4

import pytest
from haru_db import HaruDbError, StateStore
from haru_protocol import (
    DomainDegradedEscalated,
    DomainDownRequested,
    DomainState,
    DomainStateChanged,
    Event,
    EventPayload,
    FleetSnapshot,
    InferenceSlotState,
    SlotKind,
    SlotSnapshot,
    SlotStateChanged,
)

RefuseEvents = Callable[[str], AbstractAsyncContextManager[None]]
StatementWrites = Callable[[StateStore], AbstractContextManager[list[str]]]
STALE_MS = 30_000

DEGRADED = DomainStateChanged(from_state=DomainState.READY, to_state=DomainState.DEGRADED)
SLOT_FAILED = SlotStateChanged(
    kind=SlotKind.INFERENCE,
    from_state=InferenceSlotState.SERVING.value,
    to_state=InferenceSlotState.FAILED.value,
    cause="heartbeat",
)
ESCALATED = DomainDegradedEscalated(
    from_state=DomainState.DEGRADED, to_state=DomainState.FAILED, degraded_grace_ms=1000
)


async def _events_since(store: StateStore, fleet: FleetSnapshot, after: list[Event]) -> list[Event]:
    last = after[-1].id if after else 0
    return await store.list_events(fleet.id, after=last)


def _serving_slot(fleet: FleetSnapshot) -> SlotSnapshot:
    return next(
        s
        for s in fleet.domains[0].slots
        if s.kind is SlotKind.INFERENCE and s.state is InferenceSlotState.SERVING
    )


async def _degrade(
    store: StateStore,
    fleet: FleetSnapshot,
    at: datetime,
    *,
    from_state: DomainState = DomainState.READY,
    events: Sequence[EventPayload] = (DEGRADED,),
) -> bool:
    return await store.transition_domain(
        fleet.domains[0].id,
        from_states=(from_state,),
        to=DomainState.DEGRADED,
        at=at,
        events=events,
        fleet_id=fleet.id,
    )


async def _fail_slot(
    store: StateStore,
    fleet: FleetSnapshot,
    slot: SlotSnapshot,
    at: datetime,
    *,
    from_state: InferenceSlotState = InferenceSlotState.SERVING,
) -> bool:
    return await store.transition_slot(
        slot.id,
        kind=SlotKind.INFERENCE,
        from_states=(from_state,),
        to=InferenceSlotState.FAILED,
        at=at,
        events=(SLOT_FAILED,),
        fleet_id=fleet.id,
        domain_id=fleet.domains[0].id,
    )


async def _domain_state(store: StateStore, fleet: FleetSnapshot, index: int) -> DomainState:
    snapshot = await store.get_fleet_snapshot(fleet.slug)
    assert snapshot is not None
    return snapshot.domains[index].state


async def _slot_state(store: StateStore, fleet: FleetSnapshot, slot: SlotSnapshot) -> str:
    snapshot = await store.get_fleet_snapshot(fleet.slug)
    assert snapshot is not None
    return next(s.state.value for s in snapshot.domains[0].slots if s.id == slot.id)


async def test_a_landed_domain_transition_appends_exactly_its_events(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    alpha = fleet.domains[0]
    at = now + timedelta(seconds=5)
    before = await store.list_events(fleet.id)
    second = DomainDownRequested(from_state=DomainState.READY)
    with statement_writes(store) as writes:
        assert await _degrade(store, fleet, at, events=(DEGRADED, second))
    # One write: the transition and its events (a CTE on PostgreSQL, a trigger on SQLite).
    assert len(writes) == 1
    appended = await _events_since(store, fleet, before)
    assert [(e.type, e.data) for e in appended] == [
        ("domain.state.changed", DEGRADED),
        ("domain.down.requested", second),
    ]
    for stored in appended:
        assert (stored.fleet_id, stored.domain_id, stored.slot_id) == (fleet.id, alpha.id, None)
        assert stored.operation_id is None
        assert stored.created_at == at
    assert await _domain_state(store, fleet, 0) is DomainState.DEGRADED


async def test_a_domain_transition_that_loses_its_guard_appends_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    before = await store.list_events(fleet.id)
    assert not await _degrade(store, fleet, now, from_state=DomainState.PROVISIONING)
    assert await store.list_events(fleet.id) == before
    assert await _domain_state(store, fleet, 0) is DomainState.READY


async def test_a_domain_transition_whose_event_is_refused_does_not_land(
    store: StateStore, fleet: FleetSnapshot, now: datetime, refuse_events: RefuseEvents
) -> None:
    before = await store.list_events(fleet.id)
    async with refuse_events("domain.state.changed"):
        with pytest.raises(HaruDbError):
            await _degrade(store, fleet, now)
    # Neither the change nor its event: one statement, so never one without the other.
    assert await _domain_state(store, fleet, 0) is DomainState.READY
    assert await store.list_events(fleet.id) == before


async def test_a_landed_slot_transition_appends_exactly_its_events(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    slot = _serving_slot(fleet)
    at = now + timedelta(seconds=5)
    before = await store.list_events(fleet.id)
    with statement_writes(store) as writes:
        assert await _fail_slot(store, fleet, slot, at)
    assert len(writes) == 1
    appended = await _events_since(store, fleet, before)
    assert [(e.type, e.data) for e in appended] == [("slot.state.changed", SLOT_FAILED)]
    stored = appended[0]
    assert (stored.fleet_id, stored.domain_id, stored.slot_id) == (
        fleet.id,
        fleet.domains[0].id,
        slot.id,
    )
    assert stored.created_at == at
    assert await _slot_state(store, fleet, slot) == InferenceSlotState.FAILED.value


async def test_a_slot_transition_that_loses_its_guard_appends_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    slot = _serving_slot(fleet)
    before = await store.list_events(fleet.id)
    assert not await _fail_slot(store, fleet, slot, now, from_state=InferenceSlotState.SLEEPING)
    assert await store.list_events(fleet.id) == before
    assert await _slot_state(store, fleet, slot) == InferenceSlotState.SERVING.value


async def test_a_slot_transition_whose_event_is_refused_does_not_land(
    store: StateStore, fleet: FleetSnapshot, now: datetime, refuse_events: RefuseEvents
) -> None:
    slot = _serving_slot(fleet)
    before = await store.list_events(fleet.id)
    async with refuse_events("slot.state.changed"):
        with pytest.raises(HaruDbError):
            await _fail_slot(store, fleet, slot, now)
    assert await _slot_state(store, fleet, slot) == InferenceSlotState.SERVING.value
    assert await store.list_events(fleet.id) == before


async def _degrade_active(store: StateStore, fleet: FleetSnapshot, now: datetime) -> None:
    assert await _degrade(store, fleet, now, events=())
    assert await store.mark_domain_seen(fleet.domains[1].id, at=now)


async def _escalate(store: StateStore, fleet: FleetSnapshot, at: datetime) -> bool:
    return await store.escalate_domain_if_fleet_idle(
        domain_id=fleet.domains[0].id,
        fleet_id=fleet.id,
        at=at,
        heartbeat_stale_ms=STALE_MS,
        events=(ESCALATED,),
    )


async def test_a_landed_escalation_appends_exactly_its_events(
    store: StateStore, fleet: FleetSnapshot, now: datetime, statement_writes: StatementWrites
) -> None:
    await _degrade_active(store, fleet, now)
    at = now + timedelta(seconds=5)
    before = await store.list_events(fleet.id)
    with statement_writes(store) as writes:
        assert await _escalate(store, fleet, at)
    assert len(writes) == 1
    appended = await _events_since(store, fleet, before)
    assert [(e.type, e.data) for e in appended] == [("domain.degraded.escalated", ESCALATED)]
    stored = appended[0]
    assert (stored.fleet_id, stored.domain_id, stored.slot_id) == (
        fleet.id,
        fleet.domains[0].id,
        None,
    )
    assert stored.created_at == at
    assert await _domain_state(store, fleet, 0) is DomainState.FAILED


async def test_an_escalation_that_loses_its_guard_appends_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    await _degrade_active(store, fleet, now)
    before = await store.list_events(fleet.id)
    # The standby's heartbeat is too old by then: no viable standby, no escalation.
    assert not await _escalate(store, fleet, now + timedelta(milliseconds=STALE_MS + 1))
    assert await store.list_events(fleet.id) == before
    assert await _domain_state(store, fleet, 0) is DomainState.DEGRADED


async def test_an_escalation_whose_event_is_refused_does_not_land(
    store: StateStore, fleet: FleetSnapshot, now: datetime, refuse_events: RefuseEvents
) -> None:
    await _degrade_active(store, fleet, now)
    before = await store.list_events(fleet.id)
    async with refuse_events("domain.degraded.escalated"):
        with pytest.raises(HaruDbError):
            await _escalate(store, fleet, now)
    assert await _domain_state(store, fleet, 0) is DomainState.DEGRADED
    assert await store.list_events(fleet.id) == before


async def test_events_need_the_rows_fleet_and_domain(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    slot = _serving_slot(fleet)
    with pytest.raises(ValueError, match="fleet_id"):
        await store.transition_domain(
            fleet.domains[0].id,
            from_states=(DomainState.READY,),
            to=DomainState.DEGRADED,
            at=now,
            events=(DEGRADED,),
        )
    with pytest.raises(ValueError, match="domain_id"):
        await store.transition_slot(
            slot.id,
            kind=SlotKind.INFERENCE,
            from_states=(InferenceSlotState.SERVING,),
            to=InferenceSlotState.FAILED,
            at=now,
            events=(SLOT_FAILED,),
            fleet_id=fleet.id,
        )
    # Refused before any write.
    assert await _domain_state(store, fleet, 0) is DomainState.READY
    assert await _slot_state(store, fleet, slot) == InferenceSlotState.SERVING.value


async def test_events_with_ids_other_than_the_rows_do_not_land(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    # The events would be stored with the ids given on PostgreSQL and the row's on SQLite:
    # the write itself is guarded on them, so neither engine stores a misfiled event.
    slot = _serving_slot(fleet)
    before = await store.list_events(fleet.id)
    assert not await store.transition_domain(
        fleet.domains[0].id,
        from_states=(DomainState.READY,),
        to=DomainState.DEGRADED,
        at=now,
        events=(DEGRADED,),
        fleet_id=uuid4(),
    )
    assert not await store.transition_slot(
        slot.id,
        kind=SlotKind.INFERENCE,
        from_states=(InferenceSlotState.SERVING,),
        to=InferenceSlotState.FAILED,
        at=now,
        events=(SLOT_FAILED,),
        fleet_id=fleet.id,
        domain_id=fleet.domains[1].id,
    )
    assert not await store.transition_slot(
        slot.id,
        kind=SlotKind.INFERENCE,
        from_states=(InferenceSlotState.SERVING,),
        to=InferenceSlotState.FAILED,
        at=now,
        events=(SLOT_FAILED,),
        fleet_id=uuid4(),
        domain_id=fleet.domains[0].id,
    )
    assert await store.list_events(fleet.id) == before
    assert await _domain_state(store, fleet, 0) is DomainState.READY
    assert await _slot_state(store, fleet, slot) == InferenceSlotState.SERVING.value
