"""Typed payloads of the audit events: one model per :class:`EventType`.

The events table stores ``type`` and a JSON ``payload``; this module says what the payload of
each type holds. Writers build the model (so a key cannot be misspelled) and readers get it
back with :func:`parse_event_payload` (or :attr:`Event.data`), keyed on the event type.

Models are lenient like every peer model (unknown keys ignored) because rows outlive versions:
a row written by a newer server still reads. A type this version does not know, or a payload
that does not fit its type's model, reads as :class:`UntypedEventPayload` holding the stored
JSON untouched, so neither the API nor the CLI fails on it.

The stored JSON is what earlier versions wrote: camelCase keys, UUIDs as lowercase strings,
and a key that only some events carry (``failedModels``, ``activeReady``, a step's facts) is
left out rather than written as null.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal, get_args
from uuid import UUID

from pydantic import (
    AwareDatetime,
    Field,
    PlainSerializer,
    StrictBool,
    StrictInt,
    TypeAdapter,
    ValidationError,
    create_model,
)

from haru_protocol._base import PeerModel
from haru_protocol._enums import (
    DomainState,
    EventType,
    OperationErrorCode,
    OperationKind,
    OperationStep,
    SlotKind,
)


def _absent_when_none(value: object) -> bool:
    return value is None


def _optional() -> Any:
    """A fact some events carry: absent from the stored JSON when None."""
    return Field(default=None, exclude_if=_absent_when_none)


def _iso(value: datetime) -> str:
    return value.isoformat()


IsoDatetime = Annotated[AwareDatetime, PlainSerializer(_iso, return_type=str)]
"""A timestamp stored as ``datetime.isoformat()`` writes it (``+00:00``, as before)."""

Role = Literal["active", "standby"]
"""A domain's role in its fleet when the event happened."""


class EventPayload(PeerModel):
    """Base of every typed event payload; ``event_type`` is the type it belongs to."""

    event_type: ClassVar[EventType]


# ---- operations ------------------------------------------------------------------------------


class _OperationRequested(EventPayload):
    kind: OperationKind
    target_domain_id: UUID
    source_domain_id: UUID | None
    """The active domain when the operation was created (null: none)."""


class OperationRequestedPromote(_OperationRequested):
    """``operation.requested.promote``: ``POST .../promote`` created an operation."""

    event_type = EventType.OPERATION_REQUESTED_PROMOTE


class OperationRequestedDemote(_OperationRequested):
    """``operation.requested.demote``: ``POST .../demote`` created an operation."""

    event_type = EventType.OPERATION_REQUESTED_DEMOTE


class OperationAutoFailover(EventPayload):
    """``operation.auto_failover``: the reconciler created a promote on its own."""

    event_type = EventType.OPERATION_AUTO_FAILOVER

    reason: str
    """``active_failed`` or ``active_stale`` (free text for forward compatibility)."""
    active_domain_id: UUID
    target_domain_id: UUID


class OperationRestoreDemote(EventPayload):
    """``operation.restore_demote``: a demote queued to return a domain to standby posture."""

    event_type = EventType.OPERATION_RESTORE_DEMOTE

    cause_operation_id: UUID | None = None
    """The operation whose failure or timeout left the domain out of posture; null when the
    domain left it by itself (its training stopped: reason ``training_idle``)."""
    target_domain_id: UUID
    reason: str
    """The failure code, which best-effort step timed out, or ``training_idle``."""


class OperationStarted(EventPayload):
    """``operation.started``: a pending operation was claimed (its first step begins)."""

    event_type = EventType.OPERATION_STARTED

    kind: OperationKind
    target_domain_id: UUID


class GpuUsage(PeerModel):
    """Memory of one GPU when ``verify_gpu`` proved it released."""

    index: StrictInt
    used_mib: float = Field(alias="usedMiB")
    total_mib: float = Field(alias="totalMiB")


