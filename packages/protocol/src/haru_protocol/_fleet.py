"""Read models and control-API bodies of the server (DESIGN 3.6, 7.2, 7.4)."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import AwareDatetime, Field, StrictInt, model_validator

from haru_protocol._base import HttpUrl, ModelName, PeerModel, Slug, WireModel
from haru_protocol._enums import (
    DomainState,
    InferenceSlotState,
    OperationKind,
    OperationState,
    OperationStep,
    Provider,
    SlotKind,
    TrainingSlotState,
)
from haru_protocol._events import AnyEventPayload, parse_event_payload
from haru_protocol._layout import Placement, Provisioning
from haru_protocol._policy import Policy
from haru_protocol._slots import InferenceSlotSpec, SlotSpec, TrainingSlotSpec

RouteRevision = Annotated[StrictInt, Field(ge=1)]
"""Revision of a fleet's routing pointer; it grows by one on every move."""


def _slot_state_for(kind: SlotKind, state: str) -> InferenceSlotState | TrainingSlotState:
    if kind is SlotKind.INFERENCE:
        return InferenceSlotState(state)
    return TrainingSlotState(state)


class SlotSnapshot(PeerModel):
    """One slot as stored; ``kind`` always equals ``spec.kind``."""

    id: UUID
    domain_id: UUID
    gpu_index: Annotated[StrictInt, Field(ge=0)]
    kind: SlotKind
    state: InferenceSlotState | TrainingSlotState
    spec: SlotSpec

    @model_validator(mode="before")
    @classmethod
    def _state_of_kind(cls, data: Any) -> Any:
        # The state vocabulary depends on the kind; resolve it before field validation so an
        # inference state on a training slot is rejected instead of silently coerced.
        if isinstance(data, dict):
            kind = data.get("kind")
            state = data.get("state")
            if isinstance(kind, str) and isinstance(state, str):
                try:
                    data = {**data, "state": _slot_state_for(SlotKind(kind), state)}
                except ValueError as exc:
                    raise ValueError(f"state {state!r} is not a {kind} slot state") from exc
        return data

    @model_validator(mode="after")
    def _kind_matches_spec(self) -> SlotSnapshot:
        if self.kind != self.spec.kind:
            raise ValueError(f"slot kind {self.kind.value!r} differs from spec kind")
        if self.gpu_index != self.spec.gpu_index:
            raise ValueError("slot gpuIndex differs from spec gpuIndex")
        expected = InferenceSlotState if self.kind is SlotKind.INFERENCE else TrainingSlotState
        if not isinstance(self.state, expected):
            raise ValueError(f"state {self.state.value!r} is not a {self.kind.value} slot state")
        return self

    @property
    def inference_spec(self) -> InferenceSlotSpec | None:
        """The spec when this is an inference slot."""
        return self.spec if isinstance(self.spec, InferenceSlotSpec) else None

    @property
    def training_spec(self) -> TrainingSlotSpec | None:
        """The spec when this is a training slot."""
        return self.spec if isinstance(self.spec, TrainingSlotSpec) else None


class DomainSnapshot(PeerModel):
    """One failure domain as stored; its role derives from the fleet's pointer."""

    id: UUID
    fleet_id: UUID
    slug: Slug
    state: DomainState
    provider: Provider
    placement: Placement
    supervisor_url: HttpUrl | None
    serving_base_url: HttpUrl | None
    last_seen_at: AwareDatetime | None
    state_updated_at: AwareDatetime
    slots: tuple[SlotSnapshot, ...]
    auth_failing: bool = False
    """The domain's supervisor refuses the server's token (401/403): a configuration error,
    never evidence that the domain is down. Known to the server process that polled it."""
    last_supervisor_error: str | None = None
    """The last failure of a heartbeat poll of this domain's supervisor (null: it answers)."""
    promotion_backoff_until: AwareDatetime | None = None
    """Automatic promotions of this domain wait until then: its recent promotions failed."""
    provisioning: Provisioning | None = None
    """Provisioned domains: the layout's provisioning settings (null for static domains)."""
    launch_attempt: StrictInt = 0
    """Provisioned domains: launches claimed so far (0: never launched)."""
    launch_started_at: AwareDatetime | None = None
    """When the last claimed launch started."""
    launched_at: AwareDatetime | None = None
    """When the last claimed launch returned successfully (null while running or failed)."""
    connect_failed_at: AwareDatetime | None = None
    """The latest time a server's proxy could not connect to this domain's serving endpoint
    (refused or no route), recorded at most once a second per server process. Corroboration
    for the failure detector, never proof on its own (null: never recorded)."""


