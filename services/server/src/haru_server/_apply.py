"""``POST /v1/fleets/{ref}/apply``: plan a layout against the stored fleet, then apply it.

The rules live in :func:`haru_core.plan_layout`; this module reads what the plan needs (the
rows' configuration revisions first, then the snapshot) and carries the plan out as one
compare-and-swap per row (or a guarded insert), each appending one ``fleet.config.changed``
event per plan item in its own statement.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Final, assert_never
from uuid import UUID

from aiohttp import web
from haru_core import (
    DomainAdd,
    DomainRemove,
    DomainRowChange,
    FleetRowChange,
    LayoutPlan,
    RowChange,
    SlotAdd,
    SlotRemove,
    SlotRowChange,
    plan_layout,
)
from haru_db import StateStore
from haru_protocol import (
    ApplyRequest,
    ApplyResponse,
    ErrorCode,
    FleetConfigChanged,
    FleetLayout,
    parse_fleet_ref,
)
from haru_web import ApiError, parse_body

from haru_server._keys import clock_key, control_plane_key, schema_gate_key, store_key
from haru_server._schema_gate import check_writes

logger = logging.getLogger(__name__)

apply_routes = web.RouteTableDef()

APPLY_BODY_LIMIT: Final = 1024 * 1024
"""Largest body ``POST /v1/fleets/{ref}/apply`` accepts (a layout with many domains)."""


async def make_plan(store: StateStore, layout: FleetLayout, fleet_id: UUID | None) -> LayoutPlan:
    """The plan for ``layout`` against the stored fleet ``fleet_id`` (None: not stored)."""
    if fleet_id is None:
        return plan_layout(None, layout, stored_policy=None, in_flight=None, revisions={})
    # Revisions first: a change that lands between the two reads makes the writes lose.
    revisions = await store.get_config_revisions(fleet_id)
    fleet = await store.get_fleet_snapshot(str(fleet_id))
    policy = await store.get_fleet_policy(fleet_id)
    in_flight = await store.get_in_flight_operation(fleet_id)
    return plan_layout(
        fleet,
        layout,
        stored_policy=None if policy is None else policy.patch,
        in_flight=in_flight,
        revisions=revisions,
    )


def _stale(done: int, total: int, what: str) -> ApiError:
    return ApiError(
        ErrorCode.PLAN_STALE,
        f"{what} changed since the plan was made ({done} of {total} change(s) applied "
        "before it); plan again",
    )


@apply_routes.post("/v1/fleets/{ref}/apply")
async def apply_layout(request: web.Request) -> web.Response:
    body = await parse_body(request, ApplyRequest, limit=APPLY_BODY_LIMIT)
    layout = body.layout
    ref = parse_fleet_ref(request.match_info["ref"])
    store = request.app[store_key]
    pointer = None if ref.names_nothing else await store.get_fleet_route_pointer(ref)
    if pointer is None and ref.slug != layout.slug:
        raise ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {ref.text[:100]!r} not found")
    if pointer is not None and pointer.slug != layout.slug:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"the layout describes fleet {layout.slug!r}, not {pointer.slug!r}",
        )
    planned = await make_plan(store, layout, None if pointer is None else pointer.id)
    plan = planned.plan
    if body.dry_run:
        return _answer(ApplyResponse(plan=plan, applied=False, fleet_id=plan.fleet_id))
    await check_writes(request.app[schema_gate_key])
    if body.revisions is not None and _keys(body.revisions) != _keys(plan.revisions):
        raise ApiError(
            ErrorCode.PLAN_STALE,
            f"fleet {layout.slug!r} changed since the plan was made; plan again",
        )
    if plan.refused:
        reasons = "; ".join(f"{i.action} {i.path}: {i.refused}" for i in plan.refused)
        raise ApiError(
            ErrorCode.CHANGE_REFUSED, f"{len(plan.refused)} change(s) refused: {reasons}"[:4000]
        )
    now = request.app[clock_key]()
    if plan.fleet_id is None:
        result = await store.apply_fleet_layout(layout, at=now)
        if not result.fleet_created:
            raise _stale(0, 1, f"fleet {layout.slug!r}")
        logger.info("fleet %s: created by apply", layout.slug)
        request.app[control_plane_key].kick(result.fleet_id)
        return _answer(ApplyResponse(plan=plan, applied=True, fleet_id=result.fleet_id))
    revisions: dict[tuple[str, UUID], int] = {(r.table, r.id): r.revision for r in plan.revisions}
    for done, change in enumerate(planned.changes):
        await _carry_out(
            store, plan.fleet_id, change, revisions, now=now, done=done, total=len(planned.changes)
        )
    logger.info("fleet %s: %d change(s) applied", layout.slug, len(plan.items))
    if planned.changes:
        request.app[control_plane_key].kick(plan.fleet_id)
    return _answer(ApplyResponse(plan=plan, applied=True, fleet_id=plan.fleet_id))


def _keys(revisions: object) -> frozenset[tuple[str, UUID, int]]:
    return frozenset((r.table, r.id, r.revision) for r in revisions)  # type: ignore[attr-defined]


def _answer(response: ApplyResponse) -> web.Response:
    return web.json_response(text=response.model_dump_json())


async def _carry_out(
    store: StateStore,
    fleet_id: UUID,
    change: RowChange,
    revisions: dict[tuple[str, UUID], int],
    *,
    now: datetime,
    done: int,
    total: int,
) -> None:
    # The events ride the write itself: they land exactly when the change does.
    def events(revision: int) -> list[FleetConfigChanged]:
        return [
            FleetConfigChanged(
                action=item.action,
                subject=item.subject,
                path=item.path,
                detail=item.detail,
                revision=revision,
            )
            for item in change.items
        ]

    landed: object
    if isinstance(change, FleetRowChange):
        revision = revisions[("fleet", fleet_id)]
        landed = await store.update_fleet_config(
            fleet_id,
            revision=revision,
            display_name=change.display_name,
            policy=change.policy,
            at=now,
            events=events(revision + 1),
        )
        what = "the fleet's display name or policy"
    elif isinstance(change, DomainAdd):
        landed = await store.add_domain(fleet_id, change.layout, at=now, events=events(1))
        what = f"domain {change.layout.slug!r}"
    elif isinstance(change, DomainRowChange):
        revision = revisions[("domain", change.domain_id)]
        landed = await store.update_domain_config(
            change.domain_id,
            fleet_id=fleet_id,
            revision=revision,
            layout=change.layout,
            moves_traffic=change.moves_traffic,
            at=now,
            events=events(revision + 1),
        )
        what = f"domain {change.layout.slug!r} (or an operation now drives it)"
    elif isinstance(change, DomainRemove):
        revision = revisions[("domain", change.domain_id)]
        landed = await store.remove_domain(
            change.domain_id,
            fleet_id=fleet_id,
            revision=revision,
            at=now,
            events=events(revision + 1),
        )
        what = f"{change.items[0].path} (or it is now active, or an operation drives it)"
    elif isinstance(change, SlotAdd):
        landed = await store.add_slot(
            fleet_id, change.domain_id, change.spec, at=now, events=events(1)
        )
        what = f"{change.items[0].path} (or an operation now drives its domain)"
    elif isinstance(change, SlotRowChange):
        revision = revisions[("slot", change.slot_id)]
        landed = await store.update_slot_spec(
            change.slot_id,
            fleet_id=fleet_id,
            domain_id=change.domain_id,
            revision=revision,
            spec=change.spec,
            moves_traffic=change.moves_traffic,
            at=now,
            events=events(revision + 1),
        )
        what = f"{change.items[0].path} (or an operation now drives its domain)"
    elif isinstance(change, SlotRemove):
        revision = revisions[("slot", change.slot_id)]
        landed = await store.remove_slot(
            change.slot_id,
            fleet_id=fleet_id,
            domain_id=change.domain_id,
            revision=revision,
            moves_traffic=change.moves_traffic,
            at=now,
            events=events(revision + 1),
        )
        what = f"{change.items[0].path} (or an operation now drives its domain)"
    else:
        assert_never(change)
    if landed is None:
        raise _stale(done, total, what)
