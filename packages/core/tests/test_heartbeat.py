"""Heartbeat verdicts of DESIGN 7.3 step 1: slot health mirroring and domain transitions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from haru_core import (
    DomainChange,
    HeartbeatVerdict,
    SlotChange,
    active_ready,
    can_transition,
    domain_change_on_heartbeat,
    machine_for,
    model_sleep_states,
    models_busy,
    slot_health_changes,
)
from haru_protocol import (
    DomainState,
    EventType,
    InferenceSlotState,
    ModelStatus,
    SlotKind,
    SlotStatus,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotState,
    TrainingStatus,
)

if TYPE_CHECKING:
    from conftest import FleetFactory

I = InferenceSlotState  # noqa: E741 -- short alias for the tables below
T = TrainingSlotState
D = DomainState
RUNNING = TrainingRunState.RUNNING
IDLE = TrainingRunState.IDLE
STOPPING = TrainingRunState.STOPPING


def assert_allowed(changes: tuple[SlotChange, ...]) -> None:
    for change in changes:
        assert can_transition(machine_for(change.kind), change.from_state, change.to_state)


# ---- model_sleep_states ----


def test_model_sleep_states_across_slots() -> None:
    status = SupervisorStatus(
        ready=False,
        slots=(
            SlotStatus(
                gpu_index=0,
                kind=SlotKind.INFERENCE,
                models=(
                    ModelStatus(name="a", port=1, sleeping=True),
                    ModelStatus(name="b", port=2, sleeping=None),
                ),
            ),
            SlotStatus(gpu_index=1, kind=SlotKind.INFERENCE, models=None),
            SlotStatus(
                gpu_index=2,
                kind=SlotKind.INFERENCE,
                models=(ModelStatus(name="c", port=3, sleeping=False),),
            ),
            SlotStatus(gpu_index=0, kind=SlotKind.TRAINING, training=TrainingStatus(state=IDLE)),
        ),
    )
    assert model_sleep_states(status) == {"a": True, "b": None, "c": False}


def test_model_reported_twice_with_different_answers_is_unproven() -> None:
    def slot(gpu: int, sleeping: bool) -> SlotStatus:
        model = ModelStatus(name="dup", port=gpu, sleeping=sleeping)
        return SlotStatus(gpu_index=gpu, kind=SlotKind.INFERENCE, models=(model,))

    assert model_sleep_states(
        SupervisorStatus(ready=False, slots=(slot(0, True), slot(1, True)))
    ) == {"dup": True}
    assert model_sleep_states(
        SupervisorStatus(ready=False, slots=(slot(0, True), slot(1, False)))
    ) == {"dup": None}


# ---- training slots (either role) ----

TRAINING_CASES = [
    # (slot state, run state, pids, expected target)
    (T.TRAINING, IDLE, (), T.IDLE),
    (T.TRAINING, IDLE, (42,), T.IDLE),
    (T.TRAINING, RUNNING, (42,), None),
    (T.TRAINING, STOPPING, (42,), None),
    (T.IDLE, RUNNING, (42,), T.TRAINING),
    (T.IDLE, RUNNING, (), None),
    (T.IDLE, IDLE, (), None),
    (T.IDLE, STOPPING, (42,), None),
    *[
        (s, r, p, None)
        for s in (T.STOPPING, T.FAILED, T.STOPPED)
        for r, p in [
            (IDLE, ()),
            (RUNNING, (42,)),
            (STOPPING, (42,)),
        ]
    ],
]


@pytest.mark.parametrize("role", ["active", "standby"])
@pytest.mark.parametrize(("state", "run", "pids", "expected"), TRAINING_CASES)
def test_training_mirroring(
    make: FleetFactory,
    role: str,
    state: TrainingSlotState,
    run: TrainingRunState,
    pids: tuple[int, ...],
    expected: TrainingSlotState | None,
) -> None:
    # The inference slot is healthy for either role, so only the training slot may move.
    inference_state = I.SERVING if role == "active" else I.SLEEPING
    beta = make.domain(
        "beta", slots=[make.inference(0, "m", state=inference_state), make.training(1, state=state)]
    )
    fleet = make.fleet(make.domain("alpha"), beta, active="beta" if role == "active" else "alpha")
    status = make.status(models={"m": role != "active"}, training={1: (run, pids)})
    changes = slot_health_changes(fleet, beta, status)
    training_slot = beta.slots[1]
    if expected is None:
        assert changes == ()
    else:
        assert changes == (SlotChange(training_slot.id, SlotKind.TRAINING, state, expected),)
        assert_allowed(changes)


def test_training_slot_not_reported_is_untouched(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0, "m"), make.training(0, state=T.TRAINING)])
    fleet = make.fleet(beta, active="beta")
    assert slot_health_changes(fleet, beta, make.status(models={"m": False})) == ()


def test_training_matches_by_gpu_index_and_kind(make: FleetFactory) -> None:
    beta = make.domain(
        "beta",
        slots=[
            make.inference(0, "m"),
            make.training(0, state=T.TRAINING),
            make.training(1, state=T.IDLE),
        ],
    )
    fleet = make.fleet(beta, active="beta")
    # GPU 0 reports idle, GPU 1 running: each slot follows its own GPU's report.
    status = make.status(models={"m": False}, training={0: (IDLE, ()), 1: (RUNNING, (7,))})
    changes = slot_health_changes(fleet, beta, status)
    assert {(c.slot_id, c.to_state) for c in changes} == {
        (beta.slots[1].id, T.IDLE),
        (beta.slots[2].id, T.TRAINING),
    }
    # An inference slot status on GPU 1 is not the training run of GPU 1.
    only_inference = SupervisorStatus(
        ready=True,
        slots=(
            SlotStatus(
                gpu_index=1,
                kind=SlotKind.INFERENCE,
                models=(ModelStatus(name="m", port=1, sleeping=False),),
            ),
        ),
    )
    assert slot_health_changes(fleet, beta, only_inference) == ()


# ---- inference slots of the active ----

ACTIVE_CASES = [
    # (slot state, reported sleep states of the bound models "a" and "b", expected)
    (I.SERVING, {"a": False, "b": False}, None),
    (I.SERVING, {"a": False, "b": True}, I.FAILED),
    (I.SERVING, {"a": False, "b": None}, I.FAILED),
    (I.SERVING, {"a": False}, I.FAILED),  # "b" omitted
    (I.SERVING, {}, I.FAILED),
    (I.FAILED, {"a": False, "b": False}, I.SERVING),
    (I.FAILED, {"a": False, "b": None}, None),
    (I.FAILED, {"a": True, "b": True}, None),
    (I.STOPPED, {"a": False, "b": False}, None),
    (I.STOPPED, {"a": True, "b": None}, None),
    # No operation drives the domain: every other state is reconciled with the report.
    (I.STARTING, {"a": False, "b": False}, I.SERVING),
    (I.STARTING, {"a": True, "b": None}, None),  # still loading: unproven either way
    (I.PROBING, {"a": False, "b": False}, I.SERVING),
    (I.PROBING, {"a": True, "b": None}, I.FAILED),
    (I.SLEEPING, {"a": False, "b": False}, I.FAILED),  # no direct edge; failed heals next
    (I.SLEEPING, {"a": True, "b": True}, I.FAILED),
    (I.WAKING, {"a": False, "b": False}, I.FAILED),
    (I.WAKING, {"a": True, "b": None}, I.FAILED),
]

BUSY_ACTIVE_CASES = [
    # An in-flight operation drives the domain: only its posture and failed are mirrored.
    *[(s, m, e) for s, m, e in ACTIVE_CASES if s in (I.SERVING, I.FAILED)],
    *[
        (s, m, None)
        for s in (I.STARTING, I.SLEEPING, I.WAKING, I.PROBING, I.STOPPED)
        for m in ({"a": False, "b": False}, {"a": True, "b": None})
    ],
]


@pytest.mark.parametrize(
    ("busy", "state", "reported", "expected"),
    [(False, *c) for c in ACTIVE_CASES] + [(True, *c) for c in BUSY_ACTIVE_CASES],
)
def test_active_inference_mirroring(
    make: FleetFactory,
    busy: bool,
    state: InferenceSlotState,
    reported: dict[str, bool | None],
    expected: InferenceSlotState | None,
) -> None:
    alpha = make.domain("alpha", slots=[make.inference(0, "a", "b", state=state)])
    fleet = make.fleet(alpha, make.domain("beta"), active="alpha")
    changes = slot_health_changes(fleet, alpha, make.status(models=reported), busy=busy)
    if expected is None:
        assert changes == ()
    else:
        assert changes == (SlotChange(alpha.slots[0].id, SlotKind.INFERENCE, state, expected),)
        assert_allowed(changes)


# ---- inference slots of a standby ----

STANDBY_CASES = [
    (I.SLEEPING, {"a": True, "b": True}, None),
    (I.SLEEPING, {"a": True, "b": False}, I.FAILED),  # unexpectedly awake
    (I.SLEEPING, {"a": True, "b": None}, I.FAILED),  # unreachable
    (I.SLEEPING, {"a": True}, I.FAILED),  # omitted
    (I.SLEEPING, {}, I.FAILED),
    (I.FAILED, {"a": True, "b": True}, I.SLEEPING),
    (I.FAILED, {"a": True, "b": None}, None),
    (I.FAILED, {"a": False, "b": False}, None),
    (I.STOPPED, {"a": True, "b": True}, None),
    (I.STOPPED, {"a": False, "b": None}, None),
    # No operation drives the domain: a crash mid-demote left the old active "serving"
    # while its supervisor says asleep; the heartbeat restores the recorded posture.
    (I.SERVING, {"a": True, "b": True}, I.SLEEPING),
    (I.SERVING, {"a": False, "b": None}, I.FAILED),
    (I.STARTING, {"a": True, "b": True}, I.SLEEPING),
    (I.STARTING, {"a": False, "b": None}, None),
    (I.WAKING, {"a": True, "b": True}, I.SLEEPING),
    (I.WAKING, {"a": False, "b": False}, I.FAILED),
    (I.PROBING, {"a": True, "b": True}, I.SLEEPING),
    (I.PROBING, {"a": False, "b": None}, I.FAILED),
]

BUSY_STANDBY_CASES = [
    *[(s, m, e) for s, m, e in STANDBY_CASES if s in (I.SLEEPING, I.FAILED)],
    *[
        (s, m, None)
        for s in (I.STARTING, I.SERVING, I.WAKING, I.PROBING, I.STOPPED)
        for m in ({"a": True, "b": True}, {"a": False, "b": None})
    ],
]


@pytest.mark.parametrize(
    ("busy", "state", "reported", "expected"),
    [(False, *c) for c in STANDBY_CASES] + [(True, *c) for c in BUSY_STANDBY_CASES],
)
def test_standby_inference_mirroring(
    make: FleetFactory,
    busy: bool,
    state: InferenceSlotState,
    reported: dict[str, bool | None],
    expected: InferenceSlotState | None,
) -> None:
    beta = make.domain("beta", slots=[make.inference(0, "a", "b", state=state)])
    fleet = make.fleet(make.domain("alpha"), beta, active="alpha")
    changes = slot_health_changes(fleet, beta, make.status(models=reported), busy=busy)
    if expected is None:
        assert changes == ()
    else:
        assert changes == (SlotChange(beta.slots[0].id, SlotKind.INFERENCE, state, expected),)
        assert_allowed(changes)


def test_standby_without_pointer_is_a_standby(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0, "a", state=I.SLEEPING)])
    fleet = make.fleet(beta)
    assert slot_health_changes(fleet, beta, make.status(models={"a": True})) == ()
    changes = slot_health_changes(fleet, beta, make.status(models={"a": False}))
    assert [c.to_state for c in changes] == [I.FAILED]


def test_models_the_layout_does_not_bind_are_ignored(make: FleetFactory) -> None:
    alpha = make.domain("alpha", slots=[make.inference(0, "a")])
    beta = make.domain("beta", slots=[make.inference(0, "a", state=I.SLEEPING)])
    fleet = make.fleet(alpha, beta, active="alpha")
    # Extra models in the opposite posture (or unproven) change nothing for either role.
    assert (
        slot_health_changes(
            fleet, alpha, make.status(models={"a": False, "extra": True, "x2": None})
        )
        == ()
    )
    assert slot_health_changes(fleet, beta, make.status(models={"a": True, "extra": False})) == ()


def test_each_slot_judged_alone(make: FleetFactory) -> None:
    alpha = make.domain(
        "alpha",
        slots=[
            make.inference(0, "small", "medium"),
            make.inference(1, "large"),
            make.training(0, state=T.TRAINING),
        ],
    )
    fleet = make.fleet(alpha, active="alpha")
    status = make.status(
        models={"small": False, "medium": False, "large": None}, training={0: (IDLE, ())}
    )
    changes = slot_health_changes(fleet, alpha, status)
    assert changes == (
        SlotChange(alpha.slots[1].id, SlotKind.INFERENCE, I.SERVING, I.FAILED),
        SlotChange(alpha.slots[2].id, SlotKind.TRAINING, T.TRAINING, T.IDLE),
    )


def test_model_of_another_slot_counts_by_name(make: FleetFactory) -> None:
    # The supervisor may report a model under another GPU than the layout; the name decides.
    alpha = make.domain("alpha", slots=[make.inference(1, "large", state=I.FAILED)])
    fleet = make.fleet(alpha, active="alpha")
    status = SupervisorStatus(
        ready=True,
        slots=(
            SlotStatus(
                gpu_index=0,
                kind=SlotKind.INFERENCE,
                models=(ModelStatus(name="large", port=1, sleeping=False),),
            ),
        ),
    )
    assert [c.to_state for c in slot_health_changes(fleet, alpha, status)] == [I.SERVING]


# ---- active_ready ----


def test_active_ready(make: FleetFactory) -> None:
    domain = make.domain("alpha", slots=[make.inference(0, "a", "b"), make.inference(1, "c")])
    assert active_ready(domain, make.status(models={"a": False, "b": False, "c": False}))
    assert active_ready(
        domain, make.status(models={"a": False, "b": False, "c": False, "extra": True})
    )
    assert not active_ready(domain, make.status(models={"a": False, "b": False, "c": True}))
    assert not active_ready(domain, make.status(models={"a": False, "b": False, "c": None}))
    assert not active_ready(domain, make.status(models={"a": False, "b": False}))


def test_active_ready_needs_bindings(make: FleetFactory) -> None:
    domain = make.domain("alpha", slots=[make.training(0)])
    # The supervisor's own flag is never trusted over the layout.
    assert not active_ready(domain, make.status(models={"a": False}, ready=True))


def test_active_ready_ignores_slot_states(make: FleetFactory) -> None:
    domain = make.domain("alpha", slots=[make.inference(0, "a", state=I.FAILED)])
    assert active_ready(domain, make.status(models={"a": False}))


# ---- domain transitions ----

Reported = dict[str, bool | None]
AWAKE: Reported = {"m": False}
ASLEEP: Reported = {"m": True}
MIXED: Reported = {"m": None}
SILENT: Reported = {}

# (role, domain state, reported models or None for "no answer", expected target, expected event)
DOMAIN_CASES: list[
    tuple[str, DomainState, dict[str, bool | None] | None, DomainState | None, EventType | None]
] = [
    # No answer: only ready degrades.
    ("active", D.READY, None, D.DEGRADED, EventType.DOMAIN_HEARTBEAT_FAILED),
    ("standby", D.READY, None, D.DEGRADED, EventType.DOMAIN_HEARTBEAT_FAILED),
    *[
        (role, s, None, None, None)
        for role in ("active", "standby")
        for s in (D.PROVISIONING, D.DEGRADED, D.FAILED, D.STOPPING, D.STOPPED)
    ],
    # provisioning: degraded for an active that is not ready, else ready.
    ("active", D.PROVISIONING, AWAKE, D.READY, None),
    ("active", D.PROVISIONING, ASLEEP, D.DEGRADED, None),
    ("active", D.PROVISIONING, MIXED, D.DEGRADED, None),
    ("standby", D.PROVISIONING, ASLEEP, D.READY, None),
    ("standby", D.PROVISIONING, AWAKE, D.READY, None),
    # failed: degraded when reachable; the active only when active-ready.
    ("active", D.FAILED, AWAKE, D.DEGRADED, None),
    ("active", D.FAILED, ASLEEP, None, None),
    ("active", D.FAILED, MIXED, None, None),
    ("standby", D.FAILED, ASLEEP, D.DEGRADED, None),
    ("standby", D.FAILED, MIXED, D.DEGRADED, None),
    # ready: the active degrades (domain.not_ready) when not active-ready; a standby stays.
    ("active", D.READY, AWAKE, None, None),
    ("active", D.READY, ASLEEP, D.DEGRADED, EventType.DOMAIN_NOT_READY),
    ("active", D.READY, MIXED, D.DEGRADED, EventType.DOMAIN_NOT_READY),
    ("active", D.READY, SILENT, D.DEGRADED, EventType.DOMAIN_NOT_READY),
    ("standby", D.READY, ASLEEP, None, None),
    ("standby", D.READY, AWAKE, None, None),
    ("standby", D.READY, MIXED, None, None),
    # degraded: recovers when reachable (standby) or active-ready (active).
    ("active", D.DEGRADED, AWAKE, D.READY, None),
    ("active", D.DEGRADED, ASLEEP, None, None),
    ("active", D.DEGRADED, MIXED, None, None),
    ("standby", D.DEGRADED, ASLEEP, D.READY, None),
    ("standby", D.DEGRADED, MIXED, D.READY, None),
    # stopping / stopped are left to the operator.
    *[
        (role, s, m, None, None)
        for role in ("active", "standby")
        for s in (D.STOPPING, D.STOPPED)
        for m in (AWAKE, ASLEEP)
    ],
]


@pytest.mark.parametrize(("role", "state", "reported", "expected", "event"), DOMAIN_CASES)
def test_domain_change_on_heartbeat(
    make: FleetFactory,
    role: str,
    state: DomainState,
    reported: dict[str, bool | None] | None,
    expected: DomainState | None,
    event: EventType | None,
) -> None:
    beta = make.domain("beta", state=state, slots=[make.inference(0, "m")])
    fleet = make.fleet(make.domain("alpha"), beta, active="beta" if role == "active" else "alpha")
    status = None if reported is None else make.status(models=reported)
    change = domain_change_on_heartbeat(fleet, beta, status)
    if expected is None:
        assert change is None
        return
    assert change is not None
    assert (change.from_state, change.to_state, change.event) == (state, expected, event)
    assert can_transition("domain", change.from_state, change.to_state)
    assert change.detail.role == role
    assert change.detail.reachable is (status is not None)


@pytest.mark.parametrize("role", ["active", "standby"])
@pytest.mark.parametrize("state", list(DomainState))
def test_unauthorized_heartbeat_never_changes_a_domain(
    make: FleetFactory, role: str, state: DomainState
) -> None:
    # A 401/403 is a configuration error, never evidence that the domain is down.
    beta = make.domain("beta", state=state, slots=[make.inference(0, "m")])
    fleet = make.fleet(make.domain("alpha"), beta, active="beta" if role == "active" else "alpha")
    assert domain_change_on_heartbeat(fleet, beta, None, unauthorized=True) is None


def test_not_ready_detail_carries_both_verdicts(make: FleetFactory) -> None:
    alpha = make.domain("alpha", slots=[make.inference(0, "a", "b")])
    fleet = make.fleet(alpha, active="alpha")
    # The supervisor claims ready (it only knows "a"), the layout also binds "b".
    change = domain_change_on_heartbeat(fleet, alpha, make.status(models={"a": False}, ready=True))
    assert change == DomainChange(
        D.READY,
        D.DEGRADED,
        EventType.DOMAIN_NOT_READY,
        HeartbeatVerdict(
            role="active",
            reachable=True,
            supervisor_ready=True,
            active_ready=False,
            models_not_awake=("b",),
        ),
    )


def test_active_without_bindings_is_never_ready(make: FleetFactory) -> None:
    alpha = make.domain("alpha", state=D.PROVISIONING, slots=[make.training(0)])
    fleet = make.fleet(alpha, active="alpha")
    change = domain_change_on_heartbeat(fleet, alpha, make.status(ready=True))
    assert change is not None
    assert change.to_state is D.DEGRADED
    assert change.detail.active_ready is False


def test_standby_detail_has_no_active_verdict(make: FleetFactory) -> None:
    beta = make.domain("beta", state=D.DEGRADED)
    fleet = make.fleet(make.domain("alpha"), beta, active="alpha")
    change = domain_change_on_heartbeat(fleet, beta, make.status(models={"m-0": True}))
    assert change == DomainChange(
        D.DEGRADED,
        D.READY,
        None,
        HeartbeatVerdict(role="standby", reachable=True, supervisor_ready=False),
    )


def test_domain_change_is_hashable_and_frozen(make: FleetFactory) -> None:
    change = DomainChange(D.READY, D.DEGRADED)
    assert change.detail == HeartbeatVerdict()
    verdict = HeartbeatVerdict(role="active")
    assert hash(change) == hash(DomainChange(D.READY, D.DEGRADED, None, verdict))
    with pytest.raises(AttributeError):
        change.to_state = D.FAILED  # type: ignore[misc]


# ---- a sleep or wake in progress is "busy", never a failure ----


def _busy_status(**models: tuple[bool | None, str | None]) -> SupervisorStatus:
    """Models on GPU 0 as (sleeping, action): action "sleep"/"wake" = the supervisor's own."""
    return SupervisorStatus(
        ready=False,
        slots=(
            SlotStatus(
                gpu_index=0,
                kind=SlotKind.INFERENCE,
                models=tuple(
                    ModelStatus.model_validate(
                        {"name": name, "port": 9000 + i, "sleeping": sleeping, "action": action}
                    )
                    for i, (name, (sleeping, action)) in enumerate(models.items())
                ),
            ),
        ),
    )


