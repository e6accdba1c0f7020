"""The schema's own constraints (DESIGN 5.2), exercised with raw statements on both engines."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa
from haru_db._tables import domains, fleets, operations, slots
from haru_protocol import FleetSnapshot
from sqlalchemy.exc import DataError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncEngine

BAD_SLUGS = ["", "-a", "a-", "a--b", "A", "a_b", "a.b", "a b", "a" * 64, "ä"]
GOOD_SLUGS = ["a", "0", "a-b", "a1-b2-c3", "a" * 63]


async def _run(engine: AsyncEngine, stmt: sa.Executable) -> None:
    async with engine.begin() as conn:
        await conn.execute(stmt)


def _fleet_row(now: datetime, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": uuid4(),
        "slug": f"f-{uuid4().hex[:8]}",
        "route_revision": 1,
        "policy": {},
        "created_at": now,
        "updated_at": now,
    }
    row.update(values)
    return row


def _domain_row(fleet_id: UUID, now: datetime, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": uuid4(),
        "fleet_id": fleet_id,
        "slug": f"d-{uuid4().hex[:8]}",
        "state": "ready",
        "provider": "static",
        "placement": {},
        "state_updated_at": now,
        "created_at": now,
        "updated_at": now,
    }
    row.update(values)
    return row


def _slot_row(domain_id: UUID, now: datetime, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": uuid4(),
        "domain_id": domain_id,
        "gpu_index": 7,
        "kind": "inference",
        "state": "sleeping",
        "spec": {},
        "state_updated_at": now,
        "created_at": now,
        "updated_at": now,
    }
    row.update(values)
    return row


def _operation_row(fleet: FleetSnapshot, now: datetime, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": uuid4(),
        "fleet_id": fleet.id,
        "kind": "promote",
        "state": "pending",
        "target_domain_id": fleet.domains[1].id,
        "created_at": now,
        "updated_at": now,
    }
    row.update(values)
    return row


@pytest.mark.parametrize("slug", BAD_SLUGS)
async def test_bad_slugs_are_refused(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime, slug: str
) -> None:
    # PostgreSQL refuses an over-long slug by its column type, SQLite by the CHECK.
    with pytest.raises((IntegrityError, DataError)):
        await _run(raw_engine, sa.insert(fleets).values(_fleet_row(now, slug=slug)))
    with pytest.raises((IntegrityError, DataError)):
        await _run(raw_engine, sa.insert(domains).values(_domain_row(fleet.id, now, slug=slug)))


async def test_good_slugs_are_accepted(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    for slug in GOOD_SLUGS:
        await _run(raw_engine, sa.insert(fleets).values(_fleet_row(now, slug=slug)))
        await _run(raw_engine, sa.insert(domains).values(_domain_row(fleet.id, now, slug=slug)))
    # Stored as given: neither truncated, nor case-folded, nor padded.
    async with raw_engine.connect() as conn:
        fleet_slugs = set((await conn.execute(sa.select(fleets.c.slug))).scalars())
        domain_slugs = set(
            (
                await conn.execute(sa.select(domains.c.slug).where(domains.c.fleet_id == fleet.id))
            ).scalars()
        )
    assert set(GOOD_SLUGS) <= fleet_slugs
    assert set(GOOD_SLUGS) <= domain_slugs


async def test_fleet_slug_is_unique(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    with pytest.raises(IntegrityError):
        await _run(raw_engine, sa.insert(fleets).values(_fleet_row(now, slug=fleet.slug)))


async def test_domain_slug_is_unique_per_fleet(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    with pytest.raises(IntegrityError):
        await _run(raw_engine, sa.insert(domains).values(_domain_row(fleet.id, now, slug="alpha")))
    other = _fleet_row(now)
    await _run(raw_engine, sa.insert(fleets).values(other))
    await _run(raw_engine, sa.insert(domains).values(_domain_row(other["id"], now, slug="alpha")))


async def test_slot_is_unique_per_domain_gpu_and_kind(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    domain_id = fleet.domains[0].id
    with pytest.raises(IntegrityError):
        await _run(raw_engine, sa.insert(slots).values(_slot_row(domain_id, now, gpu_index=0)))
    await _run(raw_engine, sa.insert(slots).values(_slot_row(domain_id, now, gpu_index=5)))
    await _run(
        raw_engine,
        sa.insert(slots).values(
            _slot_row(domain_id, now, gpu_index=5, kind="training", state="idle")
        ),
    )


@pytest.mark.parametrize(
    "values",
    [
        {"gpu_index": -1},
        {"kind": "storage"},
        {"kind": "training", "state": "serving"},
        {"kind": "inference", "state": "idle"},
        {"state": "asleep"},
    ],
)
async def test_slot_checks(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime, values: dict[str, Any]
) -> None:
    with pytest.raises(IntegrityError):
        await _run(
            raw_engine, sa.insert(slots).values(_slot_row(fleet.domains[0].id, now, **values))
        )


@pytest.mark.parametrize("values", [{"provider": "aws"}, {"state": "sleeping"}])
async def test_domain_checks(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime, values: dict[str, Any]
) -> None:
    with pytest.raises(IntegrityError):
        await _run(raw_engine, sa.insert(domains).values(_domain_row(fleet.id, now, **values)))


async def test_route_revision_is_positive(raw_engine: AsyncEngine, fleet: FleetSnapshot) -> None:
    with pytest.raises(IntegrityError):
        await _run(
            raw_engine, sa.update(fleets).where(fleets.c.id == fleet.id).values(route_revision=0)
        )


async def test_the_pointer_stays_inside_its_fleet(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    other = _fleet_row(now)
    stranger = _domain_row(other["id"], now)
    await _run(raw_engine, sa.insert(fleets).values(other))
    await _run(raw_engine, sa.insert(domains).values(stranger))
    with pytest.raises(IntegrityError):
        await _run(
            raw_engine,
            sa.update(fleets)
            .where(fleets.c.id == fleet.id)
            .values(active_domain_id=stranger["id"]),
        )
    with pytest.raises(IntegrityError):
        await _run(
            raw_engine,
            sa.insert(operations).values(
                _operation_row(fleet, now, target_domain_id=stranger["id"])
            ),
        )


async def test_one_in_flight_operation_per_fleet(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    done = {"state": "succeeded", "current_step": "probe", "finished_at": now}
    await _run(raw_engine, sa.insert(operations).values(_operation_row(fleet, now, **done)))
    await _run(raw_engine, sa.insert(operations).values(_operation_row(fleet, now, **done)))
    await _run(raw_engine, sa.insert(operations).values(_operation_row(fleet, now)))
    with pytest.raises(IntegrityError):
        await _run(raw_engine, sa.insert(operations).values(_operation_row(fleet, now)))
    with pytest.raises(IntegrityError):
        await _run(
            raw_engine,
            sa.insert(operations).values(
                _operation_row(fleet, now, state="running", current_step="probe")
            ),
        )


@pytest.mark.parametrize(
    "values",
    [
        {"kind": "rollback"},
        {"state": "paused"},
        {"state": "running"},
        {"state": "running", "current_step": "sleep_vllm"},
        {"kind": "demote", "state": "running", "current_step": "probe"},
        {"state": "succeeded", "current_step": "probe"},
        {"state": "pending", "finished_at": "now"},
    ],
)
async def test_operation_checks(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime, values: dict[str, Any]
) -> None:
    if values.get("finished_at") == "now":
        values = {**values, "finished_at": now}
    with pytest.raises(IntegrityError):
        await _run(raw_engine, sa.insert(operations).values(_operation_row(fleet, now, **values)))


async def test_timestamps_must_be_timezone_aware(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    naive = now.replace(tzinfo=None)
    with pytest.raises(StatementError, match="timezone-aware"):
        await _run(
            raw_engine,
            sa.update(domains)
            .where(domains.c.id == fleet.domains[0].id)
            .values(last_seen_at=naive),
        )


async def test_timestamps_are_stored_in_utc_and_read_back_aware(
    raw_engine: AsyncEngine, fleet: FleetSnapshot, now: datetime
) -> None:
    from datetime import timezone

    tokyo = now.astimezone(timezone(timedelta(hours=9)))
    domain_id = fleet.domains[0].id
    await _run(
        raw_engine, sa.update(domains).where(domains.c.id == domain_id).values(last_seen_at=tokyo)
    )
    async with raw_engine.connect() as conn:
        stored = (
            await conn.execute(sa.select(domains.c.last_seen_at).where(domains.c.id == domain_id))
        ).scalar_one()
    assert stored == now
    assert stored.utcoffset() == timedelta(0)
