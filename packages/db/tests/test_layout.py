"""apply_fleet_layout: idempotent, additive, slot posture decided against the live pointer."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from haru_db import LayoutApplyResult, StateStore
from haru_db._tables import fleets
from haru_protocol import (
    DomainState,
    FleetLayout,
    FleetSnapshot,
    OperationKind,
    OperationStep,
    Policy,
    Provider,
    SlotKind,
)
from sqlalchemy.ext.asyncio import AsyncEngine

LayoutFactory = Callable[..., FleetLayout]


def _postures(snapshot: FleetSnapshot) -> dict[tuple[str, int, str], str]:
    return {
        (d.slug, s.gpu_index, s.kind.value): s.state.value
        for d in snapshot.domains
        for s in d.slots
    }


async def _snapshot(store: StateStore, slug: str) -> FleetSnapshot:
    snapshot = await store.get_fleet_snapshot(slug)
    assert snapshot is not None
    return snapshot


async def test_a_new_fleet(
    store: StateStore,
    make_layout: LayoutFactory,
    domain_document: Callable[..., dict[str, Any]],
    now: datetime,
) -> None:
    layout = make_layout(
        "fleet", domains=["alpha", "beta", domain_document("gamma", provider="skypilot")]
    )
    result = await store.apply_fleet_layout(layout, at=now)
    assert result == LayoutApplyResult(
        fleet_id=result.fleet_id,
        fleet_created=True,
        domains_created=3,
        slots_created=12,
        pointer_set=True,
    )
    snapshot = await _snapshot(store, "fleet")
    assert snapshot.id == result.fleet_id
    assert snapshot.display_name == "Test fleet"
    assert snapshot.policy == Policy()
    assert snapshot.route_revision == 2
    assert snapshot.active_domain_id == snapshot.domains[0].id
    assert [(d.slug, d.state, d.provider) for d in snapshot.domains] == [
        # Static ones too: not routable until a heartbeat has confirmed them.
        ("alpha", DomainState.PROVISIONING, Provider.STATIC),
        ("beta", DomainState.PROVISIONING, Provider.STATIC),
        ("gamma", DomainState.PROVISIONING, Provider.SKYPILOT),
    ]
    declared = {d.slug: d for d in layout.domains}
    for domain in snapshot.domains:
        assert domain.fleet_id == snapshot.id
        assert domain.placement == declared[domain.slug].placement
        assert domain.supervisor_url == declared[domain.slug].supervisor_url
        assert domain.serving_base_url == declared[domain.slug].serving_base_url
        assert (domain.last_seen_at, domain.state_updated_at) == (None, now)
        assert [s.spec for s in domain.slots] == sorted(
            declared[domain.slug].slots, key=lambda s: (s.gpu_index, s.kind.value)
        )
    assert _postures(snapshot) == {
        **{("alpha", g, "inference"): "serving" for g in (0, 1)},
        **{(d, g, "inference"): "sleeping" for d in ("beta", "gamma") for g in (0, 1)},
        **{(d, g, "training"): "idle" for d in ("alpha", "beta", "gamma") for g in (0, 1)},
    }


async def test_reapplying_changes_nothing(
    store: StateStore, fleet: FleetSnapshot, fleet_layout: FleetLayout, now: datetime
) -> None:
    events = await store.list_events(fleet.id)
    result = await store.apply_fleet_layout(fleet_layout, at=now + timedelta(hours=1))
    assert result == LayoutApplyResult(
        fleet_id=fleet.id,
        fleet_created=False,
        domains_created=0,
        slots_created=0,
        pointer_set=False,
    )
    assert not result.changed
    assert await _snapshot(store, fleet.slug) == fleet
    assert await store.list_events(fleet.id) == events


async def test_existing_rows_are_left_untouched(
    store: StateStore,
    fleet: FleetSnapshot,
    make_layout: LayoutFactory,
    domain_document: Callable[..., dict[str, Any]],
    slot_document: Callable[..., dict[str, Any]],
    now: datetime,
) -> None:
    changed_alpha = domain_document(
        "alpha",
        slots=[slot_document("inference", 0, "renamed"), slot_document("inference", 2, "extra")],
    )
    changed_alpha["placement"]["region"] = "eu-west-1"
    changed_alpha["supervisorUrl"] = "http://elsewhere:1"
    layout = make_layout(
        "fleet",
        domains=[changed_alpha, "beta", "delta"],
        policy={"autoFailover": True},
        display_name="Renamed",
        active="beta",
    )
    result = await store.apply_fleet_layout(layout, at=now + timedelta(hours=1))
    assert (result.fleet_created, result.domains_created, result.slots_created) == (False, 1, 5)
    assert not result.pointer_set
    after = await _snapshot(store, fleet.slug)
    assert (after.display_name, after.policy) == (fleet.display_name, fleet.policy)
    assert (after.active_domain_id, after.route_revision) == (fleet.active_domain_id, 2)
    alpha = after.domains[0]
    assert alpha.placement == fleet.domains[0].placement
    assert alpha.supervisor_url == fleet.domains[0].supervisor_url
    assert [s for s in alpha.slots if s.gpu_index != 2] == list(fleet.domains[0].slots)
    assert [s.spec.gpu_index for s in alpha.slots if s.kind is SlotKind.INFERENCE] == [0, 1, 2]
    assert after.domains[1] == fleet.domains[1]
    assert after.domains[2].slug == "delta"


async def test_a_partial_policy_patch_is_stored_as_written_and_resolved_on_read(
    store: StateStore, make_layout: LayoutFactory, raw_engine: AsyncEngine, now: datetime
) -> None:
    patch = {"autoFailover": True, "wakeTimeoutMs": 5000, "probe": {"prompt": "hello"}}
    await store.apply_fleet_layout(make_layout("patched", policy=patch), at=now)
    async with raw_engine.connect() as conn:
        stored = (
            await conn.execute(sa.select(fleets.c.policy).where(fleets.c.slug == "patched"))
        ).scalar_one()
    assert stored == patch
    snapshot = await _snapshot(store, "patched")
    assert snapshot.policy == Policy.model_validate(
        {"autoFailover": True, "wakeTimeoutMs": 5000, "probe": {"prompt": "hello", "maxTokens": 4}}
    )
    assert snapshot.policy.heartbeat_stale_ms == Policy().heartbeat_stale_ms


async def test_a_stored_patch_follows_the_current_defaults(
    store: StateStore, make_layout: LayoutFactory, raw_engine: AsyncEngine, now: datetime
) -> None:
    # A default that changes after the fleet was created applies to it (the key was never set).
    await store.apply_fleet_layout(make_layout("old", policy={"autoFailover": True}), at=now)
    async with raw_engine.begin() as conn:
        await conn.execute(
            sa.update(fleets).where(fleets.c.slug == "old").values(policy={"probeTimeoutMs": 7})
        )
    snapshot = await _snapshot(store, "old")
    assert snapshot.policy == Policy(probe_timeout_ms=7)


async def test_without_a_declared_active_everything_sleeps(
    store: StateStore, make_layout: LayoutFactory, now: datetime
) -> None:
    result = await store.apply_fleet_layout(make_layout("headless", active=None), at=now)
    assert not result.pointer_set
    snapshot = await _snapshot(store, "headless")
    assert (snapshot.active_domain_id, snapshot.route_revision) == (None, 1)
    assert {
        state for (_, _, kind), state in _postures(snapshot).items() if kind == "inference"
    } == {"sleeping"}
    # Declaring the active later does not wake slots that already sleep: no pointer.
    again = await store.apply_fleet_layout(make_layout("headless", active="alpha"), at=now)
    assert not again.pointer_set
    assert (await _snapshot(store, "headless")).active_domain_id is None


async def test_a_declared_active_added_later_takes_the_unset_pointer(
    store: StateStore, make_layout: LayoutFactory, now: datetime
) -> None:
    await store.apply_fleet_layout(make_layout("late", domains=["beta"], active=None), at=now)
    result = await store.apply_fleet_layout(
        make_layout("late", domains=["alpha", "beta"], active="alpha"), at=now
    )
    assert (result.domains_created, result.slots_created, result.pointer_set) == (1, 4, True)
    snapshot = await _snapshot(store, "late")
    assert snapshot.active_domain_id == snapshot.domains[0].id
    assert snapshot.route_revision == 2
    assert _postures(snapshot)[("alpha", 0, "inference")] == "serving"
    assert _postures(snapshot)[("beta", 0, "inference")] == "sleeping"


async def test_new_slots_take_their_posture_from_the_live_pointer(
    store: StateStore,
    fleet: FleetSnapshot,
    make_layout: LayoutFactory,
    domain_document: Callable[..., dict[str, Any]],
    slot_document: Callable[..., dict[str, Any]],
    now: datetime,
) -> None:
    # Promote beta: the live pointer now disagrees with the layout's declared active (alpha).
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.domains[1].id, at=now
    )
    assert await store.claim_operation(operation.id, first_step=OperationStep.SWITCH_ACTIVE, at=now)
    assert await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=fleet.domains[0].id,
        target_domain_id=fleet.domains[1].id,
        operation_id=operation.id,
        at=now,
    )
    grown = [
        domain_document(slug, slots=[slot_document("inference", 3, f"{slug}-new")])
        for slug in ("alpha", "beta")
    ]
    result = await store.apply_fleet_layout(make_layout("fleet", domains=grown), at=now)
    assert (result.slots_created, result.pointer_set) == (2, False)
    postures = _postures(await _snapshot(store, fleet.slug))
    assert postures[("alpha", 3, "inference")] == "sleeping"
    assert postures[("beta", 3, "inference")] == "serving"
    # The routing trigger only reacts to switch_active: the operation is untouched.
    again = await store.get_operation(operation.id)
    assert again is not None
    assert again.routing_committed is True
