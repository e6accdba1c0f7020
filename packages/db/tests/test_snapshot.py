"""Reads: fleet references, ordering, and stored state that fails validation."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import uuid4

import pytest
import sqlalchemy as sa
from haru_db import MalformedFleetStateError, StateStore
from haru_db._tables import domains, events, fleets, operations, slots
from haru_protocol import (
    FleetLayout,
    FleetRoutePointer,
    FleetSnapshot,
    OperationError,
    OperationKind,
    OperationStep,
    SlotKind,
)
from sqlalchemy.ext.asyncio import AsyncEngine

LayoutFactory = Callable[..., FleetLayout]


async def _exec(engine: AsyncEngine, stmt: sa.Executable) -> None:
    async with engine.begin() as conn:
        await conn.execute(stmt)


async def test_lookup_by_slug_and_by_id_in_any_case(
    store: StateStore, fleet: FleetSnapshot
) -> None:
    assert await store.get_fleet_snapshot("fleet") == fleet
    assert await store.get_fleet_snapshot(str(fleet.id)) == fleet
    assert await store.get_fleet_snapshot(str(fleet.id).upper()) == fleet
    for missing in ["nope", "Fleet", "bad slug", "", str(uuid4()), "x" * 5000]:
        assert await store.get_fleet_snapshot(missing) is None
        assert await store.get_fleet_route_pointer(missing) is None
    pointer = await store.get_fleet_route_pointer(str(fleet.id).upper())
    assert pointer == FleetRoutePointer(
        id=fleet.id, slug="fleet", active_domain_id=fleet.active_domain_id, route_revision=2
    )
    assert await store.get_fleet_route_pointer("fleet") == pointer


async def test_an_id_wins_over_a_slug_that_looks_like_a_uuid(
    store: StateStore, fleet: FleetSnapshot, make_layout: LayoutFactory, now: datetime
) -> None:
    impostor = str(fleet.id)  # a lowercase UUID is a valid slug
    await store.apply_fleet_layout(make_layout(impostor), at=now)
    found = await store.get_fleet_snapshot(impostor)
    assert found is not None
    assert found.id == fleet.id
    pointer = await store.get_fleet_route_pointer(impostor)
    assert pointer is not None
    assert pointer.id == fleet.id
    # A UUID-shaped slug that is nobody's id is found by slug.
    lonely = str(uuid4())
    await store.apply_fleet_layout(make_layout(lonely), at=now)
    by_slug = await store.get_fleet_snapshot(lonely)
    assert by_slug is not None
    assert by_slug.slug == lonely


async def test_domains_by_slug_code_point_and_slots_by_gpu_and_kind(
    store: StateStore,
    make_layout: LayoutFactory,
    domain_document: Callable[..., dict[str, Any]],
    slot_document: Callable[..., dict[str, Any]],
    now: datetime,
) -> None:
    slugs = ["b", "a10", "a-2", "a2", "a"]
    mixed = [
        slot_document("training", 2),
        slot_document("inference", 10, "m10"),
        slot_document("inference", 2, "m2"),
        slot_document("training", 0),
        slot_document("inference", 0, "m0"),
    ]
    layout = make_layout(
        "ordered",
        active="b",
        domains=[domain_document(s, slots=mixed) for s in slugs],
    )
    await store.apply_fleet_layout(layout, at=now)
    snapshot = await store.get_fleet_snapshot("ordered")
    assert snapshot is not None
    assert [d.slug for d in snapshot.domains] == sorted(slugs)
    for domain in snapshot.domains:
        assert [(s.gpu_index, s.kind) for s in domain.slots] == [
            (0, SlotKind.INFERENCE),
            (0, SlotKind.TRAINING),
            (2, SlotKind.INFERENCE),
            (2, SlotKind.TRAINING),
            (10, SlotKind.INFERENCE),
        ]


async def test_a_fleet_without_domains(
    store: StateStore, raw_engine: AsyncEngine, now: datetime
) -> None:
    fleet_id = uuid4()
    await _exec(
        raw_engine,
        sa.insert(fleets).values(
            id=fleet_id, slug="empty", policy={}, route_revision=1, created_at=now, updated_at=now
        ),
    )
    snapshot = await store.get_fleet_snapshot("empty")
    assert snapshot is not None
    assert (snapshot.id, snapshot.domains, snapshot.active_domain_id) == (fleet_id, (), None)


async def test_list_fleets(store: StateStore, make_layout: LayoutFactory, now: datetime) -> None:
    assert await store.list_fleets() == []
    for slug in ["zeta", "alpha-2", "alpha"]:
        await store.apply_fleet_layout(make_layout(slug), at=now)
    listed = await store.list_fleets()
    assert [p.slug for p in listed] == ["alpha", "alpha-2", "zeta"]
    assert all(p.route_revision == 2 and p.active_domain_id is not None for p in listed)


async def test_the_pointer_says_whether_a_promotion_is_in_flight(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    standby = next(d for d in fleet.domains if d.id != fleet.active_domain_id)

    async def in_flight() -> tuple[bool, bool]:
        pointer = await store.get_fleet_route_pointer("fleet")
        assert pointer is not None
        (listed,) = await store.list_fleets()
        return pointer.promotion_in_flight, listed.promotion_in_flight

    assert await in_flight() == (False, False)
    demote, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=standby.id, at=now
    )
    assert created
    assert await in_flight() == (False, False)  # a demote moves no traffic
    assert await store.fail_operation(
        demote.id, error=OperationError(step=None, code="step_timeout", message="x"), at=now
    )
    promote, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=standby.id, at=now
    )
    assert created
    assert await in_flight() == (True, True)  # pending
    assert await store.claim_operation(promote.id, first_step=OperationStep.STOP_TRAINING, at=now)
    assert await in_flight() == (True, True)  # running
    assert await store.fail_operation(
        promote.id, error=OperationError(step=None, code="step_timeout", message="x"), at=now
    )
    assert await in_flight() == (False, False)


async def test_the_stored_route_lease_only_grows(store: StateStore, fleet: FleetSnapshot) -> None:
    assert fleet.route_lease_ms is None
    before = await store.get_fleet_route_pointer("fleet")

    async def stored() -> int | None:
        snapshot = await store.get_fleet_snapshot("fleet")
        assert snapshot is not None
        return snapshot.route_lease_ms

    assert await store.record_route_lease(fleet.id, 300)
    assert await stored() == 300
    assert not await store.record_route_lease(fleet.id, 300)
    assert not await store.record_route_lease(fleet.id, 100)  # a shorter lease never lowers it
    assert await stored() == 300
    assert await store.record_route_lease(fleet.id, 1_000)
    assert await stored() == 1_000
    assert await store.get_route_lease_ms(fleet.id) == 1_000
    assert await store.get_route_lease_ms(uuid4()) is None
    assert not await store.record_route_lease(uuid4(), 5_000)  # no such fleet
    with pytest.raises(ValueError, match="lease_ms"):
        await store.record_route_lease(fleet.id, -1)
    assert await store.get_fleet_route_pointer("fleet") == before  # the pointer did not move


# ---- malformed stored state ------------------------------------------------------------------


async def _corrupt_domain(engine: AsyncEngine, fleet: FleetSnapshot, **values: Any) -> None:
    await _exec(
        engine, sa.update(domains).where(domains.c.id == fleet.domains[0].id).values(**values)
    )


@pytest.mark.parametrize(
    "values",
    [
        {"placement": {"cloud": "nowhere", "region": "x", "accelerator": "y"}},
        {"placement": {"cloud": "aws", "region": "x", "accelerator": "y", "typo": 1}},
        {"placement": ["aws"]},
        {"supervisor_url": "ftp://admin:hunter2@example"},
    ],
)
async def test_malformed_domain_rows(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, values: dict[str, Any]
) -> None:
    await _corrupt_domain(raw_engine, fleet, **values)
    with pytest.raises(MalformedFleetStateError, match=str(fleet.id)) as caught:
        await store.get_fleet_snapshot(fleet.slug)
    assert "hunter2" not in str(caught.value)
    # The narrow routing read does not touch domain documents.
    assert await store.get_fleet_route_pointer(fleet.slug) is not None


@pytest.mark.parametrize("policy", [{"autoFailover": "yes"}, {"unknownKey": 1}, [1, 2], "text"])
async def test_a_malformed_policy(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, policy: Any
) -> None:
    await _exec(raw_engine, sa.update(fleets).where(fleets.c.id == fleet.id).values(policy=policy))
    with pytest.raises(MalformedFleetStateError):
        await store.get_fleet_snapshot(fleet.slug)


async def test_a_slot_whose_kind_differs_from_its_spec(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine
) -> None:
    inference = next(s for s in fleet.domains[0].slots if s.kind is SlotKind.INFERENCE)
    await _exec(
        raw_engine,
        sa.update(slots)
        .where(slots.c.id == inference.id)
        .values(kind="training", state="idle", gpu_index=9),
    )
    with pytest.raises(MalformedFleetStateError):
        await store.get_fleet_snapshot(fleet.slug)


async def test_a_slot_spec_with_another_gpu(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine
) -> None:
    slot = fleet.domains[0].slots[0]
    await _exec(raw_engine, sa.update(slots).where(slots.c.id == slot.id).values(gpu_index=9))
    with pytest.raises(MalformedFleetStateError):
        await store.get_fleet_snapshot(fleet.slug)


async def test_a_malformed_operation_error(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine, now: datetime
) -> None:
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    await _exec(
        raw_engine,
        sa.update(operations).where(operations.c.id == operation.id).values(error={"code": 5}),
    )
    with pytest.raises(MalformedFleetStateError, match=str(operation.id)):
        await store.get_operation(operation.id)
    with pytest.raises(MalformedFleetStateError):
        await store.get_in_flight_operation(fleet.id)


async def test_a_malformed_event_payload(
    store: StateStore, fleet: FleetSnapshot, raw_engine: AsyncEngine
) -> None:
    await _exec(
        raw_engine, sa.update(events).where(events.c.fleet_id == fleet.id).values(payload=[1])
    )
    with pytest.raises(MalformedFleetStateError):
        await store.list_events(fleet.id)


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE domains SET placement = 'not json'",
        "UPDATE domains SET state_updated_at = 'yesterday'",
        "UPDATE slots SET spec = '{\"kind\": '",
        "UPDATE slots SET id = 'not-a-uuid' WHERE gpu_index = 1 AND kind = 'training' "
        "AND domain_id = (SELECT id FROM domains WHERE slug = 'beta')",
    ],
)
async def test_sqlite_text_that_does_not_decode(
    sqlite_store: StateStore, make_layout: LayoutFactory, now: datetime, statement: str
) -> None:
    # PostgreSQL types refuse such values on write; SQLite stores whatever text it is given.
    await sqlite_store.apply_fleet_layout(make_layout(), at=now)
    from haru_db._engine import create_engine

    engine = create_engine(sqlite_store.url)
    try:
        async with engine.begin() as conn:
            await conn.exec_driver_sql(statement)
    except sa.exc.IntegrityError:
        pytest.fail("the corruption itself was refused")
    finally:
        await engine.dispose()
    with pytest.raises(MalformedFleetStateError):
        await sqlite_store.get_fleet_snapshot("fleet")
