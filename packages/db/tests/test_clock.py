"""The database's clock (the time source of every process) and clamping times from the future."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru_db import StateStore
from haru_protocol import FleetSnapshot, OperationKind


async def test_database_now_is_aware_utc_and_moves_forward(store: StateStore) -> None:
    first = await store.database_now()
    # The test process shares the database's host: its clock agrees to within the read.
    assert abs(first - datetime.now(UTC)) < timedelta(seconds=5)
    assert first.utcoffset() == timedelta(0)
    later = await store.database_now()
    assert later >= first


async def test_times_from_the_future_are_clamped_to_now_and_others_kept(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    alpha, beta = fleet.domains[0], fleet.domains[1]
    ahead = now + timedelta(hours=3)
    assert await store.mark_domain_seen(alpha.id, at=ahead)
    assert await store.mark_domain_seen(beta.id, at=now - timedelta(seconds=5))
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=beta.id, at=ahead
    )
    assert created
    assert await store.clamp_future_times(fleet.id, operation_ids=[operation.id], at=now) == 2
    after = await store.get_fleet_snapshot(str(fleet.id))
    assert after is not None
    assert after.domain(alpha.id).last_seen_at == now  # type: ignore[union-attr]
    assert after.domain(beta.id).last_seen_at == now - timedelta(seconds=5)  # type: ignore[union-attr]
    stored = await store.get_operation(operation.id)
    assert stored is not None
    assert stored.created_at == now
    # Idempotent: nothing lies ahead any more, and a heartbeat now lands again.
    assert await store.clamp_future_times(fleet.id, operation_ids=[operation.id], at=now) == 0
    assert await store.mark_domain_seen(alpha.id, at=now + timedelta(seconds=1))
