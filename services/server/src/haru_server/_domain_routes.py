"""Provisioned domains in the control API (DESIGN 7.2): a domain's status, ``up`` and ``down``.

``GET /v1/fleets/{ref}/domains/{domain}`` shows a domain, its cluster's status as the
provisioner reads it, and its latest provisioning events; ``up`` and ``down`` move a skypilot or
skyserve domain to ``provisioning`` or ``stopping`` with one guarded write and leave the launch
or the teardown to the provisioner. ``down`` refuses the active domain, one an operation drives,
and a former active that processes may still route to (its route lease).
"""

from __future__ import annotations

import logging
from typing import Literal
from uuid import UUID

from aiohttp import web
from haru_driver_skypilot import SkyDriverError
from haru_protocol import (
    DomainActionRequest,
    DomainActionResponse,
    DomainDownRequested,
    DomainSnapshot,
    DomainState,
    DomainStatusResponse,
    DomainUpRequested,
    ErrorCode,
    Event,
    EventType,
    FleetSnapshot,
)
from haru_web import ApiError, parse_body

from haru_server._reconciler import RECENT_OPERATIONS
from haru_server._routes import (
    CONTROL_BODY_LIMIT,
    EVENTS_MAX_LIMIT,
    fleet_snapshot,
    json_response,
    plane_of,
)
from haru_server._schema_gate import check_writes
from haru_server._steps import former_active_guard_until

logger = logging.getLogger(__name__)

domain_routes = web.RouteTableDef()

PROVISIONING_EVENTS = frozenset(
    {
        EventType.DOMAIN_LAUNCH_STARTED,
        EventType.DOMAIN_LAUNCH_SUCCEEDED,
        EventType.DOMAIN_PROVISIONING_FAILED,
        EventType.DOMAIN_ADDRESS_RECORDED,
        EventType.DOMAIN_CLUSTER_LOST,
        EventType.DOMAIN_RELAUNCH,
        EventType.DOMAIN_UP_REQUESTED,
        EventType.DOMAIN_DOWN_REQUESTED,
        EventType.DOMAIN_TEARDOWN,
    }
)
"""The events ``GET .../domains/{domain}`` lists."""

DOMAIN_EVENTS_SHOWN = 20


def _domain_of(fleet: FleetSnapshot, request: web.Request) -> DomainSnapshot:
    raw = request.match_info["domain"]
    for domain in fleet.domains:
        if raw in (domain.slug, str(domain.id)):
            return domain
    raise ApiError(ErrorCode.NOT_FOUND, f"domain {raw[:100]!r} not found in fleet {fleet.slug!r}")


def _provisioned(request: web.Request, domain: DomainSnapshot, action: str) -> None:
    if not plane_of(request).provisioner.drives(domain):
        raise ApiError(
            ErrorCode.INVALID_TARGET,
            f"domain {domain.slug!r} is a {domain.provider.value} domain: `{action}` drives "
            "only skypilot and skyserve domains",
        )


async def _domain_events(
    request: web.Request, fleet: FleetSnapshot, domain_id: UUID
) -> list[Event]:
    store = plane_of(request).store
    found: list[Event] = []
    after = 0
    while True:
        page = await store.list_events(fleet.id, after=after, limit=EVENTS_MAX_LIMIT)
        found += [e for e in page if e.domain_id == domain_id and e.type in PROVISIONING_EVENTS]
        found = found[-DOMAIN_EVENTS_SHOWN:]
        if len(page) < EVENTS_MAX_LIMIT:
            return found
        after = page[-1].id


@domain_routes.get("/v1/fleets/{ref}/domains/{domain}")
async def domain_status(request: web.Request) -> web.Response:
    fleet = await fleet_snapshot(request)
    domain = _domain_of(fleet, request)
    name = status = error = None
    provisioner = plane_of(request).provisioner
    if provisioner.drives(domain):
        name = await provisioner.cluster_name(fleet, domain)
        try:
            observed = await provisioner.read_status(fleet, domain)
        except SkyDriverError as exc:
            error = str(exc)[:1024]
        else:
            status = observed.shown
    role: Literal["active", "standby"] = (
        "active" if fleet.active_domain_id == domain.id else "standby"
    )
    return json_response(
        DomainStatusResponse(
            domain=domain,
            role=role,
            cluster_name=name,
            cluster_status=status,
            cluster_error=error,
            events=tuple(await _domain_events(request, fleet, domain.id)),
        )
    )


