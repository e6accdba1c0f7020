"""State CAS writes: every (from, to) pair of every table of DESIGN 4, on both engines."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa
from haru_core import InvalidTransitionError, can_transition, machine_for, valid_states
from haru_db import StateStore
from haru_db._tables import domains, slots
from haru_protocol import DomainState, FleetSnapshot, SlotKind, SlotSnapshot
from sqlalchemy.ext.asyncio import AsyncEngine


async def _force(engine: AsyncEngine, table: sa.Table, row_id: UUID, state: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(sa.update(table).where(table.c.id == row_id).values(state=state))


def _slot(fleet: FleetSnapshot, domain: int, kind: SlotKind, gpu: int = 0) -> SlotSnapshot:
    return next(s for s in fleet.domains[domain].slots if s.kind is kind and s.gpu_index == gpu)


async def test_every_domain_pair(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    domain = fleet.domains[1]
    states = sorted(valid_states("domain"))
    for step, (from_state, to_state) in enumerate(itertools.product(states, states)):
        at = now + timedelta(seconds=step)
        await _force(raw_engine, domains, domain.id, from_state)
        if not can_transition("domain", from_state, to_state):
            with pytest.raises(InvalidTransitionError):
                await store.transition_domain(
                    domain.id,
                    from_states=[DomainState(from_state)],
                    to=DomainState(to_state),
                    at=at,
                )
            continue
        won = await store.transition_domain(
            domain.id, from_states=[DomainState(from_state)], to=DomainState(to_state), at=at
        )
        assert won, (from_state, to_state)
        after = await store.get_fleet_snapshot(fleet.slug)
        assert after is not None
        moved = after.domain(domain.id)
        assert moved is not None
        assert (moved.state, moved.state_updated_at) == (to_state, at)
        # The losing case: the row is no longer in from_state.
        if from_state != to_state:
            assert not await store.transition_domain(
                domain.id, from_states=[DomainState(from_state)], to=DomainState(to_state), at=at
            )


@pytest.mark.parametrize("kind", [SlotKind.INFERENCE, SlotKind.TRAINING])
async def test_every_slot_pair(
    store: StateStore,
    fleet: FleetSnapshot,
    raw_engine: AsyncEngine,
    now: datetime,
    kind: SlotKind,
) -> None:
    machine = machine_for(kind)
    slot = _slot(fleet, 1, kind)
    states = sorted(valid_states(machine))
    for step, (from_state, to_state) in enumerate(itertools.product(states, states)):
        at = now + timedelta(seconds=step)
        await _force(raw_engine, slots, slot.id, from_state)
        if not can_transition(machine, from_state, to_state):
            with pytest.raises(InvalidTransitionError):
                await store.transition_slot(
                    slot.id, kind=kind, from_states=[from_state], to=to_state, at=at
                )
            continue
        assert await store.transition_slot(
            slot.id, kind=kind, from_states=[from_state], to=to_state, at=at
        ), (from_state, to_state)
        after = await store.get_fleet_snapshot(str(fleet.id))
        assert after is not None
        moved = next(s for d in after.domains for s in d.slots if s.id == slot.id)
        assert moved.state == to_state
        if from_state != to_state:
            assert not await store.transition_slot(
                slot.id, kind=kind, from_states=[from_state], to=to_state, at=at
            )


async def test_a_forbidden_pair_changes_nothing(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    domain = fleet.domains[0]
    with pytest.raises(InvalidTransitionError):
        # ready -> ready is allowed nowhere; the whole call is refused before any SQL.
        await store.transition_domain(
            domain.id,
            from_states=[DomainState.DEGRADED, DomainState.STOPPED],
            to=DomainState.READY,
            at=now,
        )
    after = await store.get_fleet_snapshot(fleet.slug)
    assert after is not None
    assert after.domains[0].state is DomainState.READY


async def test_a_state_of_the_other_kind_is_refused(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    training = _slot(fleet, 0, SlotKind.TRAINING)
    with pytest.raises(InvalidTransitionError):
        await store.transition_slot(
            training.id, kind=SlotKind.TRAINING, from_states=["sleeping"], to="failed", at=now
        )
    with pytest.raises(InvalidTransitionError):
        await store.transition_slot(
            training.id, kind=SlotKind.TRAINING, from_states=["idle"], to="serving", at=now
        )


async def test_a_slot_of_the_other_kind_loses(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    # Both tables know "failed"/"stopped"; the kind guard keeps the CAS on the right row.
    training = _slot(fleet, 0, SlotKind.TRAINING)
    assert not await store.transition_slot(
        training.id, kind=SlotKind.INFERENCE, from_states=["stopped"], to="starting", at=now
    )


async def test_unknown_ids_and_empty_from_lists_lose(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    assert not await store.transition_domain(
        uuid4(), from_states=[DomainState.READY], to=DomainState.DEGRADED, at=now
    )
    assert not await store.transition_domain(
        fleet.domains[0].id, from_states=[], to=DomainState.DEGRADED, at=now
    )
    assert not await store.transition_slot(
        uuid4(), kind=SlotKind.INFERENCE, from_states=["serving"], to="failed", at=now
    )
    assert (
        await store.transition_domain_slots(
            fleet.domains[0].id, kind=SlotKind.INFERENCE, from_states=[], to="failed", at=now
        )
        == 0
    )


async def test_naive_times_are_refused(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        await store.transition_domain(
            fleet.domains[0].id,
            from_states=[DomainState.READY],
            to=DomainState.DEGRADED,
            at=now.replace(tzinfo=None),
        )


async def test_transition_domain_slots_moves_every_matching_slot_of_the_kind(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    beta = fleet.domains[1]
    await _force(raw_engine, slots, _slot(fleet, 1, SlotKind.INFERENCE, gpu=1).id, "failed")
    moved = await store.transition_domain_slots(
        beta.id, kind=SlotKind.INFERENCE, from_states=["sleeping"], to="waking", at=now
    )
    assert moved == 1
    moved = await store.transition_domain_slots(
        beta.id,
        kind=SlotKind.INFERENCE,
        from_states=["waking", "failed"],
        to="sleeping",
        at=now,
    )
    assert moved == 2
    after = await store.get_fleet_snapshot(fleet.slug)
    assert after is not None
    states = {(s.kind, s.state) for s in after.domains[1].slots}
    assert states == {(SlotKind.INFERENCE, "sleeping"), (SlotKind.TRAINING, "idle")}
    # Nothing left in from_states: the losing case.
    assert (
        await store.transition_domain_slots(
            beta.id, kind=SlotKind.INFERENCE, from_states=["waking"], to="probing", at=now
        )
        == 0
    )
    # The other domain was not touched.
    assert {s.state for s in after.domains[0].slots if s.kind is SlotKind.INFERENCE} == {"serving"}


async def test_mark_domain_seen_never_moves_backwards(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    domain_id = fleet.domains[0].id
    assert fleet.domains[0].last_seen_at is None
    assert await store.mark_domain_seen(domain_id, at=now)
    assert await store.mark_domain_seen(domain_id, at=now)
    assert await store.mark_domain_seen(domain_id, at=now + timedelta(seconds=5))
    assert not await store.mark_domain_seen(domain_id, at=now + timedelta(seconds=1))
    assert not await store.mark_domain_seen(uuid4(), at=now)
    after = await store.get_fleet_snapshot(fleet.slug)
    assert after is not None
    assert after.domains[0].last_seen_at == now + timedelta(seconds=5)
    assert after.domains[0].state_updated_at == now


async def test_record_heartbeats_tells_which_writes_replaced_the_time_read(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    first, second = (d.id for d in fleet.domains[:2])
    later = now + timedelta(seconds=1)
    # Nothing stored yet: recorded, but nothing replaced (no interval to count).
    assert await store.record_heartbeats({first: None, second: None}, at=now) == (
        frozenset({first, second}),
        frozenset(),
    )
    # Both read ``now``; another process then recorded ``second`` at ``later``.
    assert await store.mark_domain_seen(second, at=later)
    at = now + timedelta(seconds=2)
    recorded, replaced = await store.record_heartbeats({first: now, second: now}, at=at)
    assert recorded == {first, second}  # a heartbeat is recorded either way
    assert replaced == {first}  # only the write that replaced what it read
    # A stored heartbeat newer than the write is kept, and nothing is replaced.
    recorded, replaced = await store.record_heartbeats({first: at}, at=later)
    assert (recorded, replaced) == (frozenset(), frozenset())
    after = await store.get_fleet_snapshot(fleet.slug)
    assert after is not None
    assert {d.id: d.last_seen_at for d in after.domains[:2]} == {first: at, second: at}