class TrainingStopFact(PeerModel):
    """How one training run stopped (``stop_training``)."""

    gpu_index: StrictInt
    stop_ms: StrictInt
    """SIGTERM to the run's last process gone, on the supervisor's clock."""
    killed: StrictBool
    """The grace ran out and the run was SIGKILLed."""


class OperationStepDone(EventPayload):
    """``operation.step.done``: a step's effect is proven; the facts depend on the step."""

    event_type = EventType.OPERATION_STEP_DONE

    step: OperationStep
    skipped: str | None = _optional()
    """Why the step had nothing to do (no training slots, no previous active domain)."""
    domain_id: UUID | None = _optional()
    """The domain a demote step acted on."""
    training_slots_idle: StrictInt | None = _optional()
    gpus: tuple[GpuUsage, ...] | None = _optional()
    models: tuple[str, ...] | None = _optional()
    """The models proven awake (``wake_vllm``)."""
    latency_ms: dict[str, float] | None = _optional()
    """Probe latency per model (``probe``)."""
    already_active: StrictBool | None = _optional()
    route_revision: StrictInt | None = _optional()
    inference_slots_sleeping: StrictInt | None = _optional()
    training_slots_training: StrictInt | None = _optional()
    timed_out: StrictBool | None = _optional()
    """The step ran out of its budget (best-effort, or routing had already moved)."""
    budget_ms: StrictInt | None = _optional()
    routing_committed: StrictBool | None = _optional()
    automatic: StrictBool | None = _optional()
    """``stop_training``: the operation is an automatic failover (its shorter grace)."""
    grace_ms: StrictInt | None = _optional()
    """``stop_training``: the SIGTERM-to-SIGKILL grace the trainers were given."""
    training_stops: tuple[TrainingStopFact, ...] | None = _optional()
    """``stop_training``: how each trainer stopped, as its supervisor measured it."""


class OperationStepTimeoutBestEffort(EventPayload):
    """``operation.step.timeout_best_effort``: a best-effort step ran out of its budget."""

    event_type = EventType.OPERATION_STEP_TIMEOUT_BEST_EFFORT

    step: OperationStep
    source_domain_id: UUID | None
    source_degraded: StrictBool
    """Whether the source domain was moved from ready to degraded."""


class OperationSucceeded(EventPayload):
    """``operation.succeeded``."""

    event_type = EventType.OPERATION_SUCCEEDED

    kind: OperationKind
    target_domain_id: UUID


class FailedModel(PeerModel):
    """A model the probe could not serve."""

    model: str
    error: str


class OperationFailed(EventPayload):
    """``operation.failed``: the operation ended failed at ``step``."""

    event_type = EventType.OPERATION_FAILED

    step: OperationStep
    code: OperationErrorCode
    message: str
    failed_models: tuple[FailedModel, ...] | None = _optional()
    """``probe_failed``: each model that failed and why."""


class OperationPromotionBackoff(EventPayload):
    """``operation.promotion_backoff``: automatic promotions of a domain pause after failures."""

    event_type = EventType.OPERATION_PROMOTION_BACKOFF

    target_domain_id: UUID
    consecutive_failures: StrictInt
    delay_ms: StrictInt
    until: IsoDatetime


class RoutingSwitched(EventPayload):
    """``routing.switched``: the fleet's route pointer moved (the commit point of a promote)."""

    event_type = EventType.ROUTING_SWITCHED

    from_domain_id: UUID | None
    to_domain_id: UUID
    route_revision: StrictInt | None
    """The revision read right after the switch (null: the fleet was gone)."""


# ---- domains, slots, fleets ------------------------------------------------------------------


class _DomainChange(EventPayload):
    from_state: DomainState = Field(alias="from")
    to_state: DomainState = Field(alias="to")
    role: Role | None = _optional()
    reachable: StrictBool | None = _optional()
    """Whether the supervisor answered the heartbeat."""
    supervisor_ready: StrictBool | None = _optional()
    active_ready: StrictBool | None = _optional()
    """The active domain only: every model bound to it is awake."""
    models_not_awake: tuple[str, ...] | None = _optional()
    """The active domain only, when not active-ready: the models not proven awake."""


