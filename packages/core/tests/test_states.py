"""The state tables of DESIGN 4, checked pair by pair against an independent transcription."""

from __future__ import annotations

import itertools

import pytest
from haru_core import (
    DOMAIN_TRANSITIONS,
    INFERENCE_TRANSITIONS,
    PROMOTABLE_DOMAIN_STATES,
    ROUTABLE_DOMAIN_STATES,
    TRAINING_TRANSITIONS,
    HaruCoreError,
    InvalidTransitionError,
    Machine,
    assert_transition,
    can_transition,
    is_valid_state,
    machine_for,
    states_with_edge_to,
    valid_states,
)
from haru_protocol import DomainState, InferenceSlotState, SlotKind, TrainingSlotState

# Transcribed by hand from DESIGN 4 (not derived from the code under test).
EXPECTED_TABLES: dict[Machine, dict[str, set[str]]] = {
    "domain": {
        "provisioning": {"ready", "degraded", "failed", "stopping"},
        "ready": {"degraded", "failed", "stopping"},
        "degraded": {"ready", "failed", "stopping"},
        "failed": {"provisioning", "degraded", "stopping"},
        "stopping": {"stopped"},
        "stopped": {"provisioning"},
    },
    "inference": {
        "starting": {"serving", "sleeping", "failed", "stopped"},
        "serving": {"sleeping", "failed", "stopped"},
        "sleeping": {"waking", "failed", "stopped"},
        "waking": {"probing", "sleeping", "failed", "stopped"},
        "probing": {"serving", "sleeping", "failed", "stopped"},
        "failed": {"serving", "sleeping", "waking", "starting", "stopped"},
        "stopped": {"starting"},
    },
    "training": {
        "idle": {"training", "failed", "stopped"},
        "training": {"stopping", "idle", "failed", "stopped"},
        "stopping": {"idle", "training", "failed", "stopped"},
        "failed": {"idle", "stopped"},
        "stopped": {"idle"},
    },
}

MACHINES: tuple[Machine, ...] = ("domain", "inference", "training")

# Every state of every machine plus strings that belong to none: a state of the wrong kind
# (e.g. the training state "idle" on the inference table) must never transition.
ALL_STATES = sorted(
    {s for table in EXPECTED_TABLES.values() for s in table} | {"", "READY", "unknown", "Serving"}
)

ALL_PAIRS = [
    pytest.param(machine, from_state, to_state, id=f"{machine}:{from_state}->{to_state}")
    for machine in MACHINES
    for from_state, to_state in itertools.product(ALL_STATES, ALL_STATES)
]


def spec_allows(machine: Machine, from_state: str, to_state: str) -> bool:
    return to_state in EXPECTED_TABLES[machine].get(from_state, set())


@pytest.mark.parametrize(("machine", "from_state", "to_state"), ALL_PAIRS)
def test_every_pair_matches_spec(machine: Machine, from_state: str, to_state: str) -> None:
    expected = spec_allows(machine, from_state, to_state)
    assert can_transition(machine, from_state, to_state) is expected
    if expected:
        assert_transition(machine, from_state, to_state)
    else:
        with pytest.raises(InvalidTransitionError) as info:
            assert_transition(machine, from_state, to_state)
        assert info.value.machine == machine
        assert info.value.from_state == from_state
        assert info.value.to_state == to_state
        assert repr(from_state) in str(info.value)
        assert repr(to_state) in str(info.value)


def test_pair_count_covers_every_table() -> None:
    allowed = sum(
        spec_allows(m, f, t) for m in MACHINES for f, t in itertools.product(ALL_STATES, ALL_STATES)
    )
    assert allowed == sum(len(v) for table in EXPECTED_TABLES.values() for v in table.values())
    assert allowed == 15 + 24 + 14


@pytest.mark.parametrize("machine", MACHINES)
def test_no_self_transitions(machine: Machine) -> None:
    for state in valid_states(machine):
        assert not can_transition(machine, state, state)


@pytest.mark.parametrize(
    ("machine", "to_state"),
    [
        pytest.param(m, t, id=f"{m}:{t}")
        for m in MACHINES
        for t in [*sorted(EXPECTED_TABLES[m]), "unknown", "idle", "serving"]
    ],
)
def test_states_with_edge_to_every_target(machine: Machine, to_state: str) -> None:
    expected = {f for f, targets in EXPECTED_TABLES[machine].items() if to_state in targets}
    assert states_with_edge_to(machine, to_state) == expected


def test_states_with_edge_to_known_cas_lists() -> None:
    assert states_with_edge_to("inference", "sleeping") == {
        "starting",
        "serving",
        "waking",
        "probing",
        "failed",
    }
    assert states_with_edge_to("domain", "ready") == {"provisioning", "degraded"}
    assert states_with_edge_to("training", "idle") == {"training", "stopping", "failed", "stopped"}
    assert states_with_edge_to("domain", "idle") == frozenset()


@pytest.mark.parametrize("machine", MACHINES)
def test_valid_states_and_wrong_kind(machine: Machine) -> None:
    assert valid_states(machine) == set(EXPECTED_TABLES[machine])
    for state in ALL_STATES:
        assert is_valid_state(machine, state) is (state in EXPECTED_TABLES[machine])


def test_wrong_kind_states_never_transition() -> None:
    # "stopping" is a training state and a domain state but never an inference state.
    assert not is_valid_state("inference", "stopping")
    assert not can_transition("inference", "stopping", "stopped")
    assert not can_transition("training", "serving", "failed")
    assert not can_transition("domain", "idle", "failed")
    with pytest.raises(InvalidTransitionError):
        assert_transition("training", "sleeping", "failed")


def test_enum_tables_equal_spec() -> None:
    def as_str(table: object) -> dict[str, set[str]]:
        assert isinstance(table, dict)
        return {k.value: {v.value for v in vs} for k, vs in table.items()}

    assert as_str(DOMAIN_TRANSITIONS) == EXPECTED_TABLES["domain"]
    assert as_str(INFERENCE_TRANSITIONS) == EXPECTED_TABLES["inference"]
    assert as_str(TRAINING_TRANSITIONS) == EXPECTED_TABLES["training"]
    assert set(DOMAIN_TRANSITIONS) == set(DomainState)
    assert set(INFERENCE_TRANSITIONS) == set(InferenceSlotState)
    assert set(TRAINING_TRANSITIONS) == set(TrainingSlotState)


def test_enum_members_are_accepted_like_strings() -> None:
    assert can_transition("domain", DomainState.READY, DomainState.DEGRADED)
    assert not can_transition("inference", InferenceSlotState.SERVING, TrainingSlotState.IDLE)


def test_promotable_and_routable_states() -> None:
    assert {DomainState.READY, DomainState.DEGRADED} == PROMOTABLE_DOMAIN_STATES
    assert {DomainState.READY, DomainState.DEGRADED} == ROUTABLE_DOMAIN_STATES


def test_machine_for_kind() -> None:
    assert machine_for(SlotKind.INFERENCE) == "inference"
    assert machine_for(SlotKind.TRAINING) == "training"


def test_error_hierarchy() -> None:
    assert issubclass(InvalidTransitionError, HaruCoreError)
    assert issubclass(HaruCoreError, Exception)
