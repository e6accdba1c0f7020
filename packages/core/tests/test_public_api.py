"""haru_core's surface: the contracted names, and purity enforced on its imports."""

from __future__ import annotations

import ast
from pathlib import Path

import haru_core

PACKAGE_DIR = Path(haru_core.__file__).resolve().parent

# Pure logic: the standard library's data-only modules and haru-protocol, nothing that does
# I/O (os, asyncio, sockets, subprocess), reads a clock behind the caller's back, or pulls in
# the server's stack (aiohttp, sqlalchemy).
ALLOWED_IMPORTS = {
    "__future__",
    "collections",
    "dataclasses",
    "datetime",
    "enum",
    "typing",
    "uuid",
    "haru_protocol",
    "haru_core",
}

# The contract other packages code against (CORE_API); removing a name breaks them.
CONTRACT = {
    "GPU_RELEASED_RATIO",
    "training_not_idle",
    "training_not_running",
    "models_not_in",
    "gpus_not_released",
    "ROUTE_READ_BOUND_MS",
    "ROUTE_GUARD_MARGIN_MS",
    "lease_guard_ms",
    "Reach",
    "UNREACHABLE",
    "WeakEvidence",
    "serving_endpoints",
    "check_endpoints",
    "host_unreachable",
    "proxy_connect_failed",
    "proxy_kick",
    "weak_evidence",
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
    "inference_bindings",
    "has_inference_bindings",
    "training_slots",
    "inference_slots",
    "is_active",
    "domain_role",
    "AlreadyActive",
    "TargetProblem",
    "InvalidTarget",
    "CreateOperation",
    "decide_promotion",
    "decide_demotion",
    "is_stale",
    "is_viable_standby",
    "rank_standbys",
    "FailoverDecision",
    "detect_failover",
    "detect_degraded_escalation",
    "active_proven_dead",
    "awaiting_confirmation",
    "dead_since",
    "detect_dead_active",
    "server_partitioned",
    "PromotionBackoff",
    "backoff_delay_ms",
    "promotion_backoff",
    "in_backoff",
    "RELAUNCH_STREAK_EVENTS",
    "RelaunchStreak",
    "RelaunchPlan",
    "RelaunchesSpent",
    "fold_relaunch_streak",
    "relaunch_backoff_ms",
    "plan_relaunch",
    "FUTURE_TOLERANCE",
    "clamp_to_now",
    "elapsed_since",
    "lies_ahead",
    "fleet_times_ahead",
    "operations_ahead",
    "RESTORE_REASON_TRAINING_IDLE",
    "RESTORE_REASON_VLLM_AWAKE",
    "RestoreDecision",
    "is_out_of_posture",
    "restore_candidates",
    "may_be_awake_standby",
    "awake_standbys",
    "reached_standby_posture",
    "launched_as_standby",
    "restore_backoff",
    "restore_confirmed",
    "detect_restore",
    "detect_restores",
    "SlotChange",
    "DomainChange",
    "HeartbeatVerdict",
    "model_sleep_states",
    "models_busy",
    "slot_health_changes",
    "active_ready",
    "domain_change_on_heartbeat",
    "routable_models",
    "find_routable_binding",
    "build_route_intent",
    # Snapshots for orchestrators without a state store
    "LAYOUT_NAMESPACE",
    "layout_id",
    "snapshot_from_layout",
    "HaruCoreError",
    "InvalidTransitionError",
    # Layout plans (haru apply)
    "DomainAdd",
    "DomainRemove",
    "DomainRowChange",
    "FleetRowChange",
    "LayoutPlan",
    "RowChange",
    "SlotAdd",
    "SlotRemove",
    "SlotRowChange",
    "plan_layout",
}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            assert node.module is not None
            roots.add(node.module.split(".")[0])
    return roots


def test_modules_import_nothing_impure() -> None:
    modules = sorted(PACKAGE_DIR.glob("*.py"))
    assert len(modules) >= 8
    for module in modules:
        extra = imported_roots(module) - ALLOWED_IMPORTS
        assert not extra, f"{module.name} imports {sorted(extra)}"


def test_no_private_protocol_imports() -> None:
    for module in PACKAGE_DIR.glob("*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("haru_protocol."), module.name


def test_contract_is_exported() -> None:
    exported = set(haru_core.__all__)
    assert len(exported) == len(haru_core.__all__), "duplicate names in __all__"
    assert exported >= CONTRACT, sorted(CONTRACT - exported)
    assert exported - CONTRACT == {"slot_bindings"}
    for name in exported:
        assert getattr(haru_core, name) is not None