class DomainStateChanged(_DomainChange):
    """``domain.state.changed``: a heartbeat (or a ``skyserve`` service's status) moved it."""

    event_type = EventType.DOMAIN_STATE_CHANGED


class DomainNotReady(_DomainChange):
    """``domain.not_ready``: the active domain answered but not every model is awake."""

    event_type = EventType.DOMAIN_NOT_READY


class DomainHeartbeatFailed(_DomainChange):
    """``domain.heartbeat.failed``: a ready domain's supervisor did not answer."""

    event_type = EventType.DOMAIN_HEARTBEAT_FAILED


DeadEvidence = Literal["models_refused", "host_unreachable"]
"""Strong evidence that the active domain is dead (``domain.dead_suspected``)."""


class DomainDegradedEscalated(EventPayload):
    """``domain.degraded.escalated``: a degraded active domain fails.

    It stayed degraded past the grace, or was proven dead (``deadModels`` set) first.
    """

    event_type = EventType.DOMAIN_DEGRADED_ESCALATED

    from_state: DomainState = Field(alias="from")
    to_state: DomainState = Field(alias="to")
    degraded_grace_ms: StrictInt
    dead_models: tuple[str, ...] | None = Field(default=None, exclude_if=lambda v: v is None)
    """The active's models whose servers refused connections on heartbeats at least
    ``deadConfirmMs`` apart (absent: the grace ran out)."""
    dead_confirm_ms: StrictInt | None = Field(default=None, exclude_if=lambda v: v is None)
    evidence: DeadEvidence | None = _optional()
    """What proved it dead (absent: the grace ran out): ``models_refused`` (its supervisor
    answered and every bound model refuses connections) or ``host_unreachable`` (its
    supervisor and every serving endpoint refused or had no route while another domain
    answered)."""
    suspected_at: IsoDatetime | None = _optional()
    """When the first proof was seen (its ``domain.dead_suspected`` event)."""


class DomainSupervisorUnauthorized(EventPayload):
    """``domain.supervisor.unauthorized``: the supervisor refuses the server's token."""

    event_type = EventType.DOMAIN_SUPERVISOR_UNAUTHORIZED

    message: str
    role: Role


class DomainSupervisorAuthorized(EventPayload):
    """``domain.supervisor.authorized``: the supervisor accepts the server's token again."""

    event_type = EventType.DOMAIN_SUPERVISOR_AUTHORIZED


class DomainDeadSuspected(EventPayload):
    """``domain.dead_suspected``: a first heartbeat proves the active dead; a second confirms.

    Written by the server process that saw the proof. ``domain.degraded.escalated`` with the
    same ``evidence`` follows once a fresh observation at least ``deadConfirmMs`` later still
    proves it; ``domain.dead_cleared`` when one does not.
    """

    event_type = EventType.DOMAIN_DEAD_SUSPECTED

    evidence: DeadEvidence
    models: tuple[str, ...]
    """The active's bound models."""
    endpoints: StrictInt = 0
    """``host_unreachable``: how many serving endpoints refused or had no route."""
    proxy_connect_failed_at: IsoDatetime | None = _optional()
    """The latest refused upstream connect to this domain any server's proxy recorded
    (corroboration only; it never fails the domain over by itself)."""
    dead_confirm_ms: StrictInt


class DomainDeadCleared(EventPayload):
    """``domain.dead_cleared``: a suspected-dead active answered again before it was failed."""

    event_type = EventType.DOMAIN_DEAD_CLEARED

    evidence: DeadEvidence
    suspected_at: IsoDatetime


