"""``domains.connect_failed_at``: the proxies' refused connects, shared by every replica."""

from __future__ import annotations

from datetime import datetime, timedelta

from haru_db import StateStore
from haru_protocol import FleetSnapshot


async def test_a_stamp_is_read_back_and_only_moves_forward(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha = fleet.domains[0]
    assert alpha.connect_failed_at is None
    assert await store.record_connect_failed(alpha.id, at=now)
    later = now + timedelta(seconds=2)
    assert await store.record_connect_failed(alpha.id, at=later)
    # An older stamp (a slow process) never moves it back; the same time is no change.
    assert not await store.record_connect_failed(alpha.id, at=now + timedelta(seconds=1))
    assert not await store.record_connect_failed(alpha.id, at=later)
    snapshot = await store.get_fleet_snapshot(str(fleet.id))
    assert snapshot is not None
    read = {d.slug: d for d in snapshot.domains}
    assert read[alpha.slug].connect_failed_at == later
    assert all(d.connect_failed_at is None for d in snapshot.domains if d.id != alpha.id)


async def test_a_stamp_moves_neither_the_route_nor_the_domain(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha = fleet.domains[0]
    before = await store.get_fleet_route_pointer(str(fleet.id))
    assert await store.record_connect_failed(alpha.id, at=now + timedelta(seconds=5))
    after = await store.get_fleet_route_pointer(str(fleet.id))
    assert before == after
    snapshot = await store.get_fleet_snapshot(str(fleet.id))
    assert snapshot is not None
    stamped = next(d for d in snapshot.domains if d.id == alpha.id)
    assert stamped.state is alpha.state
    assert stamped.last_seen_at == alpha.last_seen_at


async def test_a_stamp_from_the_future_is_clamped_by_the_tick(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha = fleet.domains[0]
    assert await store.record_connect_failed(alpha.id, at=now + timedelta(hours=1))
    assert await store.clamp_future_times(fleet.id, at=now) >= 1
    snapshot = await store.get_fleet_snapshot(str(fleet.id))
    assert snapshot is not None
    assert next(d for d in snapshot.domains if d.id == alpha.id).connect_failed_at == now
