"""The promote-failure cleanup rule: what failing a promote does to its target's slots.

This table is the rule's one source in Python: :func:`haru_db._postgres.fail_with_cleanup`
builds PostgreSQL's statement from it, and a test proves that the SQLite trigger
``trg_operations_promote_failed_cleanup`` (frozen in migration 0001) spells the same state
lists and that haru-core's transition tables allow every change.
"""

from __future__ import annotations

from dataclasses import dataclass

from haru_core import Machine, assert_transition
from haru_protocol import InferenceSlotState, TrainingSlotState

_I = InferenceSlotState
_T = TrainingSlotState


@dataclass(frozen=True, slots=True)
class PromoteFailCleanup:
    """Slot changes applied to a failed promote's target in the failing statement."""

    inference_failed_from: tuple[str, ...]
    """Inference states that always become :attr:`inference_to` (the wake path)."""
    inference_failed_unless_routed: tuple[str, ...]
    """Inference states that become :attr:`inference_to` unless the pointer is at the target."""
    inference_to: str
    training_resumed_from: tuple[str, ...]
    """Training states that return to :attr:`training_to` (trainers asked to stop)."""
    training_to: str

    def changes(self) -> tuple[tuple[Machine, str, str], ...]:
        """Every (machine, from, to) change the rule may make."""
        inference = self.inference_failed_from + self.inference_failed_unless_routed
        return tuple(("inference", s, self.inference_to) for s in inference) + tuple(
            ("training", s, self.training_to) for s in self.training_resumed_from
        )

    def check(self) -> None:
        """Assert haru-core's tables allow every change.

        Raises:
            haru_core.InvalidTransitionError: A change the tables forbid.
        """
        for machine, from_state, to_state in self.changes():
            assert_transition(machine, from_state, to_state)


PROMOTE_FAIL_CLEANUP = PromoteFailCleanup(
    inference_failed_from=(_I.WAKING.value, _I.PROBING.value),
    inference_failed_unless_routed=(_I.SERVING.value,),
    inference_to=_I.FAILED.value,
    training_resumed_from=(_T.STOPPING.value,),
    training_to=_T.TRAINING.value,
)
"""The rule of DESIGN 7.3 (failed promote): fail the wake path, give trainers back their GPUs."""
