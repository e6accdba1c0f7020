"""A fleet's policy patch: read with its version, replaced by one compare-and-swap statement."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from uuid import uuid4

import pytest
import sqlalchemy as sa
from haru_db import HaruDbError, StateStore
from haru_db._tables import fleets
from haru_protocol import FleetLayout, FleetPolicyChanged, Policy
from sqlalchemy.ext.asyncio import AsyncEngine

LayoutFactory = Callable[..., FleetLayout]
RefuseEvents = Callable[[str], AbstractAsyncContextManager[None]]


async def test_a_replace_lands_on_the_version_it_read_and_the_next_tick_sees_it(
    store: StateStore, make_layout: LayoutFactory, now: datetime
) -> None:
    result = await store.apply_fleet_layout(
        make_layout("f", policy={"autoFailover": True, "wakeTimeoutMs": 5000}), at=now
    )
    before = await store.get_fleet_snapshot("f")
    assert before is not None
    stored = await store.get_fleet_policy(result.fleet_id)
    assert stored is not None
    assert stored.patch == {"autoFailover": True, "wakeTimeoutMs": 5000}
    new = {"autoFailover": True, "degradedGraceMs": 2000}
    later = now + timedelta(seconds=1)
    assert await store.replace_fleet_policy(
        result.fleet_id, version=stored.version, patch=new, at=later
    )
    after = await store.get_fleet_snapshot("f")
    assert after is not None
    assert after.policy == Policy(auto_failover=True, degraded_grace_ms=2000)
    # The routing pointer does not move.
    assert (after.active_domain_id, after.route_revision) == (
        before.active_domain_id,
        before.route_revision,
    )
    again = await store.get_fleet_policy(result.fleet_id)
    assert again is not None
    assert again.patch == new
    assert again.version != stored.version


async def test_a_replace_from_a_stale_version_loses(
    store: StateStore, make_layout: LayoutFactory, now: datetime
) -> None:
    result = await store.apply_fleet_layout(make_layout("f"), at=now)
    stored = await store.get_fleet_policy(result.fleet_id)
    assert stored is not None
    assert stored.patch == {}
    first = {"degradedGraceMs": 1000}
    assert await store.replace_fleet_policy(
        result.fleet_id, version=stored.version, patch=first, at=now
    )
    # Read before the first replace landed: refused, the first writer's value stays.
    assert not await store.replace_fleet_policy(
        result.fleet_id, version=stored.version, patch={"degradedGraceMs": 9}, at=now
    )
    current = await store.get_fleet_policy(result.fleet_id)
    assert current is not None
    assert current.patch == first


async def test_racing_replaces_from_one_version_land_once(
    store: StateStore, make_layout: LayoutFactory, now: datetime
) -> None:
    result = await store.apply_fleet_layout(make_layout("f"), at=now)
    stored = await store.get_fleet_policy(result.fleet_id)
    assert stored is not None
    landed = await asyncio.gather(
        *(
            store.replace_fleet_policy(
                result.fleet_id, version=stored.version, patch={"degradedGraceMs": ms}, at=now
            )
            for ms in (1000, 2000, 3000, 4000)
        )
    )
    assert sum(landed) == 1
    winner = (1000, 2000, 3000, 4000)[landed.index(True)]
    current = await store.get_fleet_policy(result.fleet_id)
    assert current is not None
    assert current.patch == {"degradedGraceMs": winner}


async def test_the_version_is_the_stored_text_whatever_its_spacing_or_order(
    store: StateStore, make_layout: LayoutFactory, raw_engine: AsyncEngine, now: datetime
) -> None:
    # Written by another tool (or an older release): no re-serialisation could reproduce it.
    result = await store.apply_fleet_layout(make_layout("f"), at=now)
    async with raw_engine.begin() as conn:
        await conn.execute(
            sa.update(fleets)
            .where(fleets.c.id == result.fleet_id)
            .values(policy=sa.text(r"""'{"wakeTimeoutMs"\:7,  "autoFailover" \: true}'"""))
        )
    stored = await store.get_fleet_policy(result.fleet_id)
    assert stored is not None
    assert stored.patch == {"wakeTimeoutMs": 7, "autoFailover": True}
    assert await store.replace_fleet_policy(
        result.fleet_id, version=stored.version, patch={"autoFailover": False}, at=now
    )
    snapshot = await store.get_fleet_snapshot("f")
    assert snapshot is not None
    assert snapshot.policy == Policy(auto_failover=False)


async def test_an_unknown_fleet_has_no_policy_to_replace(store: StateStore, now: datetime) -> None:
    missing = uuid4()
    assert await store.get_fleet_policy(missing) is None
    assert not await store.replace_fleet_policy(missing, version="{}", patch={}, at=now)


def _changed(old: dict[str, object], new: dict[str, object]) -> FleetPolicyChanged:
    return FleetPolicyChanged(
        old=old,
        new=new,
        changed=tuple(sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))),
    )


async def test_a_replace_appends_its_event_in_the_same_statement_and_a_loser_appends_none(
    store: StateStore, make_layout: LayoutFactory, now: datetime
) -> None:
    result = await store.apply_fleet_layout(make_layout("f"), at=now)
    stored = await store.get_fleet_policy(result.fleet_id)
    assert stored is not None
    before = await store.list_events(result.fleet_id)
    landed = await asyncio.gather(
        *(
            store.replace_fleet_policy(
                result.fleet_id,
                version=stored.version,
                patch={"degradedGraceMs": ms},
                at=now,
                events=(_changed(stored.patch, {"degradedGraceMs": ms}),),
            )
            for ms in (1000, 2000, 3000)
        )
    )
    assert sum(landed) == 1
    winner = (1000, 2000, 3000)[landed.index(True)]
    added = (await store.list_events(result.fleet_id))[len(before) :]
    # Exactly the winner's event: the two swaps that lost appended nothing.
    assert [(e.type, e.payload) for e in added] == [
        (
            "fleet.policy.changed",
            {"old": {}, "new": {"degradedGraceMs": winner}, "changed": ["degradedGraceMs"]},
        )
    ]
    assert [(e.fleet_id, e.domain_id, e.created_at) for e in added] == [
        (result.fleet_id, None, now)
    ]


async def test_a_policy_whose_event_cannot_be_stored_is_not_changed(
    store: StateStore, make_layout: LayoutFactory, now: datetime, refuse_events: RefuseEvents
) -> None:
    result = await store.apply_fleet_layout(make_layout("f"), at=now)
    stored = await store.get_fleet_policy(result.fleet_id)
    assert stored is not None
    before = await store.list_events(result.fleet_id)
    new: dict[str, object] = {"autoFailover": False}
    async with refuse_events("fleet.policy.changed"):
        with pytest.raises(HaruDbError):
            await store.replace_fleet_policy(
                result.fleet_id,
                version=stored.version,
                patch=new,
                at=now,
                events=(_changed(stored.patch, new),),
            )
    # Neither the change nor its event: one statement, so never one without the other.
    assert await store.get_fleet_policy(result.fleet_id) == stored
    assert await store.list_events(result.fleet_id) == before
