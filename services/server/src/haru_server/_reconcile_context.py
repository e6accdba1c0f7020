"""What every part of a reconcile tick works with: the store, the client, the clock, the tuning.

The tick (:mod:`haru_server._reconciler`) assembles three parts, each handed one
:class:`ReconcileContext` explicitly: the heartbeat round (:mod:`haru_server._heartbeat_round`),
the failover decisions (:mod:`haru_server._failover_decisions`) and the operation driver
(:mod:`haru_server._operation_driver`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from haru_db import StateStore
from haru_protocol import FleetSnapshot
from haru_supervisor_client import HEARTBEAT_TIMEOUT_S, SupervisorClient

from haru_server._clock import Clock
from haru_server._errors import FleetNotFoundError
from haru_server._metrics import ServerMetrics
from haru_server._steps import StepTuning

RECENT_OPERATIONS = 64
"""How many of a fleet's newest operations promotion backoff looks at."""

HEARTBEAT_ROUND_S = 2.0
"""How long a tick waits for the heartbeats it starts (each poll has its own bound too)."""


@dataclass(frozen=True, slots=True)
class ReconcilerOptions:
    """Tuning of the reconcile tick.

    Attributes:
        heartbeat_timeout_s: Bound of each heartbeat poll (about 5 s).
        heartbeat_round_s: How long a tick waits for the polls it started. A poll still
            running then (a hung supervisor) goes on in the background, up to its own bound;
            its domain is left unjudged until a later tick finds the poll done, and no tick
            waits for it, nor for the domain's next polls until one answers within a round.
            So a hung supervisor delays no other domain's heartbeat, and no failover
            decision, by more than this, once.
        chaining: Run the next step in the same tick after a step resolves done.
        chain_budget_s: Per-tick time bound of step chaining (wall clock).
        tuning: How long an executor keeps polling for its proof after acting.
    """

    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    heartbeat_round_s: float = HEARTBEAT_ROUND_S
    chaining: bool = True
    chain_budget_s: float = 10.0
    tuning: StepTuning = field(default_factory=StepTuning)


@dataclass(frozen=True, slots=True)
class ReconcileContext:
    """The long-lived things one reconciler's parts share (none of them is per tick).

    Attributes:
        store: The state store.
        client: The supervisor client.
        clock: The application clock (budgets and ``state_updated_at`` use it).
        options: Tuning.
        metrics: The app's metrics.
    """

    store: StateStore
    client: SupervisorClient
    clock: Clock
    options: ReconcilerOptions
    metrics: ServerMetrics

    async def load_fleet(self, ref: str) -> FleetSnapshot:
        """The stored snapshot of the fleet ``ref`` (id or slug).

        Raises:
            FleetNotFoundError: No such fleet.
        """
        fleet = await self.store.get_fleet_snapshot(ref)
        if fleet is None:
            raise FleetNotFoundError(ref)
        return fleet
