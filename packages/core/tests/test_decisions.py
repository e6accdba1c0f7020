"""Bindings helpers and the promote/demote decisions of DESIGN 7.2."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest
from haru_core import (
    AlreadyActive,
    CreateOperation,
    InvalidTarget,
    TargetProblem,
    decide_demotion,
    decide_promotion,
    domain_role,
    has_inference_bindings,
    inference_bindings,
    inference_slots,
    is_active,
    slot_bindings,
    training_slots,
)
from haru_protocol import DomainState, OperationKind, SlotKind

if TYPE_CHECKING:
    from conftest import FleetFactory

NON_PROMOTABLE = [
    DomainState.PROVISIONING,
    DomainState.FAILED,
    DomainState.STOPPING,
    DomainState.STOPPED,
]


def test_bindings_of_a_domain(make: FleetFactory) -> None:
    domain = make.domain(
        "alpha",
        slots=[
            make.training(0),
            make.inference(0, "small", "medium"),
            make.inference(1, "large"),
            make.training(1),
        ],
    )
    assert [b.name for b in inference_bindings(domain)] == ["small", "medium", "large"]
    assert has_inference_bindings(domain)
    assert [(s.kind, s.gpu_index) for s in inference_slots(domain)] == [
        (SlotKind.INFERENCE, 0),
        (SlotKind.INFERENCE, 1),
    ]
    assert [(s.kind, s.gpu_index) for s in training_slots(domain)] == [
        (SlotKind.TRAINING, 0),
        (SlotKind.TRAINING, 1),
    ]
    assert slot_bindings(training_slots(domain)[0]) == ()
    assert [b.name for b in slot_bindings(inference_slots(domain)[1])] == ["large"]


def test_training_only_domain_has_no_bindings(make: FleetFactory) -> None:
    domain = make.domain("alpha", slots=[make.training(0)])
    assert inference_bindings(domain) == ()
    assert not has_inference_bindings(domain)
    assert inference_slots(domain) == ()


def test_is_active(make: FleetFactory) -> None:
    alpha, beta = make.domain("alpha"), make.domain("beta")
    fleet = make.fleet(alpha, beta, active="alpha")
    assert is_active(fleet, alpha)
    assert not is_active(fleet, beta)
    no_pointer = make.fleet(alpha, beta)
    assert not is_active(no_pointer, alpha)
    assert not is_active(no_pointer, beta)
    assert (domain_role(fleet, alpha), domain_role(fleet, beta)) == ("active", "standby")
    assert domain_role(no_pointer, alpha) == "standby"


# ---- promotion ----


def test_promote_already_active(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"), active="alpha", route_revision=7)
    assert decide_promotion(fleet, make.domain_id("alpha")) == AlreadyActive(route_revision=7)


def test_promote_already_active_wins_over_state(make: FleetFactory) -> None:
    # Promoting the active is a no-op even when it is failed: routing already points there.
    fleet = make.fleet(make.domain("alpha", state=DomainState.FAILED), active="alpha")
    assert decide_promotion(fleet, make.domain_id("alpha")) == AlreadyActive(route_revision=1)


def test_promote_not_in_fleet(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), active="alpha")
    stranger = uuid.uuid4()
    decision = decide_promotion(fleet, stranger)
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NOT_IN_FLEET
    assert str(stranger) in decision.message


@pytest.mark.parametrize("state", NON_PROMOTABLE)
def test_promote_non_promotable_state(make: FleetFactory, state: DomainState) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta", state=state), active="alpha")
    decision = decide_promotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NOT_PROMOTABLE
    assert state.value in decision.message
    assert "'beta'" in decision.message


def test_promote_without_inference_bindings(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha"), make.domain("beta", slots=[make.training(0)]), active="alpha"
    )
    decision = decide_promotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NO_INFERENCE_BINDINGS


def test_promote_without_supervisor(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta", supervisor=False), active="alpha")
    decision = decide_promotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NO_SUPERVISOR
    assert "supervisor" in decision.message


@pytest.mark.parametrize("state", [DomainState.READY, DomainState.DEGRADED])
def test_promote_creates(make: FleetFactory, state: DomainState) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta", state=state), active="alpha")
    assert decide_promotion(fleet, make.domain_id("beta")) == CreateOperation(
        kind=OperationKind.PROMOTE, target_domain_id=make.domain_id("beta")
    )


def test_promote_without_any_active(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"))
    decision = decide_promotion(fleet, make.domain_id("alpha"))
    assert decision == CreateOperation(OperationKind.PROMOTE, make.domain_id("alpha"))


def test_promote_state_checked_before_bindings(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("beta", state=DomainState.FAILED, slots=[make.training(0)], supervisor=False)
    )
    decision = decide_promotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NOT_PROMOTABLE


# ---- demotion ----


def test_demote_active_is_refused(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"), active="alpha")
    decision = decide_demotion(fleet, make.domain_id("alpha"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.TARGET_IS_ACTIVE
    assert "active" in decision.message


def test_demote_not_in_fleet(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), active="alpha")
    decision = decide_demotion(fleet, uuid.uuid4())
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NOT_IN_FLEET


@pytest.mark.parametrize("state", NON_PROMOTABLE)
def test_demote_non_demotable_state(make: FleetFactory, state: DomainState) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta", state=state), active="alpha")
    decision = decide_demotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NOT_PROMOTABLE
    assert state.value in decision.message


def test_demote_without_inference_bindings(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha"), make.domain("beta", slots=[make.training(0)]), active="alpha"
    )
    decision = decide_demotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NO_INFERENCE_BINDINGS


def test_demote_without_supervisor(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta", supervisor=False), active="alpha")
    decision = decide_demotion(fleet, make.domain_id("beta"))
    assert isinstance(decision, InvalidTarget)
    assert decision.problem is TargetProblem.NO_SUPERVISOR


@pytest.mark.parametrize("state", [DomainState.READY, DomainState.DEGRADED])
def test_demote_creates(make: FleetFactory, state: DomainState) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta", state=state), active="alpha")
    assert decide_demotion(fleet, make.domain_id("beta")) == CreateOperation(
        kind=OperationKind.DEMOTE, target_domain_id=make.domain_id("beta")
    )


def test_decisions_are_frozen(make: FleetFactory) -> None:
    decision = decide_promotion(make.fleet(make.domain("alpha")), make.domain_id("alpha"))
    assert isinstance(decision, CreateOperation)
    with pytest.raises(AttributeError):
        decision.kind = OperationKind.DEMOTE  # type: ignore[misc]
