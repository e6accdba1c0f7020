"""Errors of haru-server.

Hierarchy::

    HaruServerError
    ├── SettingsError(ValueError)        (_settings: the environment holds an unusable value)
    ├── FleetNotFoundError               (a fleet reference matches no fleet)
    ├── ClockSkewedError                 (this host's clock is off the database's: no tick)
    └── SchemaNewerError                 (a newer release migrated the store: no tick)

A failed call to a supervisor raises ``haru_supervisor_client.SupervisorCallError``; it is never
fatal to a reconcile tick: the step that made the call turns it into a pending, failed or
best-effort result.
"""

from __future__ import annotations


class HaruServerError(Exception):
    """Root of haru-server's exceptions."""


class FleetNotFoundError(HaruServerError):
    """No fleet has this id or slug."""

    def __init__(self, ref: str) -> None:
        super().__init__(f"fleet {ref!r} not found")
        self.ref = ref


class ClockSkewedError(HaruServerError):
    """This process must not reconcile: its clock is off the database's, or not compared yet."""


class SchemaNewerError(HaruServerError):
    """This process must not reconcile: a newer release migrated the store under it."""
