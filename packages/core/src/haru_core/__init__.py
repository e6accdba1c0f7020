"""Haru's pure decision logic: no I/O, no clock reads (time is always an argument).

Everything here takes snapshots from :mod:`haru_protocol` and returns values or frozen intents
(:class:`CreateOperation`, :class:`FailoverDecision`, :class:`SlotChange`, ...) that the
repository layer and the reconciler apply with compare-and-swap writes.
"""

from haru_core._backoff import PromotionBackoff, backoff_delay_ms, in_backoff, promotion_backoff
from haru_core._bindings import (
    has_inference_bindings,
    inference_bindings,
    inference_slots,
    is_active,
    slot_bindings,
    training_slots,
)
from haru_core._decisions import (
    AlreadyActive,
    CreateOperation,
    InvalidTarget,
    TargetProblem,
    decide_demotion,
    decide_promotion,
)
from haru_core._errors import HaruCoreError, InvalidTransitionError
from haru_core._failover import (
    FailoverDecision,
    active_proven_dead,
    awaiting_confirmation,
    dead_since,
    detect_dead_active,
    detect_degraded_escalation,
    detect_failover,
    is_stale,
    is_viable_standby,
    rank_standbys,
    server_partitioned,
)
from haru_core._heartbeat import (
    DomainChange,
    HeartbeatVerdict,
    SlotChange,
    active_ready,
    domain_change_on_heartbeat,
    model_sleep_states,
    models_busy,
    slot_health_changes,
)
from haru_core._layout_plan import (
    DomainAdd,
    DomainRowChange,
    FleetRowChange,
    LayoutPlan,
    RowChange,
    SlotAdd,
    SlotRowChange,
    plan_layout,
)
from haru_core._plan import (
    BEST_EFFORT_STEPS,
    DEMOTE_STEPS,
    PROMOTE_STEPS,
    first_step,
    is_best_effort,
    is_step_overdue,
    next_step,
    plan_for,
    step_budget_ms,
    step_remaining_ms,
)
from haru_core._proofs import (
    GPU_RELEASED_RATIO,
    ROUTE_GUARD_MARGIN_MS,
    ROUTE_READ_BOUND_MS,
    gpus_not_released,
    lease_guard_ms,
    models_not_in,
    training_not_idle,
    training_not_running,
)
from haru_core._restore import (
    RESTORE_REASON_TRAINING_IDLE,
    RESTORE_REASON_VLLM_AWAKE,
    RestoreDecision,
    awake_standbys,
    detect_restore,
    detect_restores,
    is_out_of_posture,
    launched_as_standby,
    may_be_awake_standby,
    reached_standby_posture,
    restore_backoff,
    restore_candidates,
    restore_confirmed,
)
from haru_core._routing import build_route_intent, find_routable_binding, routable_models
from haru_core._snapshot import LAYOUT_NAMESPACE, layout_id, snapshot_from_layout
from haru_core._states import (
    DOMAIN_TRANSITIONS,
    INFERENCE_TRANSITIONS,
    PROMOTABLE_DOMAIN_STATES,
    ROUTABLE_DOMAIN_STATES,
    TRAINING_TRANSITIONS,
    Machine,
    assert_transition,
    can_transition,
    is_valid_state,
    machine_for,
    states_with_edge_to,
    valid_states,
)
from haru_core._time import (
    FUTURE_TOLERANCE,
    clamp_to_now,
    elapsed_since,
    fleet_times_ahead,
    lies_ahead,
    operations_ahead,
)

__all__ = (  # noqa: RUF022 -- grouped by topic, not alphabetically
    # State tables (SPEC 4)
    "DOMAIN_TRANSITIONS",
    "INFERENCE_TRANSITIONS",
    "TRAINING_TRANSITIONS",
    "PROMOTABLE_DOMAIN_STATES",
    "ROUTABLE_DOMAIN_STATES",
    "Machine",
    "machine_for",
    "valid_states",
    "is_valid_state",
    "can_transition",
    "assert_transition",
    "states_with_edge_to",
    # Operation plans (SPEC 4, 3.5)
    "PROMOTE_STEPS",
    "DEMOTE_STEPS",
    "BEST_EFFORT_STEPS",
    "plan_for",
    "first_step",
    "next_step",
    "is_best_effort",
    "step_budget_ms",
    "step_remaining_ms",
    "is_step_overdue",
    # Bindings and roles
    "inference_slots",
    "training_slots",
    "slot_bindings",
    "inference_bindings",
    "has_inference_bindings",
    "is_active",
    # Promotion and demotion decisions (SPEC 7.2)
    "AlreadyActive",
    "TargetProblem",
    "InvalidTarget",
    "CreateOperation",
    "decide_promotion",
    "decide_demotion",
    # Failover (SPEC 7.3 step 2)
    "FailoverDecision",
    "is_stale",
    "is_viable_standby",
    "rank_standbys",
    "detect_failover",
    "detect_degraded_escalation",
    "active_proven_dead",
    "awaiting_confirmation",
    "dead_since",
    "detect_dead_active",
    "server_partitioned",
    # Promotion backoff
    "PromotionBackoff",
    "backoff_delay_ms",
    "promotion_backoff",
    "in_backoff",
    # Time: a stored time from the future counts as now
    "FUTURE_TOLERANCE",
    "clamp_to_now",
    "elapsed_since",
    "lies_ahead",
    "fleet_times_ahead",
    "operations_ahead",
    # Standby posture (restore demotes)
    "RESTORE_REASON_TRAINING_IDLE",
    "RESTORE_REASON_VLLM_AWAKE",
    "RestoreDecision",
    "is_out_of_posture",
    "restore_candidates",
    "launched_as_standby",
    "may_be_awake_standby",
    "awake_standbys",
    "reached_standby_posture",
    "restore_backoff",
    "restore_confirmed",
    "detect_restore",
    "detect_restores",
    # Heartbeat verdicts (SPEC 7.3 step 1)
    "SlotChange",
    "DomainChange",
    "HeartbeatVerdict",
    "model_sleep_states",
    "models_busy",
    "slot_health_changes",
    "active_ready",
    "domain_change_on_heartbeat",
    # Step proofs and the route guard (DESIGN 7.3, 7.5)
    "GPU_RELEASED_RATIO",
    "training_not_idle",
    "training_not_running",
    "models_not_in",
    "gpus_not_released",
    "ROUTE_READ_BOUND_MS",
    "ROUTE_GUARD_MARGIN_MS",
    "lease_guard_ms",
    # Routing (SPEC 7.4)
    "routable_models",
    "find_routable_binding",
    "build_route_intent",
    # Errors
    "HaruCoreError",
    "InvalidTransitionError",
    # Snapshots for orchestrators without a state store
    "LAYOUT_NAMESPACE",
    "layout_id",
    "snapshot_from_layout",
    "DomainAdd",
    "DomainRowChange",
    "FleetRowChange",
    "LayoutPlan",
    "RowChange",
    "SlotAdd",
    "SlotRowChange",
    "plan_layout",
)
