"""``POST /v1/fleets/{ref}/apply``: the plan, its rules, and one CAS per row (both engines)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from aiohttp.test_utils import TestClient
from haru_db import StateStore
from haru_protocol import (
    ApplyResponse,
    EventType,
    FleetConfigChanged,
    FleetSnapshot,
    InferenceSlotSpec,
    OperationKind,
    TrainingSlotSpec,
    render_plan,
)
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._settings import Settings
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient

TOKEN = "apply-token-0123456789abc"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PLACEMENT = {"cloud": "aws", "region": "local", "accelerator": "EXAMPLE-GPU"}


def _domain(slug: str, port: int, models: dict[str, str]) -> dict[str, Any]:
    return {
        "slug": slug,
        "placement": PLACEMENT,
        "supervisorUrl": f"http://127.0.0.1:{port}",
        "servingBaseUrl": f"http://127.0.0.1:{port + 1}",
        "slots": [
            {
                "kind": "inference",
                "gpuIndex": 0,
                "models": [{"name": n, "servingUrl": u} for n, u in models.items()],
            },
            {
                "kind": "training",
                "gpuIndex": 1,
                "command": ["python", "train.py"],
                "checkpointDir": f"/ckpt/{slug}",
            },
        ],
    }


BASE: dict[str, Any] = {
    "slug": "shop",
    "activeDomainSlug": "a",
    "policy": {"degradedGraceMs": 5000},
    "domains": [
        _domain("a", 9100, {"chat": "http://127.0.0.1:9201/"}),
        _domain("b", 9300, {"chat": "http://127.0.0.1:9401/"}),
    ],
}


async def _client(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> TestClient[Any, Any]:
    # No reconcile loop: the supervisors of these layouts do not exist, nothing here ticks.
    settings = Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None)
    return await aiohttp_client(create_app(settings, store=store, clock=clock), headers=AUTH)


async def _apply(
    client: TestClient[Any, Any], layout: dict[str, Any], **body: Any
) -> tuple[int, Any]:
    response = await client.post("/v1/fleets/shop/apply", json={"layout": layout, **body})
    return response.status, await response.json()


async def _plan(client: TestClient[Any, Any], layout: dict[str, Any]) -> ApplyResponse:
    status, answer = await _apply(client, layout, dryRun=True)
    assert status == 200, answer
    return ApplyResponse.model_validate(answer)


async def _created(client: TestClient[Any, Any]) -> None:
    status, answer = await _apply(client, BASE)
    assert status == 200, answer
    assert answer["applied"] is True


async def _snapshot(store: StateStore) -> FleetSnapshot:
    fleet = await store.get_fleet_snapshot("shop")
    assert fleet is not None
    return fleet


def _slot(fleet: FleetSnapshot, domain: str, gpu: int) -> Any:
    found = next(d for d in fleet.domains if d.slug == domain)
    return next(s.spec for s in found.slots if s.gpu_index == gpu)


GOLDEN = """\
fleet shop: 9 change(s)
  ~ fleet shop: displayName: none -> Shop
  + policy autoFailover: true, at the next tick
  - policy degradedGraceMs: 5000 (back to the default), at the next tick
  + domain b / inference gpu 0 / model embed: servingUrl http://127.0.0.1:9402/
  ~ domain b / inference gpu 0 / model chat: servingUrl: http://127.0.0.1:9401/ -> http://127.0.0.1:9411/
  ~ domain b / training gpu 1: command: python train.py -> python train.py --lr 3e-4 (a running trainer keeps running)
  + domain c: static, provisioning until its first good heartbeat
  + domain c / inference gpu 0
  + domain c / inference gpu 0 / model chat: servingUrl http://127.0.0.1:9601/"""  # noqa: E501


def _changed() -> dict[str, Any]:
    layout = copy.deepcopy(BASE)
    layout["displayName"] = "Shop"
    layout["policy"] = {"autoFailover": True}
    b = layout["domains"][1]
    b["slots"][0]["models"] = [
        {"name": "chat", "servingUrl": "http://127.0.0.1:9411/"},
        {"name": "embed", "servingUrl": "http://127.0.0.1:9402/"},
    ]
    b["slots"][1]["command"] = ["python", "train.py", "--lr", "3e-4"]
    c = _domain("c", 9500, {"chat": "http://127.0.0.1:9601/"})
    c["slots"] = c["slots"][:1]
    layout["domains"].append(c)
    return layout


