"""The state tables of DESIGN 4: the single source of truth for every state change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from haru_protocol import DomainState, InferenceSlotState, SlotKind, TrainingSlotState

from haru_core._errors import InvalidTransitionError

Machine = Literal["domain", "inference", "training"]
"""Which state table: the domain's, or a slot's by kind."""

_D = DomainState
_I = InferenceSlotState
_T = TrainingSlotState

DOMAIN_TRANSITIONS: Mapping[DomainState, frozenset[DomainState]] = {
    _D.PROVISIONING: frozenset({_D.READY, _D.DEGRADED, _D.FAILED, _D.STOPPING}),
    _D.READY: frozenset({_D.DEGRADED, _D.FAILED, _D.STOPPING}),
    _D.DEGRADED: frozenset({_D.READY, _D.FAILED, _D.STOPPING}),
    _D.FAILED: frozenset({_D.PROVISIONING, _D.DEGRADED, _D.STOPPING}),
    _D.STOPPING: frozenset({_D.STOPPED}),
    _D.STOPPED: frozenset({_D.PROVISIONING}),
}

INFERENCE_TRANSITIONS: Mapping[InferenceSlotState, frozenset[InferenceSlotState]] = {
    _I.STARTING: frozenset({_I.SERVING, _I.SLEEPING, _I.FAILED, _I.STOPPED}),
    _I.SERVING: frozenset({_I.SLEEPING, _I.FAILED, _I.STOPPED}),
    _I.SLEEPING: frozenset({_I.WAKING, _I.FAILED, _I.STOPPED}),
    _I.WAKING: frozenset({_I.PROBING, _I.SLEEPING, _I.FAILED, _I.STOPPED}),
    _I.PROBING: frozenset({_I.SERVING, _I.SLEEPING, _I.FAILED, _I.STOPPED}),
    _I.FAILED: frozenset({_I.SERVING, _I.SLEEPING, _I.WAKING, _I.STARTING, _I.STOPPED}),
    _I.STOPPED: frozenset({_I.STARTING}),
}

TRAINING_TRANSITIONS: Mapping[TrainingSlotState, frozenset[TrainingSlotState]] = {
    _T.IDLE: frozenset({_T.TRAINING, _T.FAILED, _T.STOPPED}),
    _T.TRAINING: frozenset({_T.STOPPING, _T.IDLE, _T.FAILED, _T.STOPPED}),
    _T.STOPPING: frozenset({_T.IDLE, _T.TRAINING, _T.FAILED, _T.STOPPED}),
    _T.FAILED: frozenset({_T.IDLE, _T.STOPPED}),
    _T.STOPPED: frozenset({_T.IDLE}),
}

_TABLES: Mapping[Machine, Mapping[str, frozenset[str]]] = {
    "domain": {k.value: frozenset(v.value for v in vs) for k, vs in DOMAIN_TRANSITIONS.items()},
    "inference": {
        k.value: frozenset(v.value for v in vs) for k, vs in INFERENCE_TRANSITIONS.items()
    },
    "training": {k.value: frozenset(v.value for v in vs) for k, vs in TRAINING_TRANSITIONS.items()},
}

PROMOTABLE_DOMAIN_STATES: frozenset[DomainState] = frozenset({_D.READY, _D.DEGRADED})
"""A domain in one of these states may be promoted or demoted."""

ROUTABLE_DOMAIN_STATES: frozenset[DomainState] = frozenset({_D.READY, _D.DEGRADED})
"""A domain in one of these states may receive traffic."""


def machine_for(kind: SlotKind) -> Machine:
    """The state table of a slot kind."""
    return "inference" if kind is SlotKind.INFERENCE else "training"


def valid_states(machine: Machine) -> frozenset[str]:
    """Every state of ``machine``."""
    return frozenset(_TABLES[machine])


def is_valid_state(machine: Machine, state: str) -> bool:
    """Whether ``state`` belongs to ``machine`` (a training state is invalid for inference)."""
    return state in _TABLES[machine]


def can_transition(machine: Machine, from_state: str, to_state: str) -> bool:
    """Whether the table of ``machine`` allows ``from_state -> to_state``.

    A state that does not belong to the machine never transitions.
    """
    return to_state in _TABLES[machine].get(from_state, frozenset())


def assert_transition(machine: Machine, from_state: str, to_state: str) -> None:
    """Raise :class:`InvalidTransitionError` unless the pair is allowed."""
    if not can_transition(machine, from_state, to_state):
        raise InvalidTransitionError(machine, from_state, to_state)


def states_with_edge_to(machine: Machine, to_state: str) -> frozenset[str]:
    """Every state of ``machine`` that may move to ``to_state`` (a CAS from-list)."""
    return frozenset(s for s, targets in _TABLES[machine].items() if to_state in targets)
