"""Haru's pure decision logic: no I/O, no clock reads (time is always an argument)."""

from haru_core._errors import HaruCoreError, InvalidTransitionError
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

__all__ = (
    # State tables (SPEC 4)
    "DOMAIN_TRANSITIONS",
    "INFERENCE_TRANSITIONS",
    "PROMOTABLE_DOMAIN_STATES",
    "ROUTABLE_DOMAIN_STATES",
    "TRAINING_TRANSITIONS",
    # Errors
    "HaruCoreError",
    "InvalidTransitionError",
    "Machine",
    "assert_transition",
    "can_transition",
    "is_valid_state",
    "machine_for",
    "states_with_edge_to",
    "valid_states",
)
