"""The reconcile tick (DESIGN 7.3): a heartbeat round, failover decisions, the in-flight operation.

Safe to run concurrently from many processes: every write is one compare-and-swap, no
transaction spans a supervisor call, and only the tick whose CAS lands writes the events and
side effects that belong to it. Decisions come from :mod:`haru_core`; the tick assembles three
parts, each given the reconciler's :class:`~haru_server._reconcile_context.ReconcileContext`:
the heartbeat round (:mod:`haru_server._heartbeat_round`, with this process's memory of
evidence of death in :mod:`haru_server._dead_proof`), the failover decisions
(:mod:`haru_server._failover_decisions`) and the operation driver
(:mod:`haru_server._operation_driver`). Within one process a fleet never overlaps itself (a
per-fleet lock).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from uuid import UUID

from haru_core import awaiting_confirmation
from haru_db import StateStore, StateStoreUnavailableError
from haru_protocol import FleetSnapshot, Operation, OperationState
from haru_supervisor_client import SupervisorClient
from haru_web import request_id_scope

from haru_server._clock import Clock, SkewGate
from haru_server._dead_proof import DeadProofs
from haru_server._failover_decisions import FailoverDecisions
from haru_server._heartbeat_round import HeartbeatRound
from haru_server._metrics import ServerMetrics
from haru_server._operation_driver import OperationDriver
from haru_server._provisioning import Provisioner
from haru_server._reconcile_context import RECENT_OPERATIONS, ReconcileContext, ReconcilerOptions
from haru_server._schema_gate import SchemaGate

if TYPE_CHECKING:
    from haru_server._proxy import InferenceProxy

__all__ = [
    "RECENT_OPERATIONS",
    "Accepted",
    "Reconciler",
    "ReconcilerOptions",
    "TickResult",
]

IN_FLIGHT_REUSE_S = 0.25
"""A tick reuses its in-flight read across a heartbeat round at most this long."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """An operation a request just created, with the fleet snapshot it was validated on.

    A kick carries it so that the kicked tick starts the operation without reading the fleet
    and the in-flight operation again (two statements); every write that follows is a CAS
    guarded by the state it expects, so acting on this view is as safe as on a fresh one.
    """

    fleet: FleetSnapshot
    operation: Operation


@dataclass(frozen=True, slots=True)
class TickResult:
    """What one tick did.

    Attributes:
        fleet_id: The fleet.
        operation: The operation this tick worked on (its state after the tick), or None.
        in_flight: An operation is still pending or running (or was just queued): the loop
            should come back soon.
        confirming: The active's latest heartbeat proved it dead and a second one must confirm
            it: the loop should come back soon (a fresh heartbeat, not the next regular tick).
    """

    fleet_id: UUID
    operation: Operation | None
    in_flight: bool
    confirming: bool = False


class Reconciler:
    """Runs reconcile ticks against one state store.

    Args:
        store: The state store.
        client: The supervisor client.
        clock: The application clock (budgets and ``state_updated_at`` use it).
        options: Tuning.
        metrics: The app's metrics (a private set when None).
        provisioner: Drives the ``skypilot`` domains (launch, UP, address, loss, relaunch);
            None leaves them to the operator.
        gate: Refuses ticks while this host's clock is off the database's; None never does.
        schema_gate: Refuses ticks while a newer release's schema is in the store; None never
            does.
        proxy: This process's inference proxy, told of each flip made here (None: none runs).
    """

    def __init__(
        self,
        store: StateStore,
        client: SupervisorClient,
        *,
        clock: Clock,
        options: ReconcilerOptions | None = None,
        metrics: ServerMetrics | None = None,
        provisioner: Provisioner | None = None,
        gate: SkewGate | None = None,
        schema_gate: SchemaGate | None = None,
        proxy: InferenceProxy | None = None,
    ) -> None:
        self._gate = gate
        self._schema_gate = schema_gate
        self._provisioner = provisioner
        self._metrics = metrics if metrics is not None else ServerMetrics()
        self._options = options or ReconcilerOptions()
        self._ctx = ReconcileContext(
            store=store, client=client, clock=clock, options=self._options, metrics=self._metrics
        )
        self._store = store
        self._clock = clock
        self._locks: dict[UUID, asyncio.Lock] = {}
        self._dead_proofs = DeadProofs(self._ctx)
        self._heartbeats = HeartbeatRound(self._ctx, self._dead_proofs)
        self._decisions = FailoverDecisions(self._ctx, self._heartbeats, self._dead_proofs)
        self._driver = OperationDriver(self._ctx, proxy)

    async def close(self) -> None:
        """Cancel the heartbeat polls still running (a hung supervisor's)."""
        await self._heartbeats.close()

    @property
    def options(self) -> ReconcilerOptions:
        """The tick's tuning."""
        return self._options

    async def tick(
        self, fleet_ref: str, *, pending_first: bool = False, start: Accepted | None = None
    ) -> TickResult:
        """Run one reconcile tick of the fleet ``fleet_ref`` (id or slug).

        ``pending_first``: the tick answers a kick (an accepted promote or demote, a passive
        failure seen by the proxy). When the fleet's in-flight operation is still ``pending``
        (just accepted, not claimed) such a tick only drives it: no heartbeat round and no
        provisioning pass before its first step. Every step proves its own effect from a
        status poll of the supervisor it drives, so the round would only delay the promotion;
        the loop's next regular tick polls every supervisor as usual. Any other such tick is
        a whole tick, so kicks can never starve the heartbeats. ``start`` (with
        ``pending_first``): the operation a request just accepted, still ``pending``; the tick
        starts it from the request's snapshot without reading the fleet first, unless another
        tick of the fleet is running (then it is an ordinary ``pending_first`` tick).

        Raises:
            FleetNotFoundError: No such fleet.
            ClockSkewedError: The gate refuses: this host's clock is off the database's.
            SchemaNewerError: The schema gate refuses: a newer release migrated the store.
            haru_db.StateStoreUnavailableError: The store failed; the tick stops there.
        """
        # A tick of the loop gets its own request id (its log lines and supervisor calls share
        # it); a tick run by POST /reconcile keeps the request's.
        with request_id_scope():
            if self._schema_gate is not None:
                await self._schema_gate.check()
            if self._gate is not None:
                await self._gate.check(fleet_ref)
            started = time.monotonic()
            ok = False
            try:
                accepted = start if pending_first else None
                if accepted is not None and self._idle_pending(accepted):
                    async with self._locks[accepted.fleet.id]:
                        result = await self._drive_and_report(accepted.fleet, accepted.operation)
                else:
                    fleet = await self._ctx.load_fleet(fleet_ref)
                    lock = self._locks.setdefault(fleet.id, asyncio.Lock())
                    waited = lock.locked()
                    async with lock:
                        if waited:
                            fleet = await self._ctx.load_fleet(str(fleet.id))
                        result = await self._tick(fleet, pending_first=pending_first)
            except StateStoreUnavailableError:
                self._metrics.store_error("reconcile")
                raise
            else:
                ok = True
            finally:
                self._metrics.tick_finished(ok=ok, seconds=time.monotonic() - started)
            return result

    def _idle_pending(self, accepted: Accepted) -> bool:
        """Whether ``accepted`` can start at once (pending, and no tick of its fleet runs)."""
        lock = self._locks.setdefault(accepted.fleet.id, asyncio.Lock())
        return accepted.operation.state is OperationState.PENDING and not lock.locked()

    # ---- the tick ----------------------------------------------------------------------------

    async def _tick(self, fleet: FleetSnapshot, *, pending_first: bool) -> TickResult:
        driving = await self._store.get_in_flight_operation(fleet.id)
        if pending_first and driving is not None and driving.state is OperationState.PENDING:
            return await self._drive_and_report(fleet, driving)
        read_at = time.monotonic()
        fleet, answered = await self._heartbeats.run(fleet, driving)
        partitioned = self._heartbeats.is_partitioned(fleet.id)
        self._metrics.fleet_judged(fleet, self._clock())
        operation = driving
        if time.monotonic() - read_at > IN_FLIGHT_REUSE_S:
            # A slow heartbeat round: pick up what other processes did meanwhile. A quick one
            # reuses the read (a promotion's first tick saves a round trip); acting on a
            # slightly old view is safe, because every write that follows is a CAS guarded by
            # the state it expects, and an operation created meanwhile is found by the
            # one-in-flight rule and driven by the next tick.
            operation = await self._store.get_in_flight_operation(fleet.id)
        fleet, operation = await self._decisions.clamp_future_times(fleet, operation)
        if self._provisioner is not None and await self._provisioner.provision_round(
            fleet, operation
        ):
            fleet = await self._ctx.load_fleet(str(fleet.id))
        if operation is None and not partitioned:
            # Partitioned: every domain looks lost at once; no decision rests on that.
            fleet, operation = await self._decisions.decide(fleet, answered)
        if operation is None:
            proof = self._dead_proofs.proof_of(fleet.active_domain_id)
            now = self._clock()
            confirming = not partitioned and (
                awaiting_confirmation(fleet, now=now, since=None if proof is None else proof.since)
                or self._dead_proofs.proxy_kicked(fleet, now)
            )
            return TickResult(fleet.id, None, in_flight=False, confirming=confirming)
        return await self._drive_and_report(fleet, operation)

    async def _drive_and_report(self, fleet: FleetSnapshot, operation: Operation) -> TickResult:
        operation, queued = await self._driver.drive_operation(fleet, operation)
        in_flight = queued or operation.state in (OperationState.PENDING, OperationState.RUNNING)
        return TickResult(fleet.id, operation, in_flight=in_flight)

    async def annotate(self, fleet: FleetSnapshot) -> FleetSnapshot:
        """``fleet`` with what this process knows beyond the store, per domain.

        ``authFailing`` and ``lastSupervisorError`` come from this process's last heartbeat
        of each domain; ``promotionBackoffUntil`` from the fleet's recent operations. The
        failover decisions read them from the snapshot.
        """
        return await self._decisions.annotate(fleet)
