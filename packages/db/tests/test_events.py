from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from uuid import uuid4

import pytest
from haru_db import ConstraintViolationError, StateStore
from haru_protocol import EventType, FleetLayout, FleetSnapshot, OperationKind


async def test_append_and_list_oldest_first(
    store: StateStore, fleet: FleetSnapshot, make_layout: Callable[..., FleetLayout], now: datetime
) -> None:
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    slot = fleet.domains[1].slots[0]
    baseline = await store.list_events(fleet.id)
    after = baseline[-1].id if baseline else 0
    await store.apply_fleet_layout(make_layout("other"), at=now)
    other = await store.get_fleet_snapshot("other")
    assert other is not None

    ids = []
    for n in range(5):
        ids.append(
            await store.append_event(
                fleet_id=fleet.id,
                type="test.untyped",  # a type without a model: any JSON object
                payload={"n": n, "nested": {"models": ["a", "b"]}, "ok": True, "none": None},
                at=now + timedelta(seconds=n),
                domain_id=fleet.domains[1].id,
                slot_id=slot.id,
                operation_id=operation.id,
            )
        )
        await store.append_event(fleet_id=other.id, type="noise", payload={}, at=now)
    assert ids == sorted(ids)
    assert len(set(ids)) == 5

    listed = await store.list_events(fleet.id, after=after)
    assert [e.id for e in listed] == ids
    first = listed[0]
    assert first.type == "test.untyped"
    assert first.payload == {"n": 0, "nested": {"models": ["a", "b"]}, "ok": True, "none": None}
    assert (first.fleet_id, first.domain_id, first.slot_id, first.operation_id) == (
        fleet.id,
        fleet.domains[1].id,
        slot.id,
        operation.id,
    )
    assert first.created_at == now

    page = await store.list_events(fleet.id, after=ids[1], limit=2)
    assert [e.id for e in page] == ids[2:4]
    assert await store.list_events(fleet.id, after=ids[-1]) == []
    assert await store.list_events(uuid4()) == []


async def test_the_layout_apply_is_audited(store: StateStore, fleet: FleetSnapshot) -> None:
    (event,) = await store.list_events(fleet.id)
    assert event.type == EventType.FLEET_LAYOUT_APPLIED
    assert event.payload == {
        "fleetCreated": True,
        "domainsCreated": 2,
        "slotsCreated": 8,
        "pointerSet": True,
    }


async def test_bad_events_are_refused(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    with pytest.raises(TypeError, match="JSON"):
        await store.append_event(fleet_id=fleet.id, type="x", payload={"when": now}, at=now)
    with pytest.raises(TypeError, match="JSON"):
        await store.append_event(fleet_id=fleet.id, type="x", payload={"x": float("nan")}, at=now)
    for bad_type in ("", "t" * 129):
        with pytest.raises(ValueError, match="event type"):
            await store.append_event(fleet_id=fleet.id, type=bad_type, payload={}, at=now)
    with pytest.raises(ConstraintViolationError):
        await store.append_event(fleet_id=uuid4(), type="x", payload={}, at=now)
    with pytest.raises(ConstraintViolationError):
        await store.append_event(
            fleet_id=fleet.id, type="x", payload={}, at=now, operation_id=uuid4()
        )
    with pytest.raises(ValueError, match="limit"):
        await store.list_events(fleet.id, limit=0)
    with pytest.raises(ValueError, match="limit"):
        await store.list_events(fleet.id, limit=1001)
    with pytest.raises(ValueError, match="after"):
        await store.list_events(fleet.id, after=-1)


async def test_list_domain_events_newest_first_by_type(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha, beta = fleet.domains[0].id, fleet.domains[1].id
    wanted = []
    for n in range(4):
        wanted.append(
            await store.append_event(
                fleet_id=fleet.id, type="test.a", payload={"n": n}, at=now, domain_id=beta
            )
        )
        await store.append_event(
            fleet_id=fleet.id, type="test.b", payload={"n": n}, at=now, domain_id=beta
        )
        await store.append_event(
            fleet_id=fleet.id, type="test.a", payload={"n": n}, at=now, domain_id=alpha
        )
    newest = list(reversed(wanted))
    found = await store.list_domain_events(fleet.id, beta, types={"test.a"})
    assert [e.id for e in found] == newest
    page = await store.list_domain_events(fleet.id, beta, types={"test.a"}, limit=2)
    assert [e.id for e in page] == newest[:2]
    rest = await store.list_domain_events(
        fleet.id, beta, types={"test.a"}, before=page[-1].id, limit=2
    )
    assert [e.id for e in rest] == newest[2:]
    both = await store.list_domain_events(fleet.id, beta, types={"test.a", "test.b"})
    assert len(both) == 8
    assert await store.list_domain_events(fleet.id, beta, types=()) == []
    assert await store.list_domain_events(uuid4(), beta, types={"test.a"}) == []
    with pytest.raises(ValueError, match="limit"):
        await store.list_domain_events(fleet.id, beta, types={"test.a"}, limit=0)