class FleetSnapshot(PeerModel):
    """A fleet with its resolved policy, domains and slots (``GET /v1/fleets/{ref}``)."""

    id: UUID
    slug: Slug
    display_name: str | None
    active_domain_id: UUID | None
    route_revision: RouteRevision
    route_lease_ms: Annotated[StrictInt, Field(ge=0)] | None = None
    """The longest route lease (``HARU_ROUTE_LEASE_MS``) a server process has routed this fleet
    with (null: none recorded). The old active is drained no earlier than the flip plus this
    lease, a pointer read and a margin."""
    policy: Policy
    domains: tuple[DomainSnapshot, ...]
    reconciled: bool | None = None
    """Whether this server's background loop drives the fleet (null: it runs no loop)."""
    warnings: tuple[str, ...] = ()
    """Configuration problems an operator must fix (e.g. autoFailover without a loop)."""

    def domain(self, domain_id: UUID) -> DomainSnapshot | None:
        """The domain with this id, if it belongs to the fleet."""
        return next((d for d in self.domains if d.id == domain_id), None)

    @property
    def active_domain(self) -> DomainSnapshot | None:
        """The domain the routing pointer targets, if any."""
        return None if self.active_domain_id is None else self.domain(self.active_domain_id)


class FleetRoutePointer(PeerModel):
    """The narrow routing read: who is active, at which revision."""

    id: UUID
    slug: Slug
    active_domain_id: UUID | None
    route_revision: RouteRevision
    promotion_in_flight: bool = False
    """A promote operation of the fleet is pending or running (read in the same statement).

    The inference proxy holds requests nothing can serve while it is true, as it does for a
    fleet with ``autoFailover``. A pointer-move notification does not carry it (false there).
    """


class FleetList(PeerModel):
    """``GET /v1/fleets``."""

    fleets: tuple[FleetRoutePointer, ...]


class OperationError(PeerModel):
    """Why an operation failed."""

    step: OperationStep | None
    code: str
    """One of :class:`~haru_protocol.OperationErrorCode`."""
    message: str


class Operation(PeerModel):
    """A promote or demote and its progress."""

    id: UUID
    fleet_id: UUID
    kind: OperationKind
    state: OperationState
    target_domain_id: UUID
    source_domain_id: UUID | None = None
    """The routing pointer when the operation was created."""
    current_step: OperationStep | None
    step_started_at: AwareDatetime | None
    error: OperationError | None
    routing_committed: bool = False
    created_at: AwareDatetime
    finished_at: AwareDatetime | None


class PromoteRequest(WireModel):
    """Body of ``POST /v1/fleets/{ref}/promote``."""

    target_domain_id: UUID


class DemoteRequest(WireModel):
    """Body of ``POST /v1/fleets/{ref}/demote``."""

    target_domain_id: UUID


class AlreadyActiveResponse(PeerModel):
    """The target already serves: nothing to do."""

    status: Literal["already_active"] = "already_active"
    route_revision: RouteRevision


class AcceptedResponse(PeerModel):
    """An operation was created, or an in-flight one with the same intent was joined."""

    status: Literal["accepted"] = "accepted"
    operation: Operation


