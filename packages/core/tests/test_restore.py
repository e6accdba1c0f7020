"""Standby posture: which standby gets a restore demote, and how those demotes back off."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from haru_core import (
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
from haru_protocol import (
    DomainState,
    FleetSnapshot,
    InferenceSlotState,
    ModelStatus,
    Operation,
    OperationKind,
    OperationState,
    Policy,
    Provider,
    SlotKind,
    SlotStatus,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotState,
    TrainingStatus,
)

if TYPE_CHECKING:
    from datetime import datetime

    from conftest import FleetFactory, SlotDraft

POLICY = Policy(promotion_backoff_base_ms=1_000, promotion_backoff_max_ms=10_000)
SLEEPING = InferenceSlotState.SLEEPING
IDLE = TrainingSlotState.IDLE
TRAINING = TrainingSlotState.TRAINING
D = OperationKind.DEMOTE
P = OperationKind.PROMOTE
S = OperationState.SUCCEEDED
F = OperationState.FAILED


def standby_slots(
    make: FleetFactory,
    *,
    inference: InferenceSlotState = SLEEPING,
    training: TrainingSlotState | None = IDLE,
) -> list[SlotDraft]:
    drafts = [make.inference(0, state=inference)]
    if training is not None:
        drafts.append(make.training(0, state=training))
    return drafts


def two_domains(
    make: FleetFactory,
    *,
    slots: list[SlotDraft] | None = None,
    state: DomainState = DomainState.READY,
    supervisor: bool = True,
) -> FleetSnapshot:
    beta_slots = standby_slots(make) if slots is None else slots
    beta = make.domain("beta", slots=beta_slots, state=state, supervisor=supervisor)
    alpha = make.domain("alpha", slots=[make.inference(0), make.training(0)])
    return make.fleet(alpha, beta, active="alpha", policy=POLICY)


def op(
    make: FleetFactory,
    seconds: float,
    state: OperationState,
    *,
    kind: OperationKind = D,
    target: str = "beta",
) -> Operation:
    at: datetime = make.now + timedelta(seconds=seconds)
    running = state in (OperationState.PENDING, OperationState.RUNNING)
    return Operation(
        id=uuid.uuid4(),
        fleet_id=make.fleet_id,
        kind=kind,
        state=state,
        target_domain_id=make.domain_id(target),
        current_step=None,
        step_started_at=None,
        error=None,
        created_at=at - timedelta(seconds=1),
        finished_at=None if running else at,
    )


def test_standby_asleep_with_idle_training_is_out_of_posture(make: FleetFactory) -> None:
    fleet = two_domains(make)
    beta = fleet.domain(make.domain_id("beta"))
    assert beta is not None
    assert is_out_of_posture(fleet, beta)
    assert [d.slug for d in restore_candidates(fleet)] == ["beta"]
    demoted = op(make, -3_600, S)  # its operator demoted it an hour ago
    assert detect_restore(fleet, (demoted,), now=make.now) == RestoreDecision(
        target_domain_id=beta.id, reason=RESTORE_REASON_TRAINING_IDLE
    )


def test_a_standby_never_demoted_is_left_to_the_operator(make: FleetFactory) -> None:
    # A fresh fleet's standby: training slots start idle, no operation ever started them.
    fleet = two_domains(make)
    assert detect_restore(fleet, (), now=make.now) is None
    assert detect_restore(fleet, (op(make, -60, S, target="alpha"),), now=make.now) is None


def test_a_standby_haru_launched_gets_its_first_demote(make: FleetFactory) -> None:
    # A provisioned standby: its launch put vLLM to sleep, nothing started its training yet.
    fleet = two_domains(make)
    beta = fleet.domain(make.domain_id("beta"))
    assert beta is not None
    assert not launched_as_standby(beta)
    launched = beta.model_copy(
        update={"provider": Provider.SKYPILOT, "launch_attempt": 1, "launched_at": make.now}
    )
    assert launched_as_standby(launched)
    provisioned = fleet.model_copy(
        update={"domains": tuple(launched if d.id == beta.id else d for d in fleet.domains)}
    )
    assert detect_restore(provisioned, (), now=make.now) == RestoreDecision(
        target_domain_id=beta.id, reason=RESTORE_REASON_TRAINING_IDLE
    )
    # Not before its launch went through (a claim alone proves nothing ran).
    claimed = launched.model_copy(update={"launched_at": None})
    pending = fleet.model_copy(
        update={"domains": tuple(claimed if d.id == beta.id else d for d in fleet.domains)}
    )
    assert detect_restore(pending, (), now=make.now) is None


def source_promote(
    make: FleetFactory, seconds: float, state: OperationState, *, source: str, target: str
) -> Operation:
    promote = op(make, seconds, state, kind=P, target=target)
    return promote.model_copy(update={"source_domain_id": make.domain_id(source)})


@pytest.mark.parametrize(
    ("history", "reached"),
    [
        ((), False),
        ((("demote", S),), True),
        ((("demote", F),), True),  # a failed restore is retried (after its backoff)
        ((("promote-from", S),), True),  # promoted away from: the tail demoted it
        ((("promote-from", F),), False),
        ((("demote", S), ("promote-of", S)), False),  # then it became the active
        # Its failure queues its own restore, refused while it is not demotable: owed one.
        ((("demote", S), ("promote-of", F)), True),
        ((("promote-of", S), ("promote-from", S)), True),
        ((("demote", S), ("other", S)), True),  # other domains' operations do not matter
    ],
)
def test_reached_standby_posture(
    make: FleetFactory, history: tuple[tuple[str, OperationState], ...], reached: bool
) -> None:
    ops = []
    for i, (what, state) in enumerate(history):
        at = -100.0 + 10 * i
        if what == "demote":
            ops.append(op(make, at, state))
        elif what == "promote-of":
            ops.append(source_promote(make, at, state, source="alpha", target="beta"))
        elif what == "promote-from":
            ops.append(source_promote(make, at, state, source="beta", target="alpha"))
        else:
            ops.append(op(make, at, state, target="alpha"))
    ops.append(op(make, 0, OperationState.RUNNING))  # an in-flight one never counts
    assert reached_standby_posture(make.domain_id("beta"), reversed(ops)) is reached


def test_the_active_is_never_a_candidate(make: FleetFactory) -> None:
    # The active's training is idle by design, even with its inference slot (wrongly) asleep.
    alpha = make.domain("alpha", slots=standby_slots(make))
    fleet = make.fleet(alpha, active="alpha", policy=POLICY)
    assert restore_candidates(fleet) == ()


@pytest.mark.parametrize(
    ("state", "supervisor"),
    [
        (DomainState.PROVISIONING, True),
        (DomainState.DEGRADED, True),
        (DomainState.FAILED, True),
        (DomainState.READY, False),
    ],
)
def test_only_a_ready_drivable_standby_counts(
    make: FleetFactory, state: DomainState, supervisor: bool
) -> None:
    fleet = two_domains(make, state=state, supervisor=supervisor)
    assert restore_candidates(fleet) == ()
    assert detect_restore(fleet, (), now=make.now) is None


def test_auth_failing_standby_is_not_a_candidate(make: FleetFactory) -> None:
    fleet = two_domains(make)
    domains = tuple(d.model_copy(update={"auth_failing": d.slug == "beta"}) for d in fleet.domains)
    assert restore_candidates(fleet.model_copy(update={"domains": domains})) == ()


@pytest.mark.parametrize(
    ("inference", "training"),
    [
        (SLEEPING, TRAINING),  # in posture
        (SLEEPING, TrainingSlotState.STOPPING),  # an operation's business
        (SLEEPING, TrainingSlotState.FAILED),
        (SLEEPING, None),  # no training slot: nothing to restart
        (InferenceSlotState.FAILED, IDLE),  # a heartbeat / failover matter first
        (InferenceSlotState.SERVING, IDLE),
        (InferenceSlotState.WAKING, IDLE),
    ],
)
def test_slot_states_that_are_not_a_lost_training(
    make: FleetFactory, inference: InferenceSlotState, training: TrainingSlotState | None
) -> None:
    fleet = two_domains(make, slots=standby_slots(make, inference=inference, training=training))
    assert restore_candidates(fleet) == ()


def test_backoff_none_without_a_finished_demote(make: FleetFactory) -> None:
    target = make.domain_id("beta")
    assert restore_backoff(POLICY, target, ()) is None
    # The newest finished operation of the target is a promote: the chain is empty.
    ops = (
        op(make, -40, S),
        op(make, -30, S),
        op(make, -20, S, kind=P),
        op(make, -1, OperationState.RUNNING),
    )
    assert restore_backoff(POLICY, target, ops) is None
    # Other targets' demotes do not count.
    alpha_ops = (op(make, -2, S, target="alpha"), op(make, -1, S, target="alpha"))
    assert restore_backoff(POLICY, target, alpha_ops) is None


@pytest.mark.parametrize(
    ("states", "delay_ms"),
    [
        ((S,), None),  # the demote that put it in posture: the first restore waits nothing
        ((F,), None),
        ((S, S), 1_000),
        ((S, F), 1_000),
        ((S, F, S), 2_000),
        ((F, S, F, S, F), 8_000),
        ((S,) * 9, 10_000),
    ],
)
def test_backoff_doubles_with_consecutive_restores(
    make: FleetFactory, states: tuple[OperationState, ...], delay_ms: int | None
) -> None:
    target = make.domain_id("beta")
    # A promote of the target long before, then the demotes; the newest ends at now - 0.5 s.
    ops = [op(make, -1_000, S, kind=P)]
    ops += [op(make, -0.5 - (len(states) - i - 1) * 5, st) for i, st in enumerate(states)]
    backoff = restore_backoff(POLICY, target, reversed(ops))
    if delay_ms is None:
        assert backoff is None
        return
    assert backoff is not None
    assert backoff.consecutive_failures == len(states) - 1
    assert backoff.delay_ms == delay_ms
    assert backoff.until == make.now - timedelta(seconds=0.5) + timedelta(milliseconds=delay_ms)


def test_detect_waits_for_the_backoff(make: FleetFactory) -> None:
    fleet = two_domains(make)
    # Demoted by its operator, then one restore that ended 0.5 s ago: wait 1 s after it.
    ops = (op(make, -60, S), op(make, -0.5, S))
    assert detect_restore(fleet, ops, now=make.now) is None
    later = make.now + timedelta(milliseconds=500)
    assert detect_restore(fleet, ops, now=later) is not None
    # The first loss after the demote that put it in posture is restored at once.
    assert detect_restore(fleet, (op(make, -0.1, S),), now=make.now) is not None


def test_detect_skips_a_target_backing_off_for_another(make: FleetFactory) -> None:
    alpha = make.domain("alpha", slots=[make.inference(0), make.training(0)])
    beta = make.domain("beta", slots=standby_slots(make))
    gamma = make.domain("gamma", slots=standby_slots(make))
    fleet = make.fleet(alpha, beta, gamma, active="alpha", policy=POLICY)
    beta_ops = (op(make, -60, S, target="beta"), op(make, -0.1, F, target="beta"))
    ops = (*beta_ops, op(make, -600, S, target="gamma"))
    decision = detect_restore(fleet, ops, now=make.now)
    assert decision is not None
    assert decision.target_domain_id == make.domain_id("gamma")


def test_detect_needs_an_aware_now(make: FleetFactory) -> None:
    with pytest.raises(ValueError, match="now"):
        detect_restore(two_domains(make), (), now=make.now.replace(tzinfo=None))


FAILED_SLOT = InferenceSlotState.FAILED


@pytest.mark.parametrize(
    ("inference", "training", "awake"),
    [
        ((FAILED_SLOT,), TRAINING, True),  # a bound model not reported asleep
        ((FAILED_SLOT,), IDLE, True),
        ((SLEEPING, FAILED_SLOT), TRAINING, True),
        ((SLEEPING,), TRAINING, False),  # in posture
        ((SLEEPING,), IDLE, False),  # training_idle's business
        ((FAILED_SLOT, InferenceSlotState.WAKING), TRAINING, False),  # an operation's
        ((InferenceSlotState.SERVING,), TRAINING, False),  # the next heartbeat's
    ],
)
def test_a_standby_that_may_be_awake(
    make: FleetFactory,
    inference: tuple[InferenceSlotState, ...],
    training: TrainingSlotState,
    awake: bool,
) -> None:
    slots = [make.inference(i, state=st) for i, st in enumerate(inference)]
    slots.append(make.training(0, state=training))
    fleet = two_domains(make, slots=slots)
    beta = fleet.domain(make.domain_id("beta"))
    assert beta is not None
    assert may_be_awake_standby(fleet, beta) is awake
    assert [d.slug for d in awake_standbys(fleet)] == (["beta"] if awake else [])


def test_an_awake_standby_is_owed_a_restore_after_a_promote_away(make: FleetFactory) -> None:
    fleet = two_domains(make, slots=standby_slots(make, inference=FAILED_SLOT, training=IDLE))
    beta = make.domain_id("beta")
    # A fresh fleet's standby: left to the operator.
    assert detect_restores(fleet, (), now=make.now) == ()
    # Promoted away from (its demote_old_sleep timed out; its restore was refused).
    away = source_promote(make, -5, S, source="beta", target="alpha")
    assert detect_restores(fleet, (away,), now=make.now) == (
        RestoreDecision(target_domain_id=beta, reason=RESTORE_REASON_VLLM_AWAKE),
    )
    # The promote away set its posture: the first restore is immediate, the next backs off.
    restored = op(make, -0.5, S)
    assert restore_backoff(POLICY, beta, (away, restored)) is not None
    assert detect_restores(fleet, (away, restored), now=make.now) == ()
    later = make.now + timedelta(seconds=0.5)
    assert detect_restores(fleet, (away, restored), now=later) != ()


def test_training_idle_candidates_come_first(make: FleetFactory) -> None:
    alpha = make.domain("alpha", slots=[make.inference(0), make.training(0)])
    beta = make.domain("beta", slots=standby_slots(make, inference=FAILED_SLOT, training=TRAINING))
    gamma = make.domain("gamma", slots=standby_slots(make))
    fleet = make.fleet(alpha, beta, gamma, active="alpha", policy=POLICY)
    ops = (op(make, -60, S, target="beta"), op(make, -60, S, target="gamma"))
    assert [(d.target_domain_id, d.reason) for d in detect_restores(fleet, ops, now=make.now)] == [
        (make.domain_id("gamma"), RESTORE_REASON_TRAINING_IDLE),
        (make.domain_id("beta"), RESTORE_REASON_VLLM_AWAKE),
    ]


def status_of(*models: bool | None, training: TrainingRunState | None = None) -> SupervisorStatus:
    slots = [
        SlotStatus(
            gpu_index=0,
            kind=SlotKind.INFERENCE,
            models=tuple(
                ModelStatus(name=f"m-{i}", port=8000 + i, sleeping=m) for i, m in enumerate(models)
            ),
        )
    ]
    if training is not None:
        slots.append(
            SlotStatus(gpu_index=0, kind=SlotKind.TRAINING, training=TrainingStatus(state=training))
        )
    return SupervisorStatus(slots=tuple(slots), ready=True)


@pytest.mark.parametrize(
    ("models", "confirmed"),
    [
        ((False,), True),
        ((True, False), True),
        ((True,), False),  # asleep: nothing to do
        ((None,), False),  # crashed or hung: a demote could not sleep it
        ((False, None), False),
        ((), False),
    ],
)
def test_restore_confirmed_vllm_awake(
    make: FleetFactory, models: tuple[bool | None, ...], confirmed: bool
) -> None:
    slot = make.inference(0, *(f"m-{i}" for i in range(max(len(models), 1))))
    beta = make.domain("beta", slots=[slot, make.training(0)])
    status = status_of(*models)
    assert restore_confirmed(beta, status, RESTORE_REASON_VLLM_AWAKE) is confirmed


def test_restore_confirmed_training_idle(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=standby_slots(make))
    idle = status_of(True, training=TrainingRunState.IDLE)
    running = status_of(True, training=TrainingRunState.RUNNING)
    assert restore_confirmed(beta, idle, RESTORE_REASON_TRAINING_IDLE)
    assert not restore_confirmed(beta, running, RESTORE_REASON_TRAINING_IDLE)
    assert not restore_confirmed(beta, idle, "something else")
