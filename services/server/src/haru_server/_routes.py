"""The control API (DESIGN 7.2): fleets, operations, events, route intent and reconcile.

The provisioned domains' routes (status, ``up``, ``down``) are in
:mod:`haru_server._domain_routes`; they share :func:`plane_of`, :func:`fleet_snapshot` and
:func:`json_response` from here.
"""

from __future__ import annotations

import logging
from uuid import UUID

from aiohttp import web
from haru_core import (
    AlreadyActive,
    InvalidTarget,
    build_route_intent,
    decide_demotion,
    decide_promotion,
    inference_slots,
    training_slots,
)
from haru_db import DomainRemovedError
from haru_protocol import (
    AcceptedResponse,
    AlreadyActiveResponse,
    DemoteRequest,
    ErrorCode,
    EventList,
    FleetList,
    FleetPolicyChanged,
    FleetPolicyResponse,
    FleetRef,
    FleetRoutePointer,
    FleetSnapshot,
    Health,
    InferenceSlotState,
    Operation,
    OperationKind,
    OperationRequestedDemote,
    OperationRequestedPromote,
    OperationState,
    PeerModel,
    PolicyPatch,
    PromoteRequest,
    ReconcileResponse,
    TrainingSlotState,
    WireModel,
    merge_policy_patch,
    parse_fleet_ref,
)
from haru_web import ApiError, int_query, parse_body
from pydantic import ValidationError

from haru_server._control_plane import ControlPlane
from haru_server._errors import ClockSkewedError, FleetNotFoundError, SchemaNewerError
from haru_server._keys import control_plane_key
from haru_server._operation_requests import request_operation
from haru_server._reconciler import RECENT_OPERATIONS, Accepted
from haru_server._schema_gate import check_writes

logger = logging.getLogger(__name__)

routes = web.RouteTableDef()

EVENTS_DEFAULT_LIMIT = 100
EVENTS_MAX_LIMIT = 1000
CONTROL_BODY_LIMIT = 16 * 1024
"""Largest body a control-API POST accepts (DESIGN 7.2)."""


class ReconcileRequest(WireModel):
    """Body of ``POST /v1/fleets/{ref}/reconcile``: empty (or ``{}``); no key is accepted."""


def plane_of(request: web.Request) -> ControlPlane:
    return request.app[control_plane_key]


