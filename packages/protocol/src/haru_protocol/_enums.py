"""Closed vocabularies of DESIGN section 4 (states, kinds, steps) and the event types."""

from __future__ import annotations

from enum import StrEnum


class DomainState(StrEnum):
    """Lifecycle state of a failure domain."""

    PROVISIONING = "provisioning"
    READY = "ready"
    DEGRADED = "degraded"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class InferenceSlotState(StrEnum):
    """State of an inference slot (the vLLM servers on one GPU)."""

    STARTING = "starting"
    SERVING = "serving"
    SLEEPING = "sleeping"
    WAKING = "waking"
    PROBING = "probing"
    FAILED = "failed"
    STOPPED = "stopped"


class TrainingSlotState(StrEnum):
    """State of a training slot (the preemptible trainer on one GPU)."""

    IDLE = "idle"
    TRAINING = "training"
    STOPPING = "stopping"
    FAILED = "failed"
    STOPPED = "stopped"


SlotState = InferenceSlotState | TrainingSlotState
"""Any slot state; which enum applies depends on the slot kind."""


class SlotKind(StrEnum):
    """Kind of a slot."""

    INFERENCE = "inference"
    TRAINING = "training"


class Provider(StrEnum):
    """Who provisions a domain's machines."""

    STATIC = "static"
    SKYPILOT = "skypilot"
    SKYSERVE = "skyserve"


class Cloud(StrEnum):
    """Clouds a domain may be placed on (the names SkyPilot's ``infra`` key uses)."""

    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    KUBERNETES = "kubernetes"
    LAMBDA = "lambda"
    RUNPOD = "runpod"
    NEBIUS = "nebius"
    OCI = "oci"
    PAPERSPACE = "paperspace"
    FLUIDSTACK = "fluidstack"
    CUDO = "cudo"
    VAST = "vast"
    DO = "do"
    SCP = "scp"
    VSPHERE = "vsphere"


class OperationKind(StrEnum):
    """Kind of a fleet operation."""

    PROMOTE = "promote"
    DEMOTE = "demote"


class OperationState(StrEnum):
    """State of a fleet operation."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


IN_FLIGHT_OPERATION_STATES: tuple[OperationState, ...] = (
    OperationState.PENDING,
    OperationState.RUNNING,
)
"""States of an operation that is not finished (at most one per fleet)."""


class OperationStep(StrEnum):
    """Steps of the promote and demote plans."""

    STOP_TRAINING = "stop_training"
    VERIFY_GPU = "verify_gpu"
    WAKE_VLLM = "wake_vllm"
    PROBE = "probe"
    SWITCH_ACTIVE = "switch_active"
    DEMOTE_OLD_SLEEP = "demote_old_sleep"
    DEMOTE_OLD_TRAIN = "demote_old_train"
    SLEEP_VLLM = "sleep_vllm"
    START_TRAINING = "start_training"


class OperationErrorCode(StrEnum):
    """Why an operation failed (``operation.error.code``)."""

    STEP_TIMEOUT = "step_timeout"
    SUPERVISOR_UNAUTHORIZED = "supervisor_unauthorized"
    NO_INFERENCE_BINDINGS = "no_inference_bindings"
    PROBE_FAILED = "probe_failed"
    CAS_LOST = "cas_lost"
    TARGET_IS_ACTIVE = "target_is_active"
    TARGET_MISSING = "target_missing"


class TrainingRunState(StrEnum):
    """State of one training run as the supervisor reports it."""

    IDLE = "idle"
    RUNNING = "running"
    STOPPING = "stopping"


class EventType(StrEnum):
    """Types of the audit events the control plane appends."""

    OPERATION_REQUESTED_PROMOTE = "operation.requested.promote"
    OPERATION_REQUESTED_DEMOTE = "operation.requested.demote"
    OPERATION_AUTO_FAILOVER = "operation.auto_failover"
    OPERATION_RESTORE_DEMOTE = "operation.restore_demote"
    OPERATION_STARTED = "operation.started"
    OPERATION_STEP_DONE = "operation.step.done"
    OPERATION_STEP_TIMEOUT_BEST_EFFORT = "operation.step.timeout_best_effort"
    OPERATION_SUCCEEDED = "operation.succeeded"
    OPERATION_FAILED = "operation.failed"
    ROUTING_SWITCHED = "routing.switched"
    DOMAIN_STATE_CHANGED = "domain.state.changed"
    DOMAIN_NOT_READY = "domain.not_ready"
    DOMAIN_HEARTBEAT_FAILED = "domain.heartbeat.failed"
    DOMAIN_DEGRADED_ESCALATED = "domain.degraded.escalated"
    DOMAIN_SUPERVISOR_UNAUTHORIZED = "domain.supervisor.unauthorized"
    DOMAIN_SUPERVISOR_AUTHORIZED = "domain.supervisor.authorized"
    DOMAIN_DEAD_SUSPECTED = "domain.dead_suspected"
    DOMAIN_DEAD_CLEARED = "domain.dead_cleared"
    OPERATION_PROMOTION_BACKOFF = "operation.promotion_backoff"
    SLOT_STATE_CHANGED = "slot.state.changed"
    FLEET_LAYOUT_APPLIED = "fleet.layout.applied"
    FLEET_POLICY_CHANGED = "fleet.policy.changed"
    FLEET_CONFIG_CHANGED = "fleet.config.changed"
    DOMAIN_LAUNCH_STARTED = "domain.launch.started"
    DOMAIN_LAUNCH_SUCCEEDED = "domain.launch.succeeded"
    DOMAIN_PROVISIONING_FAILED = "domain.provisioning.failed"
    DOMAIN_ADDRESS_RECORDED = "domain.address.recorded"
    DOMAIN_CLUSTER_LOST = "domain.cluster.lost"
    DOMAIN_RELAUNCH = "domain.relaunch"
    DOMAIN_UP_REQUESTED = "domain.up.requested"
    DOMAIN_DOWN_REQUESTED = "domain.down.requested"
    DOMAIN_TEARDOWN = "domain.teardown"
    SERVER_CLOCK_SKEWED = "server.clock.skewed"
    SERVER_CLOCK_RECOVERED = "server.clock.recovered"
    SERVER_PARTITIONED = "server.partitioned"
    SERVER_PARTITION_HEALED = "server.partition.healed"