class SlotStateChanged(EventPayload):
    """``slot.state.changed``: a heartbeat moved a slot's state."""

    event_type = EventType.SLOT_STATE_CHANGED

    kind: SlotKind
    from_state: str = Field(alias="from")
    """An inference or training slot state, depending on ``kind``."""
    to_state: str = Field(alias="to")
    cause: str
    """What observed it (``heartbeat``; ``service``: a ``skyserve`` domain's service status)."""


class FleetLayoutApplied(EventPayload):
    """``fleet.layout.applied``: a layout apply created something."""

    event_type = EventType.FLEET_LAYOUT_APPLIED

    fleet_created: StrictBool
    domains_created: StrictInt
    slots_created: StrictInt
    pointer_set: StrictBool


class FleetPolicyChanged(EventPayload):
    """``fleet.policy.changed``: ``PATCH /v1/fleets/{ref}/policy`` changed the operator's values."""

    event_type = EventType.FLEET_POLICY_CHANGED

    old: dict[str, Any]
    """The operator's policy values before (camelCase; a key absent follows the default)."""
    new: dict[str, Any]
    """The operator's policy values after."""
    changed: tuple[str, ...]
    """The keys whose operator value was set, changed or removed."""


class FleetConfigChanged(EventPayload):
    """``fleet.config.changed``: ``haru apply`` changed one stored row (one plan item or more)."""

    event_type = EventType.FLEET_CONFIG_CHANGED

    action: str
    """``+`` added, ``~`` changed (a row's changes are one event per item)."""
    subject: str
    """``fleet``, ``policy``, ``domain``, ``slot`` or ``model``."""
    path: str
    detail: str
    revision: StrictInt
    """The row's configuration revision after the change."""


# ---- provisioned domains ---------------------------------------------------------------------


class DomainLaunchStarted(EventPayload):
    """``domain.launch.started``: the reconciler claimed launch ``attempt`` and runs it."""

    event_type = EventType.DOMAIN_LAUNCH_STARTED

    cluster: str
    """The SkyPilot cluster name."""
    attempt: StrictInt
    """The domain's launch attempt (1 for the first launch)."""
    role: Role


class DomainLaunchSucceeded(EventPayload):
    """``domain.launch.succeeded``: ``sky launch -d`` returned.

    Or, after a restart, the cluster of a claimed attempt was found UP (``observed``).
    """

    event_type = EventType.DOMAIN_LAUNCH_SUCCEEDED

    cluster: str
    attempt: StrictInt
    observed: StrictBool = False
    """True when no launch was awaited: the cluster was found UP by ``sky status``."""


ProvisioningFailure = Literal[
    "launch_failed",
    "launch_timeout",
    "launch_lost",
    "cluster_up_timeout",
    "cluster_lost",
    "supervisor_ready_timeout",
]
"""Why a provisioned domain failed before it was ready."""


class DomainProvisioningFailed(EventPayload):
    """``domain.provisioning.failed``: a provisioned domain failed before it was ready."""

    event_type = EventType.DOMAIN_PROVISIONING_FAILED

    cluster: str
    attempt: StrictInt
    reason: ProvisioningFailure
    message: str
    """One bounded line (never a secret)."""
    argv: tuple[str, ...] | None = _optional()
    """The failed ``sky`` command, when one failed."""
    exit_code: StrictInt | None = _optional()
    stderr: str | None = _optional()
    """The bounded tail of its stderr."""
    cluster_status: str | None = _optional()
    """What ``sky status`` said (``absent`` for an unknown cluster)."""


class DomainAddressRecorded(EventPayload):
    """``domain.address.recorded``: the cluster is UP (or the service READY): URLs recorded."""

    event_type = EventType.DOMAIN_ADDRESS_RECORDED

    cluster: str
    attempt: StrictInt
    supervisor_url: str | None
    """None for a ``skyserve`` domain (its replicas run no Haru supervisor)."""
    serving_base_url: str
    """The head's gateway, or a SkyServe service's endpoint."""


