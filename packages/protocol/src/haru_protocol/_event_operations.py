"""Audit event payloads of operations: requested, started, each step, the outcome, routing."""

from __future__ import annotations

from uuid import UUID

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
)

from haru_protocol._base import PeerModel
from haru_protocol._enums import (
    EventType,
    OperationErrorCode,
    OperationKind,
    OperationStep,
)
from haru_protocol._event_base import EventPayload, IsoDatetime, _optional


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
    """The revision the switch wrote (null only in events stored before release 0.4.0)."""
