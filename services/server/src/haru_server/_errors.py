"""Errors of haru-server.

Hierarchy::

    HaruServerError
    ├── SettingsError(ValueError)        (_settings: the environment holds an unusable value)
    ├── FleetNotFoundError               (a fleet reference matches no fleet)
    ├── RoutingUnavailableError          (_route_cache: no routing can be served safely now)
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


class RoutingUnavailableError(HaruServerError):
    """The route cache cannot serve a fleet's routing safely now (the proxy answers 503).

    Attributes:
        retry_soon: The cause passes in seconds (an outage, a move in flight), so the client is
            told when to retry; False for stored state that fails validation.
    """

    def __init__(self, message: str, *, retry_soon: bool) -> None:
        super().__init__(message)
        self.retry_soon = retry_soon


class ClockSkewedError(HaruServerError):
    """This process must not reconcile: its clock is off the database's, or not compared yet."""


class SchemaNewerError(HaruServerError):
    """This process must not reconcile: a newer release migrated the store under it."""