class DomainClusterLost(EventPayload):
    """``domain.cluster.lost``: a launched domain's cluster is stopped or gone: it failed.

    SkyPilot reports it ``STOPPED`` (preempted, stopped) or does not know it (torn down).
    """

    event_type = EventType.DOMAIN_CLUSTER_LOST

    cluster: str
    attempt: StrictInt
    cluster_status: str
    """``STOPPED``, or ``absent`` when ``sky status`` does not know the cluster."""
    from_state: DomainState = Field(alias="from")
    role: Role


class DomainRelaunch(EventPayload):
    """``domain.relaunch``: a failed provisioned domain is launched again (one per attempt).

    Or relaunching gave up (``exhausted``): the domain stays failed.
    """

    event_type = EventType.DOMAIN_RELAUNCH

    cluster: str
    relaunch: StrictInt
    """Which relaunch of the current streak (1 = the first since the domain was last ready)."""
    max_attempts: StrictInt
    backoff_ms: StrictInt
    """The pause that was waited after the failure."""
    exhausted: StrictBool = False
    """True: ``relaunchMaxAttempts`` is spent; the domain stays failed."""


class DomainUpRequested(EventPayload):
    """``domain.up.requested``: the operator asked a stopped or failed domain to launch."""

    event_type = EventType.DOMAIN_UP_REQUESTED

    from_state: DomainState = Field(alias="from")


class DomainDownRequested(EventPayload):
    """``domain.down.requested``: the operator asked a standby domain to be torn down."""

    event_type = EventType.DOMAIN_DOWN_REQUESTED

    from_state: DomainState = Field(alias="from")


class DomainTeardown(EventPayload):
    """``domain.teardown``: ``sky down`` of a stopping domain ended (``ok``) or failed (retried)."""

    event_type = EventType.DOMAIN_TEARDOWN

    cluster: str
    ok: StrictBool
    message: str | None = _optional()
    argv: tuple[str, ...] | None = _optional()
    exit_code: StrictInt | None = _optional()
    stderr: str | None = _optional()


# ---- server processes ------------------------------------------------------------------------


class _ServerClock(EventPayload):
    skew_ms: StrictInt
    """This process's wall clock minus the database's, in milliseconds."""
    max_skew_ms: StrictInt
    """Its ``HARU_MAX_CLOCK_SKEW_MS``."""
    host: str
    """The host name of the process."""
    pid: StrictInt


class ServerClockSkewed(_ServerClock):
    """``server.clock.skewed``: a server process's clock left the bound; it stops reconciling."""

    event_type = EventType.SERVER_CLOCK_SKEWED


class ServerClockRecovered(_ServerClock):
    """``server.clock.recovered``: a server process's clock is within the bound again."""

    event_type = EventType.SERVER_CLOCK_RECOVERED


class ServerPartitioned(EventPayload):
    """``server.partitioned``: a server process reached no supervisor of the fleet.

    It judges no domain and fails nothing over until one answers again (its own network, or
    every domain at once, cannot be told apart from there).
    """

    event_type = EventType.SERVER_PARTITIONED

    domains: StrictInt
    """How many supervisors it polled."""
    host: str
    pid: StrictInt


class ServerPartitionHealed(EventPayload):
    """``server.partition.healed``: a partitioned server process reaches a supervisor again."""

    event_type = EventType.SERVER_PARTITION_HEALED

    host: str
    pid: StrictInt


# ---- reading ---------------------------------------------------------------------------------


class UntypedEventPayload(PeerModel):
    """A payload read without its model: a type this version does not know, or malformed.

    Serialised back exactly as stored (:attr:`data`), never repaired.
    """

    type: str
    """The event's type."""
    data: Any
    """The stored JSON value."""
    error: str | None = None
    """Why it did not fit its type's model; None when the type is simply unknown."""