def json_response(model: PeerModel, *, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _fleet_not_found(ref: FleetRef) -> ApiError:
    return ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {ref.text[:100]!r} not found")


def _fleet_ref(request: web.Request) -> FleetRef:
    """The ``{ref}`` path segment; one that cannot name a fleet is 404 without a query."""
    ref = parse_fleet_ref(request.match_info["ref"])
    if ref.names_nothing:
        raise _fleet_not_found(ref)
    return ref


async def fleet_snapshot(request: web.Request) -> FleetSnapshot:
    ref = _fleet_ref(request)
    fleet = await plane_of(request).store.get_fleet_snapshot(ref)
    if fleet is None:
        raise _fleet_not_found(ref)
    return fleet


async def _pointer(request: web.Request) -> FleetRoutePointer:
    ref = _fleet_ref(request)
    pointer = await plane_of(request).store.get_fleet_route_pointer(ref)
    if pointer is None:
        raise _fleet_not_found(ref)
    return pointer


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    # Never touches the database: a red liveness probe during a store outage would restart
    # the process and throw away the routing cache that keeps traffic flowing.
    return json_response(Health())


@routes.get("/v1/fleets")
async def list_fleets(request: web.Request) -> web.Response:
    fleets = await plane_of(request).store.list_fleets()
    return json_response(FleetList(fleets=tuple(fleets)))


async def loop_coverage(app: web.Application, fleet: FleetSnapshot) -> FleetSnapshot:
    """``fleet`` with ``reconciled`` and the warnings about who drives it."""
    loop = app[control_plane_key].loop
    warnings: list[str] = []
    if loop is None:
        reconciled = None
        if fleet.policy.auto_failover:
            warnings.append(
                "autoFailover is on but no reconcile loop runs (HARU_RECONCILE_INTERVAL_MS is "
                "off): nothing fails over automatically"
            )
    else:
        reconciled = await loop.covers(fleet.id)
        if not reconciled:
            warnings.append(
                "no reconcile loop drives this fleet (HARU_RECONCILE_FLEETS does not name it): "
                "promote and demote are refused"
                + (" and nothing fails over automatically" if fleet.policy.auto_failover else "")
            )
    return fleet.model_copy(update={"reconciled": reconciled, "warnings": tuple(warnings)})


@routes.get("/v1/fleets/{ref}")
async def get_fleet(request: web.Request) -> web.Response:
    fleet = await plane_of(request).reconciler.annotate(await fleet_snapshot(request))
    return json_response(await loop_coverage(request.app, fleet))


POLICY_SWAP_ATTEMPTS = 5
"""Read-merge-swap rounds of a policy PATCH before it gives up on concurrent writers (409)."""


@routes.patch("/v1/fleets/{ref}/policy")
async def patch_policy(request: web.Request) -> web.Response:
    update = await parse_body(request, PolicyPatch, limit=CONTROL_BODY_LIMIT)
    await check_writes(plane_of(request).schema_gate)
    fleet = await fleet_snapshot(request)
    store = plane_of(request).store
    for _ in range(POLICY_SWAP_ATTEMPTS):
        stored = await store.get_fleet_policy(fleet.id)
        if stored is None:
            raise _fleet_not_found(_fleet_ref(request))
        try:
            merged = PolicyPatch.model_validate(merge_policy_patch(stored.patch, update))
        except ValidationError as exc:
            # Only a stored key this release does not know can fail here (the body is valid).
            raise ApiError(
                ErrorCode.INVALID_REQUEST,
                f"the fleet's stored policy cannot be merged: {exc.error_count()} error(s)",
            ) from None
        patch = merged.stored()
        changed = sorted(
            key
            for key in stored.patch.keys() | patch.keys()
            if stored.patch.get(key) != patch.get(key)
        )
        answer = FleetPolicyResponse(
            fleet_id=fleet.id, policy=merged.resolve(), patch=patch, changed=tuple(changed)
        )
        if not changed:
            return json_response(answer)
        now = plane_of(request).clock()
        event = FleetPolicyChanged(old=stored.patch, new=patch, changed=tuple(changed))
        swapped = await store.replace_fleet_policy(
            fleet.id, version=stored.version, patch=patch, at=now, events=(event,)
        )
        if swapped:
            # The reconciler reads the policy with the fleet at every tick: nothing to notify.
            logger.info("fleet %s: policy changed (%s)", fleet.slug, ", ".join(changed))
            return json_response(answer)
    raise ApiError(
        ErrorCode.POLICY_CONFLICT,
        f"the policy of fleet {fleet.slug!r} kept changing under this request; retry",
    )


@routes.get("/v1/fleets/{ref}/route-intent")
async def route_intent(request: web.Request) -> web.Response:
    fleet = await fleet_snapshot(request)
    return json_response(build_route_intent(fleet, now=plane_of(request).clock()))


@routes.post("/v1/fleets/{ref}/reconcile")
async def reconcile(request: web.Request) -> web.Response:
    await parse_body(request, ReconcileRequest, limit=CONTROL_BODY_LIMIT, empty_ok=True)
    ref = _fleet_ref(request)
    try:
        result = await plane_of(request).reconciler.tick(ref.text)
    except FleetNotFoundError:
        raise _fleet_not_found(ref) from None
    except (ClockSkewedError, SchemaNewerError) as exc:
        raise ApiError(ErrorCode.NOT_READY, f"not reconciling: {exc}") from None
    return json_response(ReconcileResponse(fleet_id=result.fleet_id, operation=result.operation))


async def _accept_operation(
    request: web.Request, kind: OperationKind, target_domain_id: UUID
) -> web.Response:
    plane = plane_of(request)
    await check_writes(plane.schema_gate)
    fleet = await fleet_snapshot(request)
    loop = plane.loop
    if loop is not None and not await loop.covers(fleet.id):
        # Accepting it would leave an operation pending forever, blocking the fleet.
        raise ApiError(
            ErrorCode.FLEET_NOT_RECONCILED,
            f"no reconcile loop of this server drives fleet {fleet.slug!r} "
            "(HARU_RECONCILE_FLEETS does not name it), so the operation would never run; "
            "add the fleet to HARU_RECONCILE_FLEETS (or unset it: every fleet)",
        )
    decision = (
        decide_promotion(fleet, target_domain_id)
        if kind is OperationKind.PROMOTE
        else decide_demotion(fleet, target_domain_id)
    )
    if isinstance(decision, AlreadyActive):
        return json_response(AlreadyActiveResponse(route_revision=decision.route_revision))
    if isinstance(decision, InvalidTarget):
        raise ApiError(ErrorCode.INVALID_TARGET, decision.message)
    if kind is OperationKind.DEMOTE:
        done = await _demote_in_effect(request, fleet, decision.target_domain_id)
        if done is not None:
            # Idempotent (the demote that did it, as a join answers the one doing it): every
            # operation holds the fleet's one in-flight slot, so a stream of redundant demotes
            # would keep failover detection from running between them.
            return json_response(AcceptedResponse(operation=done), status=202)
    now = plane.clock()
    requested = (
        OperationRequestedPromote if kind is OperationKind.PROMOTE else OperationRequestedDemote
    )
    try:
        operation, created = await request_operation(
            plane.store,
            plane.metrics,
            fleet,
            kind=decision.kind,
            target_domain_id=decision.target_domain_id,
            at=now,
            trigger="manual",
            why="requested",
            event=lambda operation: requested(
                kind=kind,
                target_domain_id=decision.target_domain_id,
                source_domain_id=operation.source_domain_id,
            ),
        )
    except DomainRemovedError as exc:
        # `haru apply` removed it after this request read the fleet.
        raise ApiError(
            ErrorCode.INVALID_TARGET,
            f"domain {decision.target_domain_id} was removed from fleet {fleet.slug!r}",
        ) from exc
    if not created and (
        operation.kind is not decision.kind
        or operation.target_domain_id != decision.target_domain_id
    ):
        raise ApiError(
            ErrorCode.OPERATION_CONFLICT,
            f"operation {operation.id} ({operation.kind.value} of domain "
            f"{operation.target_domain_id}) is in flight; retry when it has finished",
        )
    if created:
        plane.operation_accepted(Accepted(fleet=fleet, operation=operation))
    else:
        plane.kick(fleet.id)
    return json_response(AcceptedResponse(operation=operation), status=202)


async def _demote_in_effect(
    request: web.Request, fleet: FleetSnapshot, target_domain_id: UUID
) -> Operation | None:
    """The succeeded demote that left ``target_domain_id`` in standby posture, if it still is.

    In posture as recorded: every inference slot ``sleeping`` and every training slot
    ``training``, with no operation in flight and none involving the domain since that demote.
    """
    domain = fleet.domain(target_domain_id)
    if domain is None:
        return None
    if any(s.state is not InferenceSlotState.SLEEPING for s in inference_slots(domain)):
        return None
    if any(s.state is not TrainingSlotState.TRAINING for s in training_slots(domain)):
        return None
    recent = await plane_of(request).store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
    newest = max(
        (op for op in recent if target_domain_id in (op.target_domain_id, op.source_domain_id)),
        key=lambda op: op.created_at,
        default=None,
    )
    if any(op.finished_at is None for op in recent) or newest is None:
        return None
    if newest.kind is OperationKind.DEMOTE and newest.state is OperationState.SUCCEEDED:
        return newest
    return None


@routes.post("/v1/fleets/{ref}/promote")
async def promote(request: web.Request) -> web.Response:
    body = await parse_body(request, PromoteRequest, limit=CONTROL_BODY_LIMIT)
    return await _accept_operation(request, OperationKind.PROMOTE, body.target_domain_id)


@routes.post("/v1/fleets/{ref}/demote")
async def demote(request: web.Request) -> web.Response:
    body = await parse_body(request, DemoteRequest, limit=CONTROL_BODY_LIMIT)
    return await _accept_operation(request, OperationKind.DEMOTE, body.target_domain_id)


@routes.get("/v1/fleets/{ref}/operations/{operation_id}")
async def get_operation(request: web.Request) -> web.Response:
    pointer = await _pointer(request)
    raw = request.match_info["operation_id"]
    try:
        operation_id = UUID(raw)
    except ValueError:
        raise ApiError(ErrorCode.NOT_FOUND, f"operation {raw!r} not found") from None
    operation = await plane_of(request).store.get_operation(operation_id, fleet_id=pointer.id)
    if operation is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"operation {raw!r} not found in this fleet")
    return json_response(operation)


@routes.get("/v1/fleets/{ref}/events")
async def list_events(request: web.Request) -> web.Response:
    after = int_query(request, "after", 0, low=0, high=2**63 - 1)
    limit = int_query(request, "limit", EVENTS_DEFAULT_LIMIT, low=1, high=EVENTS_MAX_LIMIT)
    pointer = await _pointer(request)
    events = await plane_of(request).store.list_events(pointer.id, after=after, limit=limit)
    next_after = events[-1].id if len(events) == limit else None
    return json_response(EventList(events=tuple(events), next_after=next_after))
