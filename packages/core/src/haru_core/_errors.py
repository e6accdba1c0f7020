"""Errors of haru-core.

Hierarchy::

    HaruCoreError
    └── InvalidTransitionError   (a (from, to) pair the state tables forbid)
"""

from __future__ import annotations


class HaruCoreError(Exception):
    """Root of haru-core's exceptions."""


class InvalidTransitionError(HaruCoreError):
    """A state change the state tables of DESIGN 4 forbid."""

    def __init__(self, machine: str, from_state: str, to_state: str) -> None:
        super().__init__(f"{machine} transition {from_state!r} -> {to_state!r} is not allowed")
        self.machine = machine
        self.from_state = from_state
        self.to_state = to_state