async def test_a_standby_change_is_planned_exactly_then_applied_with_one_event_per_item(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    before = await _snapshot(store)
    assert render_plan((await _plan(client, BASE)).plan) == "fleet shop: no changes"

    planned = await _plan(client, _changed())
    assert render_plan(planned.plan) == GOLDEN
    assert not planned.applied
    assert await _snapshot(store) == before  # a dry run changes nothing

    revisions = [r.model_dump(mode="json", by_alias=True) for r in planned.plan.revisions]
    status, answer = await _apply(client, _changed(), revisions=revisions)
    assert status == 200, answer
    after = await _snapshot(store)
    assert after.display_name == "Shop"
    assert after.policy.auto_failover is True
    assert after.policy.degraded_grace_ms == 60_000
    chat_b = _slot(after, "b", 0)
    assert isinstance(chat_b, InferenceSlotSpec)
    assert [(m.name, m.serving_url) for m in chat_b.models] == [
        ("chat", "http://127.0.0.1:9411/"),
        ("embed", "http://127.0.0.1:9402/"),
    ]
    trainer = _slot(after, "b", 1)
    assert isinstance(trainer, TrainingSlotSpec)
    assert trainer.command == ("python", "train.py", "--lr", "3e-4")
    c = next(d for d in after.domains if d.slug == "c")
    assert c.state.value == "provisioning"
    assert [s.state.value for s in c.slots] == ["sleeping"]
    # The active domain and the pointer never moved.
    assert after.active_domain_id == before.active_domain_id
    assert after.route_revision == before.route_revision

    events = await store.list_events(after.id, limit=1000)
    changed = [e.data for e in events if e.type == EventType.FLEET_CONFIG_CHANGED]
    assert all(isinstance(e, FleetConfigChanged) for e in changed)
    assert sorted(e.path for e in changed) == sorted(i.path for i in planned.plan.items)  # type: ignore[union-attr]

    # The same layout again: nothing to do, and the old plan is stale now.
    assert render_plan((await _plan(client, _changed())).plan) == "fleet shop: no changes"
    status, answer = await _apply(client, _changed(), revisions=revisions)
    assert status == 409
    assert answer["error"]["code"] == "plan_stale"


async def test_changes_that_would_move_the_actives_traffic_are_refused(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    before = await _snapshot(store)
    for change in ("url", "removed", "serving-base"):
        layout = copy.deepcopy(BASE)
        a = layout["domains"][0]
        if change == "url":
            a["slots"][0]["models"][0]["servingUrl"] = "http://127.0.0.1:9999/"
        elif change == "removed":
            a["slots"][0]["models"] = [{"name": "other", "servingUrl": "http://127.0.0.1:9202/"}]
        else:
            a["servingBaseUrl"] = "http://127.0.0.1:9998"
        plan = (await _plan(client, layout)).plan
        assert plan.refused, change
        assert all("promote another domain first" in (i.refused or "") for i in plan.refused)
        status, answer = await _apply(client, layout)
        assert status == 409, answer
        assert answer["error"]["code"] == "change_refused"
        assert "promote another domain first" in answer["error"]["message"]
        assert await _snapshot(store) == before

    # Adding a model to the active moves no traffic: applied.
    layout = copy.deepcopy(BASE)
    layout["domains"][0]["slots"][0]["models"].append(
        {"name": "embed", "servingUrl": "http://127.0.0.1:9202/"}
    )
    status, answer = await _apply(client, layout)
    assert status == 200, answer
    added = _slot(await _snapshot(store), "a", 0)
    assert [m.name for m in added.models] == ["chat", "embed"]


async def test_removing_the_active_or_a_driven_domain_is_refused(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    fleet = await _snapshot(store)
    only_b = {**BASE, "activeDomainSlug": None, "domains": BASE["domains"][1:]}
    plan = (await _plan(client, only_b)).plan
    [item] = plan.items
    assert (item.action, item.path) == ("-", "domain a")
    assert item.refused is not None
    assert "is the active domain" in item.refused

    b = next(d for d in fleet.domains if d.slug == "b")
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.DEMOTE, target_domain_id=b.id, at=clock()
    )
    assert created
    only_a = {**BASE, "domains": BASE["domains"][:1]}
    [item] = (await _plan(client, only_a)).plan.items
    assert item.refused is not None
    assert f"operation {operation.id}" in item.refused
    # And a standby change while the operation drives it.
    changed = copy.deepcopy(BASE)
    changed["domains"][1]["slots"][0]["models"][0]["servingUrl"] = "http://127.0.0.1:9412/"
    status, answer = await _apply(client, changed)
    assert status == 409
    assert "drives domain 'b'" in answer["error"]["message"]


async def test_a_policy_patch_after_the_plan_makes_it_stale(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    planned = await _plan(client, _changed())
    patched = await client.patch("/v1/fleets/shop/policy", json={"wakeTimeoutMs": 1000})
    assert patched.status == 200
    revisions = [r.model_dump(mode="json", by_alias=True) for r in planned.plan.revisions]
    status, answer = await _apply(client, _changed(), revisions=revisions)
    assert status == 409
    assert answer["error"]["code"] == "plan_stale"
    assert (await _snapshot(store)).display_name is None


async def test_two_racing_applies_one_wins_per_row(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    layouts = []
    for port in (9421, 9431):
        layout = copy.deepcopy(BASE)
        layout["domains"][1]["slots"][0]["models"][0]["servingUrl"] = f"http://127.0.0.1:{port}/"
        layouts.append(layout)
    plans = [await _plan(client, layout) for layout in layouts]
    assert plans[0].plan.revisions == plans[1].plan.revisions
    results = await asyncio.gather(
        *(
            _apply(
                client,
                layout,
                revisions=[r.model_dump(mode="json", by_alias=True) for r in p.plan.revisions],
            )
            for layout, p in zip(layouts, plans, strict=True)
        )
    )
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 409], results
    winner = next(i for i, (status, _) in enumerate(results) if status == 200)
    stored = _slot(await _snapshot(store), "b", 0)
    assert stored.models[0].serving_url == f"http://127.0.0.1:{(9421, 9431)[winner]}/"
    loser = next(answer for status, answer in results if status == 409)
    assert loser["error"]["code"] == "plan_stale"


async def test_a_write_loses_to_a_promotion_created_after_its_plan(
    store: StateStore, clock: ManualClock
) -> None:
    """The guards ride the write itself: a plan read before the promotion cannot land after."""
    from haru_protocol import FleetLayout

    await store.apply_fleet_layout(FleetLayout.model_validate(BASE), at=clock())
    fleet = await _snapshot(store)
    revisions = await store.get_config_revisions(fleet.id)
    a, b = (next(d for d in fleet.domains if d.slug == s) for s in ("a", "b"))
    slot_b = next(s for s in b.slots if s.gpu_index == 0)
    assert isinstance(slot_b.spec, InferenceSlotSpec)
    spec = slot_b.spec.model_copy(update={"models": (slot_b.spec.models[0],)})
    _, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=b.id, at=clock()
    )
    assert created
    for moves in (False, True):
        assert (
            await store.update_slot_spec(
                slot_b.id,
                fleet_id=fleet.id,
                domain_id=b.id,
                revision=revisions[("slot", slot_b.id)],
                spec=spec,
                moves_traffic=moves,
                at=clock(),
            )
            is None
        )
    # The promotion drives a (its source) too.
    assert (
        await store.update_domain_config(
            a.id,
            fleet_id=fleet.id,
            revision=revisions[("domain", a.id)],
            layout=FleetLayout.model_validate(BASE).domains[0],
            moves_traffic=False,
            at=clock(),
        )
        is None
    )


async def test_a_traffic_moving_write_loses_on_the_active_and_lands_on_a_standby(
    store: StateStore, clock: ManualClock
) -> None:
    from haru_protocol import FleetLayout

    await store.apply_fleet_layout(FleetLayout.model_validate(BASE), at=clock())
    fleet = await _snapshot(store)
    revisions = await store.get_config_revisions(fleet.id)
    for slug, lands in (("a", False), ("b", True)):
        domain = next(d for d in fleet.domains if d.slug == slug)
        slot = next(s for s in domain.slots if s.gpu_index == 0)
        new = await store.update_slot_spec(
            slot.id,
            fleet_id=fleet.id,
            domain_id=domain.id,
            revision=revisions[("slot", slot.id)],
            spec=slot.spec,
            moves_traffic=True,
            at=clock(),
        )
        assert (new is not None) is lands, slug
        if lands:
            assert new == revisions[("slot", slot.id)] + 1


async def test_a_provisioned_domains_recorded_urls_are_neither_differences_nor_overwritten(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    layout = copy.deepcopy(BASE)
    layout["domains"].append(
        {
            "slug": "p",
            "provider": "skypilot",
            "placement": PLACEMENT,
            "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "chat"}]}],
        }
    )
    status, answer = await _apply(client, layout)
    assert status == 200, answer
    fleet = await _snapshot(store)
    p = next(d for d in fleet.domains if d.slug == "p")
    assert await store.claim_launch(p.id, expected_attempt=0, at=clock())
    assert await store.record_domain_address(
        p.id,
        attempt=1,
        supervisor_url="http://10.0.0.9:8701",
        serving_base_url="http://10.0.0.9:8000",
        model_urls={"chat": "http://10.0.0.9:8000/m/chat"},
        at=clock(),
    )
    assert render_plan((await _plan(client, layout)).plan) == "fleet shop: no changes"

    layout["domains"][2]["provisioning"] = {"vllmVersion": "0.34.0"}
    [item] = (await _plan(client, layout)).plan.items
    assert (item.action, item.path, item.refused) == ("~", "domain p", None)
    assert item.detail.startswith("provisioning: ")
    assert item.detail.endswith("(at the domain's next launch)")
    status, answer = await _apply(client, layout)
    assert status == 200, answer
    after = next(d for d in (await _snapshot(store)).domains if d.slug == "p")
    assert after.provisioning is not None
    assert after.provisioning.vllm_version == "0.34.0"
    assert after.supervisor_url == "http://10.0.0.9:8701"
    assert after.serving_base_url == "http://10.0.0.9:8000"
    chat = after.slots[0].spec
    assert isinstance(chat, InferenceSlotSpec)
    assert chat.models[0].serving_url == "http://10.0.0.9:8000/m/chat"


# ---- removal (migration 0012) -------------------------------------------------------------

REMOVAL_GOLDEN = """\
fleet shop: 2 change(s)
  - domain a / training gpu 1: python train.py
  - domain b: static"""


def _without_b() -> dict[str, Any]:
    layout = copy.deepcopy(BASE)
    layout["domains"] = layout["domains"][:1]
    layout["domains"][0]["slots"] = layout["domains"][0]["slots"][:1]
    return layout


async def _config_events(store: StateStore, fleet_id: Any) -> list[Any]:
    events = await store.list_events(fleet_id, limit=1000)
    return [e for e in events if e.type == EventType.FLEET_CONFIG_CHANGED]


async def test_a_standby_and_a_slot_are_removed_and_left_out_of_every_read(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    before = await _snapshot(store)
    b = next(d for d in before.domains if d.slug == "b")
    trainer_a = next(s for s in before.domains[0].slots if s.gpu_index == 1)
    planned = await _plan(client, _without_b())
    assert render_plan(planned.plan) == REMOVAL_GOLDEN
    assert not planned.plan.refused

    revisions = [r.model_dump(mode="json", by_alias=True) for r in planned.plan.revisions]
    status, answer = await _apply(client, _without_b(), revisions=revisions)
    assert status == 200, answer
    after = await _snapshot(store)
    assert [d.slug for d in after.domains] == ["a"]
    assert [s.gpu_index for s in after.domains[0].slots] == [0]
    assert after.active_domain_id == before.active_domain_id
    assert after.route_revision == before.route_revision
    # The API's reads leave them out too, and the plan is now empty.
    response = await client.get("/v1/fleets/shop")
    assert response.status == 200
    shown = await response.json()
    assert [d["slug"] for d in shown["domains"]] == ["a"]
    assert [s["gpuIndex"] for s in shown["domains"][0]["slots"]] == [0]
    assert render_plan((await _plan(client, _without_b())).plan) == "fleet shop: no changes"
    revised = {(r.table, r.id) for r in (await _plan(client, _without_b())).plan.revisions}
    assert ("domain", b.id) not in revised
    assert ("slot", trainer_a.id) not in revised
    # One event per item, each with its row.
    changed = await _config_events(store, after.id)
    assert [(e.data.action, e.data.path, e.domain_id, e.slot_id) for e in changed] == [
        ("-", "domain a / training gpu 1", after.domains[0].id, trainer_a.id),
        ("-", "domain b", b.id, None),
    ]
    assert [e.data.revision for e in changed] == [2, 2]
    # A promotion of the removed domain names nothing.
    response = await client.post("/v1/fleets/shop/promote", json={"targetDomainId": str(b.id)})
    assert response.status == 422, await response.text()
    assert (await response.json())["error"]["code"] == "invalid_target"
    assert await store.get_in_flight_operation(after.id) is None


async def test_a_removed_slug_and_slot_come_back_as_new_rows(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    old = await _snapshot(store)
    status, answer = await _apply(client, _without_b())
    assert status == 200, answer
    planned = await _plan(client, BASE)
    assert [(i.action, i.path) for i in planned.plan.items] == [
        ("+", "domain a / training gpu 1"),
        ("+", "domain b"),
        ("+", "domain b / inference gpu 0"),
        ("+", "domain b / inference gpu 0 / model chat"),
        ("+", "domain b / training gpu 1"),
    ]
    status, answer = await _apply(client, BASE)
    assert status == 200, answer
    again = await _snapshot(store)
    assert [d.slug for d in again.domains] == ["a", "b"]
    new_b, old_b = again.domains[1], old.domains[1]
    assert new_b.id != old_b.id
    assert new_b.state.value == "provisioning"
    assert again.domains[0].slots[1].id != old.domains[0].slots[1].id
    assert render_plan((await _plan(client, BASE)).plan) == "fleet shop: no changes"


async def test_removing_the_active_an_operations_target_or_a_serving_slot_is_refused(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    await _created(client)
    before = await _snapshot(store)
    # The active's inference slot: it would move traffic.
    layout = {**copy.deepcopy(BASE), "activeDomainSlug": None}
    layout["domains"][0]["slots"] = layout["domains"][0]["slots"][1:]
    status, answer = await _apply(client, layout)
    assert status == 409, answer
    assert answer["error"]["code"] == "change_refused"
    assert "would move its traffic" in answer["error"]["message"]
    # The active domain itself.
    only_b = {**BASE, "activeDomainSlug": None, "domains": BASE["domains"][1:]}
    status, answer = await _apply(client, only_b)
    assert status == 409, answer
    assert "is the active domain" in answer["error"]["message"]
    # An operation's target.
    b = next(d for d in before.domains if d.slug == "b")
    operation, created = await store.create_operation(
        fleet_id=before.id, kind=OperationKind.DEMOTE, target_domain_id=b.id, at=clock()
    )
    assert created
    status, answer = await _apply(client, {**BASE, "domains": BASE["domains"][:1]})
    assert status == 409, answer
    assert f"operation {operation.id}" in answer["error"]["message"]
    assert await _snapshot(store) == before
    assert await _config_events(store, before.id) == []


async def test_a_removal_planned_before_a_promotion_loses_to_it_and_writes_no_event(
    store: StateStore, clock: ManualClock
) -> None:
    from haru_protocol import FleetLayout

    await store.apply_fleet_layout(FleetLayout.model_validate(BASE), at=clock())
    fleet = await _snapshot(store)
    revisions = await store.get_config_revisions(fleet.id)
    a, b = fleet.domains
    _, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=b.id, at=clock()
    )
    assert created
    event = FleetConfigChanged(
        action="-", subject="domain", path="domain b", detail="static", revision=2
    )
    for domain in (a, b):  # the active is also the promotion's source
        assert (
            await store.remove_domain(
                domain.id,
                fleet_id=fleet.id,
                revision=revisions[("domain", domain.id)],
                at=clock(),
                events=[event],
            )
            is None
        )
    trainer = b.slots[1]
    assert (
        await store.remove_slot(
            trainer.id,
            fleet_id=fleet.id,
            domain_id=b.id,
            revision=revisions[("slot", trainer.id)],
            moves_traffic=False,
            at=clock(),
            events=[event],
        )
        is None
    )
    spec = TrainingSlotSpec.model_validate(
        {"kind": "training", "gpuIndex": 2, "command": ["python", "t.py"], "checkpointDir": "/c"}
    )
    assert await store.add_slot(fleet.id, b.id, spec, at=clock(), events=[event]) is None
    assert await _snapshot(store) == fleet
    assert await _config_events(store, fleet.id) == []


async def test_a_stale_revision_writes_neither_the_change_nor_its_event(
    store: StateStore, clock: ManualClock
) -> None:
    from haru_protocol import FleetLayout

    await store.apply_fleet_layout(FleetLayout.model_validate(BASE), at=clock())
    fleet = await _snapshot(store)
    b = fleet.domains[1]
    revisions = await store.get_config_revisions(fleet.id)
    event = FleetConfigChanged(
        action="-", subject="domain", path="domain b", detail="static", revision=2
    )
    stale = revisions[("domain", b.id)] - 1
    assert (
        await store.remove_domain(
            b.id, fleet_id=fleet.id, revision=stale, at=clock(), events=[event]
        )
        is None
    )
    assert await _config_events(store, fleet.id) == []
    landed = await store.remove_domain(
        b.id, fleet_id=fleet.id, revision=stale + 1, at=clock(), events=[event, event]
    )
    assert landed == stale + 2
    changed = await _config_events(store, fleet.id)
    assert [(e.domain_id, e.data) for e in changed] == [(b.id, event), (b.id, event)]


async def _race(store: StateStore, clock: ManualClock, round_: int) -> None:
    from haru_db import DomainRemovedError
    from haru_protocol import FleetLayout

    layout = copy.deepcopy(BASE)
    layout["slug"] = f"race-{round_}"
    await store.apply_fleet_layout(FleetLayout.model_validate(layout), at=clock())
    fleet = await store.get_fleet_snapshot(layout["slug"])
    assert fleet is not None
    b = fleet.domains[1]
    revision = (await store.get_config_revisions(fleet.id))[("domain", b.id)]
    other = StateStore.open(store.url)

    async def promote() -> bool:
        try:
            _, created = await other.create_operation(
                fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=b.id, at=clock()
            )
        except DomainRemovedError:
            return False
        return created

    async def remove() -> bool:
        landed = await store.remove_domain(b.id, fleet_id=fleet.id, revision=revision, at=clock())
        return landed is not None

    try:
        if round_ % 2:
            promoted, removed = await asyncio.gather(promote(), remove())
        else:
            removed, promoted = await asyncio.gather(remove(), promote())
    finally:
        await other.close()
    assert promoted != removed, (round_, promoted, removed)
    in_flight = await store.get_in_flight_operation(fleet.id)
    assert (in_flight is not None) is promoted
    after = await store.get_fleet_snapshot(layout["slug"])
    assert after is not None
    assert (len(after.domains) == 1) is removed


async def test_a_racing_promotion_and_removal_never_both_land(
    store: StateStore, clock: ManualClock
) -> None:
    """Through separate connections: either the promotion exists or the domain is removed."""
    for round_ in range(12):
        await _race(store, clock, round_)


async def test_a_removed_provisioned_domain_goes_stopping_for_its_teardown(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await _client(store, clock, aiohttp_client)
    layout = copy.deepcopy(BASE)
    layout["domains"].append(
        {
            "slug": "p",
            "provider": "skypilot",
            "placement": PLACEMENT,
            "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "chat"}]}],
        }
    )
    status, answer = await _apply(client, layout)
    assert status == 200, answer
    fleet = await _snapshot(store)
    p = next(d for d in fleet.domains if d.slug == "p")
    assert await store.claim_launch(p.id, expected_attempt=0, at=clock())
    assert await store.list_removed_teardowns(fleet.id) == []
    [item] = (await _plan(client, BASE)).plan.items
    assert (item.action, item.path, item.detail, item.refused) == (
        "-",
        "domain p",
        "skypilot, torn down (as `haru domain down`)",
        None,
    )
    status, answer = await _apply(client, BASE)
    assert status == 200, answer
    assert [d.slug for d in (await _snapshot(store)).domains] == ["a", "b"]
    [gone] = await store.list_removed_teardowns(fleet.id)
    assert (gone.id, gone.state.value, gone.launch_attempt) == (p.id, "stopping", 1)
    # The teardown's end takes it off that list too.
    from haru_protocol import DomainState

    assert await store.transition_domain(
        p.id, from_states=(DomainState.STOPPING,), to=DomainState.STOPPED, at=clock()
    )
    assert await store.list_removed_teardowns(fleet.id) == []
