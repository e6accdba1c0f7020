"""Audit event payloads of domains, slots and fleets: states, health, layout and config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
)

from haru_protocol._enums import (
    DomainState,
    EventType,
    SlotKind,
)
from haru_protocol._event_base import EventPayload, IsoDatetime, Role, _optional


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