async def _domain_action(
    request: web.Request, fleet: FleetSnapshot, domain: DomainSnapshot, to: DomainState
) -> web.Response:
    store = plane_of(request).store
    now = plane_of(request).clock()
    payload = (
        DomainUpRequested(from_state=domain.state)
        if to is DomainState.PROVISIONING
        else DomainDownRequested(from_state=domain.state)
    )
    if not await store.transition_domain(
        domain.id,
        from_states=(domain.state,),
        to=to,
        at=now,
        events=(payload,),
        fleet_id=fleet.id,
    ):
        raise ApiError(
            ErrorCode.OPERATION_CONFLICT,
            f"domain {domain.slug!r} changed state meanwhile; read it again and retry",
        )
    logger.info("fleet %s: domain %s %s -> %s", fleet.slug, domain.slug, domain.state, to)
    plane_of(request).kick(fleet.id)
    after = await fleet_snapshot(request)
    return json_response(DomainActionResponse(domain=_domain_of(after, request)), status=202)


@domain_routes.post("/v1/fleets/{ref}/domains/{domain}/up")
async def domain_up(request: web.Request) -> web.Response:
    await parse_body(request, DomainActionRequest, limit=CONTROL_BODY_LIMIT, empty_ok=True)
    await check_writes(plane_of(request).schema_gate)
    fleet = await fleet_snapshot(request)
    domain = _domain_of(fleet, request)
    _provisioned(request, domain, "up")
    if domain.state not in (DomainState.STOPPED, DomainState.FAILED):
        raise ApiError(
            ErrorCode.OPERATION_CONFLICT,
            f"domain {domain.slug!r} is {domain.state.value}: `up` launches a stopped or "
            "failed domain",
        )
    return await _domain_action(request, fleet, domain, DomainState.PROVISIONING)


@domain_routes.post("/v1/fleets/{ref}/domains/{domain}/down")
async def domain_down(request: web.Request) -> web.Response:
    await parse_body(request, DomainActionRequest, limit=CONTROL_BODY_LIMIT, empty_ok=True)
    await check_writes(plane_of(request).schema_gate)
    fleet = await fleet_snapshot(request)
    domain = _domain_of(fleet, request)
    _provisioned(request, domain, "down")
    if fleet.active_domain_id == domain.id:
        raise ApiError(
            ErrorCode.OPERATION_CONFLICT,
            f"domain {domain.slug!r} is the active domain of fleet {fleet.slug!r}: promote "
            "another domain first, then take this one down",
        )
    operation = await plane_of(request).store.get_in_flight_operation(fleet.id)
    if operation is not None and domain.id in (
        operation.target_domain_id,
        operation.source_domain_id,
    ):
        raise ApiError(
            ErrorCode.OPERATION_CONFLICT,
            f"operation {operation.id} ({operation.kind.value}) drives domain "
            f"{domain.slug!r}; retry when it has finished",
        )
    if domain.state in (DomainState.STOPPING, DomainState.STOPPED):
        return json_response(DomainActionResponse(domain=domain), status=200)
    now = plane_of(request).clock()
    until = await former_active_guard_until(
        plane_of(request).store,
        plane_of(request).reconciler.options.tuning,
        fleet.id,
        domain.id,
        since=now,
        now=now,
        recent_limit=RECENT_OPERATIONS,
    )
    if until is not None and until > now:
        # A promotion waits out the guard before it sleeps its old active, but never sleeps a
        # skyserve one (always awake): taking it down now would stop what processes still
        # route to.
        raise ApiError(
            ErrorCode.OPERATION_CONFLICT,
            f"domain {domain.slug!r} was the active domain until a promotion moved routing "
            f"away from it; processes may route to it for {(until - now).total_seconds():.1f} s "
            "more (their route lease): retry then",
        )
    return await _domain_action(request, fleet, domain, DomainState.STOPPING)