def test_models_busy_lists_models_in_a_sleep_or_wake() -> None:
    status = _busy_status(a=(None, "wake"), b=(None, None), c=(True, None), d=(None, "sleep"))
    assert models_busy(status) == {"a", "d"}
    assert model_sleep_states(status) == {"a": None, "b": None, "c": True, "d": None}


@pytest.mark.parametrize("role", ["active", "standby"])
@pytest.mark.parametrize("action", ["sleep", "wake"])
def test_a_busy_model_fails_no_slot_and_degrades_no_domain(
    make: FleetFactory, role: str, action: str
) -> None:
    state = I.SERVING if role == "active" else I.SLEEPING
    beta = make.domain("beta", state=D.READY, slots=[make.inference(0, "a", "b", state=state)])
    fleet = make.fleet(make.domain("alpha"), beta, active="beta" if role == "active" else "alpha")
    settled = role != "active"  # the standby's models are asleep, the active's awake
    busy = _busy_status(a=(settled, None), b=(None, action))
    assert slot_health_changes(fleet, beta, busy) == ()
    assert domain_change_on_heartbeat(fleet, beta, busy) is None
    # The same null without the action is a server that proved nothing: a failure.
    down = _busy_status(a=(settled, None), b=(None, None))
    assert [c.to_state for c in slot_health_changes(fleet, beta, down)] == [I.FAILED]
    change = domain_change_on_heartbeat(fleet, beta, down)
    if role == "active":
        assert change is not None
        assert change.to_state is D.DEGRADED
    else:
        assert change is None


def test_a_busy_model_does_not_hide_another_model_down(make: FleetFactory) -> None:
    alpha = make.domain("alpha", state=D.READY, slots=[make.inference(0, "a", "b")])
    fleet = make.fleet(alpha, active="alpha")
    status = _busy_status(a=(None, None), b=(None, "wake"))
    change = domain_change_on_heartbeat(fleet, alpha, status)
    assert change is not None
    assert change.to_state is D.DEGRADED
    assert change.detail.models_not_awake == ("a", "b")