KnownEventPayload = (
    OperationRequestedPromote
    | OperationRequestedDemote
    | OperationAutoFailover
    | OperationRestoreDemote
    | OperationStarted
    | OperationStepDone
    | OperationStepTimeoutBestEffort
    | OperationSucceeded
    | OperationFailed
    | OperationPromotionBackoff
    | RoutingSwitched
    | DomainStateChanged
    | DomainNotReady
    | DomainHeartbeatFailed
    | DomainDegradedEscalated
    | DomainSupervisorUnauthorized
    | DomainSupervisorAuthorized
    | DomainDeadSuspected
    | DomainDeadCleared
    | SlotStateChanged
    | FleetLayoutApplied
    | FleetPolicyChanged
    | FleetConfigChanged
    | DomainLaunchStarted
    | DomainLaunchSucceeded
    | DomainProvisioningFailed
    | DomainAddressRecorded
    | DomainClusterLost
    | DomainRelaunch
    | DomainUpRequested
    | DomainDownRequested
    | DomainTeardown
    | ServerClockSkewed
    | ServerClockRecovered
    | ServerPartitioned
    | ServerPartitionHealed
)
"""Every typed payload (one per :class:`EventType`)."""

AnyEventPayload = KnownEventPayload | UntypedEventPayload
"""What :func:`parse_event_payload` returns."""

EVENT_PAYLOADS: Mapping[str, type[EventPayload]] = {
    model.event_type.value: model for model in get_args(KnownEventPayload)
}
"""The payload model of each event type, keyed on the type's wire value."""


def parse_event_payload(type_: str, payload: object) -> AnyEventPayload:
    """The typed payload of an event of type ``type_`` (never raises).

    Args:
        type_: The event type as stored.
        payload: The stored JSON value.
    """
    model = EVENT_PAYLOADS.get(type_)
    if model is None:
        return UntypedEventPayload(type=type_, data=payload)
    try:
        return model.model_validate(payload)  # type: ignore[return-value]  # a KnownEventPayload
    except ValidationError as exc:
        return UntypedEventPayload(
            type=type_, data=payload, error=f"{exc.error_count()} validation error(s)"
        )


def event_payload_document(payload: EventPayload) -> dict[str, Any]:
    """The JSON object stored for ``payload`` (camelCase; optional facts absent when None)."""
    return payload.model_dump(mode="json")


def check_event_payload(type_: str, payload: Mapping[str, object]) -> None:
    """Refuse a raw payload that its (known) type's model would read as malformed.

    Raises:
        ValueError: ``payload`` does not fit the model of ``type_``.
    """
    model = EVENT_PAYLOADS.get(type_)
    if model is None:
        return
    try:
        model.model_validate(payload)
    except ValidationError as exc:
        raise ValueError(f"payload of a {type_!r} event does not fit its model: {exc}") from exc


class _EventEnvelope(PeerModel):
    id: StrictInt
    fleet_id: UUID
    domain_id: UUID | None = None
    slot_id: UUID | None = None
    operation_id: UUID | None = None
    created_at: AwareDatetime


def _typed_event(model: type[EventPayload]) -> type[PeerModel]:
    name = model.__name__ + "Event"
    tag: Any = Literal[model.event_type.value]  # a literal built at run time
    envelope: type[PeerModel] = create_model(
        name,
        __base__=_EventEnvelope,
        __doc__=f"An event of type ``{model.event_type.value}``.",
        type=(tag, ...),
        payload=(model, ...),
    )
    return envelope


def event_json_schema() -> dict[str, Any]:
    """JSON Schema of one audit event: a union keyed on ``type`` with each type's payload.

    An event of a type not listed here is still served (its payload untyped).
    """
    variants = [_typed_event(model) for model in EVENT_PAYLOADS.values()]
    union: Any = functools.reduce(operator.or_, variants)
    adapter: TypeAdapter[Any] = TypeAdapter(Annotated[union, Field(discriminator="type")])
    schema = adapter.json_schema(by_alias=True)
    schema["title"] = "Event"
    schema["description"] = (
        "One entry of a fleet's audit trail (GET /v1/fleets/{ref}/events), keyed on its type. "
        "Events of other types may appear; read their payload untyped."
    )
    return schema