OperationRequestResponse = Annotated[
    AlreadyActiveResponse | AcceptedResponse, Field(discriminator="status")
]
"""Answer of promote and demote."""


class FleetPolicyResponse(PeerModel):
    """Answer of ``PATCH /v1/fleets/{ref}/policy``."""

    fleet_id: UUID
    policy: Policy
    """The resolved policy the next tick uses."""
    patch: dict[str, Any]
    """The operator's values (camelCase); every other key follows the current default."""
    changed: tuple[str, ...]
    """The keys this request set, changed or removed (empty: nothing changed, no event)."""


class ReconcileResponse(PeerModel):
    """Result of one reconcile tick."""

    fleet_id: UUID
    operation: Operation | None


class Event(PeerModel):
    """One entry of a fleet's append-only audit trail."""

    id: StrictInt
    fleet_id: UUID
    domain_id: UUID | None = None
    slot_id: UUID | None = None
    operation_id: UUID | None = None
    type: str
    """One of :class:`~haru_protocol.EventType` (kept as a string for forward compatibility)."""
    payload: dict[str, Any]
    """The stored JSON object, as written; :attr:`data` is the same typed by ``type``."""
    created_at: AwareDatetime

    @property
    def data(self) -> AnyEventPayload:
        """The payload typed by the event's type (see :func:`~haru_protocol.parse_event_payload`).

        A type this version does not know, or a payload that does not fit its model, comes back
        as an :class:`~haru_protocol.UntypedEventPayload`: reading never fails.
        """
        return parse_event_payload(self.type, self.payload)


class EventList(PeerModel):
    """``GET /v1/fleets/{ref}/events``: oldest first."""

    events: tuple[Event, ...]
    next_after: StrictInt | None = None
    """Pass as ``after`` to continue; null when the page was the last one."""


class DomainActionRequest(WireModel):
    """Body of ``POST .../domains/{domain}/up`` and ``/down``: empty (or ``{}``)."""


class DomainStatusResponse(PeerModel):
    """``GET /v1/fleets/{ref}/domains/{domain}``: the row, its cluster, its last events."""

    domain: DomainSnapshot
    role: Literal["active", "standby"]
    cluster_name: str | None
    """The SkyPilot cluster (null for a static domain)."""
    cluster_status: str | None
    """What ``sky status`` says now (``absent``: SkyPilot does not know it; null when not
    provisioned by SkyPilot or the read failed)."""
    cluster_error: str | None
    """Why ``sky status`` could not be read, if it could not."""
    events: tuple[Event, ...]
    """The domain's last provisioning events (launch, failure, address, loss, relaunch,
    up, down, teardown), oldest first."""


class DomainActionResponse(PeerModel):
    """``POST .../domains/{domain}/up`` and ``/down``: the domain after the request."""

    domain: DomainSnapshot


class RouteModel(PeerModel):
    """A model binding in the route intent."""

    name: ModelName
    serving_url: HttpUrl | None
    """Null for a provisioned domain whose machine has no recorded address yet."""
    eligible: bool


class RouteTarget(PeerModel):
    """A domain in the route intent."""

    domain_id: UUID
    domain_slug: Slug
    endpoint_url: HttpUrl | None
    eligible: bool
    weight: Literal[0, 1]
    models: tuple[RouteModel, ...]


class RouteIntent(PeerModel):
    """Provider-neutral routing intent any router can apply (DESIGN 7.4)."""

    fleet_id: UUID
    fleet_slug: Slug
    revision: RouteRevision
    generated_at: AwareDatetime
    active: RouteTarget | None
    standbys: tuple[RouteTarget, ...]


class Health(PeerModel):
    """``GET /healthz``."""

    ok: bool = True


class Readiness(PeerModel):
    """``GET /readyz`` when ready (otherwise 503 ``not_ready`` in the error envelope)."""

    ready: bool = True
    checks: tuple[str, ...] = ()
    """What was checked, in order (e.g. ``state store``, ``schema at head``)."""
