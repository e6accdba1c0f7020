"""Typed payloads of the audit events: one model per :class:`EventType`, read by type.

The events table stores ``type`` and a JSON ``payload``; the models say what the payload of
each type holds, by family: :mod:`haru_protocol._event_operations`,
:mod:`haru_protocol._event_domains`, :mod:`haru_protocol._event_provisioning` and
:mod:`haru_protocol._event_servers` (on :class:`EventPayload` from
:mod:`haru_protocol._event_base`); this module maps the types to them. Writers build the
model (so a key cannot be misspelled) and readers get it back with :func:`parse_event_payload`
(or :attr:`Event.data`), keyed on the event type.

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
from typing import Annotated, Any, Literal, get_args
from uuid import UUID

from pydantic import (
    AwareDatetime,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    create_model,
)

from haru_protocol._base import PeerModel
from haru_protocol._event_base import EventPayload
from haru_protocol._event_domains import (
    DomainDeadCleared,
    DomainDeadSuspected,
    DomainDegradedEscalated,
    DomainHeartbeatFailed,
    DomainNotReady,
    DomainStateChanged,
    DomainSupervisorAuthorized,
    DomainSupervisorUnauthorized,
    FleetConfigChanged,
    FleetLayoutApplied,
    FleetPolicyChanged,
    SlotStateChanged,
)
from haru_protocol._event_operations import (
    OperationAutoFailover,
    OperationFailed,
    OperationPromotionBackoff,
    OperationRequestedDemote,
    OperationRequestedPromote,
    OperationRestoreDemote,
    OperationStarted,
    OperationStepDone,
    OperationStepTimeoutBestEffort,
    OperationSucceeded,
    RoutingSwitched,
)
from haru_protocol._event_provisioning import (
    DomainAddressRecorded,
    DomainClusterLost,
    DomainDownRequested,
    DomainLaunchStarted,
    DomainLaunchSucceeded,
    DomainProvisioningFailed,
    DomainRelaunch,
    DomainTeardown,
    DomainUpRequested,
)
from haru_protocol._event_servers import (
    ServerClockRecovered,
    ServerClockSkewed,
    ServerPartitioned,
    ServerPartitionHealed,
)


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
