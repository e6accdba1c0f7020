"""The reconcile tick (DESIGN 7.3): heartbeats, escalation, failover, and the in-flight operation.

Safe to run concurrently from many processes: every write is one compare-and-swap, no
transaction spans a supervisor call, and only the tick whose CAS lands writes the events and
side effects that belong to it. Decisions come from :mod:`haru_core`; this module is glue:
read, call, CAS, event. Within one process a fleet never overlaps itself (a per-fleet lock).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal
from uuid import UUID

from haru_core import (
    CreateOperation,
    DomainChange,
    Reach,
    active_proven_dead,
    awaiting_confirmation,
    awake_standbys,
    check_endpoints,
    dead_since,
    decide_demotion,
    detect_dead_active,
    detect_degraded_escalation,
    detect_failover,
    detect_restores,
    domain_change_on_heartbeat,
    first_step,
    fleet_times_ahead,
    host_unreachable,
    inference_bindings,
    is_best_effort,
    is_step_overdue,
    next_step,
    operations_ahead,
    promotion_backoff,
    proxy_connect_failed,
    proxy_kick,
    restore_candidates,
    restore_confirmed,
    server_partitioned,
    serving_endpoints,
    slot_health_changes,
    step_budget_ms,
    step_remaining_ms,
    weak_evidence,
)
from haru_db import OperationEvent, SlotMirror, StateStore, StateStoreUnavailableError
from haru_protocol import (
    DeadEvidence,
    DomainDeadCleared,
    DomainDeadSuspected,
    DomainDegradedEscalated,
    DomainHeartbeatFailed,
    DomainNotReady,
    DomainSnapshot,
    DomainState,
    DomainStateChanged,
    DomainSupervisorAuthorized,
    DomainSupervisorUnauthorized,
    EventPayload,
    EventType,
    FleetSnapshot,
    Operation,
    OperationAutoFailover,
    OperationError,
    OperationErrorCode,
    OperationFailed,
    OperationKind,
    OperationPromotionBackoff,
    OperationRestoreDemote,
    OperationStarted,
    OperationState,
    OperationStep,
    OperationStepDone,
    OperationStepTimeoutBestEffort,
    OperationSucceeded,
    ServerPartitioned,
    ServerPartitionHealed,
    SlotStateChanged,
    SupervisorStatus,
)
from haru_supervisor_client import (
    HEARTBEAT_TIMEOUT_S,
    SupervisorCallError,
    SupervisorClient,
    SupervisorConnectError,
    SupervisorRejectedError,
    SupervisorTimeoutError,
    SupervisorUnauthorizedError,
)
from haru_web import request_id_scope

from haru_server._clock import Clock, SkewGate
from haru_server._errors import FleetNotFoundError
from haru_server._logfields import log_fields
from haru_server._metrics import ServerMetrics
from haru_server._operation_requests import request_operation
from haru_server._provisioning import Provisioner
from haru_server._reach import ENDPOINT_CONNECT_TIMEOUT_S, connect_reach
from haru_server._schema_gate import SchemaGate
from haru_server._steps import (
    Done,
    Failed,
    Pending,
    StepContext,
    StepResult,
    StepTuning,
    entry_mirror,
    route_guard_until,
    run_step,
)

if TYPE_CHECKING:
    from haru_server._proxy import InferenceProxy

logger = logging.getLogger(__name__)

AUTH_LOG_INTERVAL_S = 60.0
"""While a supervisor keeps refusing the server's token, repeat the ERROR line this often."""

RECENT_OPERATIONS = 64
"""How many of a fleet's newest operations promotion backoff looks at."""


@dataclass(frozen=True, slots=True)
class _Refused:
    """A heartbeat the supervisor answered 401/403: the token is wrong, the domain unjudged."""

    message: str


IN_FLIGHT_REUSE_S = 0.25
"""A tick reuses its in-flight read across a heartbeat round at most this long."""

HEARTBEAT_ROUND_S = 2.0
"""How long a tick waits for the heartbeats it starts (each poll has its own bound too)."""

PROXY_EVIDENCE_WINDOW_MS = 10_000
"""A proxy's refused connect (``connectFailedAt``) this recent corroborates and kicks."""


@dataclass(frozen=True, slots=True)
class _Proof:
    """This process's unbroken run of observations proving the active dead."""

    since: datetime
    models: tuple[str, ...]
    evidence: DeadEvidence


_Answer = SupervisorStatus | _Refused | None


@dataclass(slots=True)
class _PollInFlight:
    """A heartbeat poll of one domain, which may outlive the tick that started it."""

    fleet_id: UUID
    url: str
    task: asyncio.Task[_Answer]


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
        self._proxy = proxy
        self._schema_gate = schema_gate
        self._provisioner = provisioner
        self._metrics = metrics if metrics is not None else ServerMetrics()
        self._store = store
        self._client = client
        self._clock = clock
        self._options = options or ReconcilerOptions()
        self._locks: dict[UUID, asyncio.Lock] = {}
        self._heartbeat_errors: dict[UUID, str] = {}
        self._auth_failing: dict[UUID, str] = {}
        self._auth_logged_at: dict[UUID, float] = {}
        # Each domain's answer to this process's latest heartbeat (None: it did not answer).
        self._heartbeat_answers: dict[UUID, SupervisorStatus | None] = {}
        self._polls: dict[UUID, _PollInFlight] = {}
        # Domains whose latest poll outlived its round: no tick waits for their polls.
        self._suspects: set[UUID] = set()
        # Per fleet, recent operations seen holding a time from the future (next tick clamps).
        self._ahead: dict[UUID, frozenset[UUID]] = {}
        # Per active domain: since when, and which models, this process's heartbeats have
        # proven it dead without a break (haru_core.dead_since).
        self._dead: dict[UUID, _Proof] = {}
        # Fleets whose latest heartbeat round reached no supervisor at all.
        self._partitioned: set[UUID] = set()
        # How each domain's latest finished heartbeat poll ended (its connection).
        self._reach: dict[UUID, Reach] = {}
        # Per domain, the newest proxy connectFailedAt this process acted on (a kick).
        self._proxy_seen: dict[UUID, datetime] = {}
        # Per active domain, the weak evidence its latest round showed (logged on change).
        self._weak: dict[UUID, str] = {}

    async def close(self) -> None:
        """Cancel the heartbeat polls still running (a hung supervisor's)."""
        polls = [p.task for p in self._polls.values()]
        self._polls.clear()
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)

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
                        result = await self._drive(accepted.fleet, accepted.operation)
                else:
                    fleet = await self._load(fleet_ref)
                    lock = self._locks.setdefault(fleet.id, asyncio.Lock())
                    waited = lock.locked()
                    async with lock:
                        if waited:
                            fleet = await self._load(str(fleet.id))
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
            return await self._drive(fleet, driving)
        read_at = time.monotonic()
        fleet, answered = await self._heartbeats(fleet, driving)
        partitioned = fleet.id in self._partitioned
        self._metrics.fleet_judged(fleet, self._clock())
        operation = driving
        if time.monotonic() - read_at > IN_FLIGHT_REUSE_S:
            # A slow heartbeat round: pick up what other processes did meanwhile. A quick one
            # reuses the read (a promotion's first tick saves a round trip); acting on a
            # slightly old view is safe, because every write that follows is a CAS guarded by
            # the state it expects, and an operation created meanwhile is found by the
            # one-in-flight rule and driven by the next tick.
            operation = await self._store.get_in_flight_operation(fleet.id)
        fleet, operation = await self._clamp_future(fleet, operation)
        if self._provisioner is not None and await self._provisioner.step(fleet, operation):
            fleet = await self._load(str(fleet.id))
        if operation is None and not partitioned:
            # Partitioned: every domain looks lost at once; no decision rests on that.
            fleet = await self.annotate(fleet)
            fleet = await self._confirm_dead(fleet)
            fleet = await self._escalate(fleet)
            operation = await self._failover(fleet, answered)
            if operation is None:
                operation = await self._restore_posture(fleet)
        if operation is None:
            proof = (
                None if fleet.active_domain_id is None else self._dead.get(fleet.active_domain_id)
            )
            now = self._clock()
            confirming = not partitioned and (
                awaiting_confirmation(fleet, now=now, since=None if proof is None else proof.since)
                or self._proxy_kicked(fleet, now)
            )
            return TickResult(fleet.id, None, in_flight=False, confirming=confirming)
        return await self._drive(fleet, operation)

    async def _drive(self, fleet: FleetSnapshot, operation: Operation) -> TickResult:
        operation, queued = await self._advance(fleet, operation)
        in_flight = queued or operation.state in (OperationState.PENDING, OperationState.RUNNING)
        return TickResult(fleet.id, operation, in_flight=in_flight)

    async def _clamp_future(
        self, fleet: FleetSnapshot, operation: Operation | None
    ) -> tuple[FleetSnapshot, Operation | None]:
        """Write ``now`` over stored times from the future, so no decision waits them out.

        Decisions already count such a time as ``now`` (haru_core's clamp); once it is
        rewritten, the time since it grows again, and every process sees the same value.
        """
        now = self._clock()
        ahead = set(self._ahead.pop(fleet.id, frozenset()))
        if operation is not None:
            ahead |= operations_ahead((operation,), now=now)
        if not ahead and not fleet_times_ahead(fleet, now=now):
            return fleet, operation
        count = await self._store.clamp_future_times(fleet.id, operation_ids=ahead, at=now)
        if count == 0:
            return fleet, operation
        logger.warning(
            "fleet %s: %d stored row(s) held times from the future (a fast clock wrote them); "
            "clamped to now",
            fleet.slug,
            count,
            extra=log_fields(fleet),
        )
        fresh = None if operation is None else await self._store.get_operation(operation.id)
        return await self._load(str(fleet.id)), fresh if fresh is not None else operation

    async def _load(self, ref: str) -> FleetSnapshot:
        fleet = await self._store.get_fleet_snapshot(ref)
        if fleet is None:
            raise FleetNotFoundError(ref)
        return fleet

    async def annotate(self, fleet: FleetSnapshot) -> FleetSnapshot:
        """``fleet`` with what this process knows beyond the store, per domain.

        ``authFailing`` and ``lastSupervisorError`` come from this process's last heartbeat
        of each domain; ``promotionBackoffUntil`` from the fleet's recent operations. The
        failover decisions read them from the snapshot.
        """
        recent = await self._store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
        now = self._clock()
        ahead = operations_ahead(recent, now=now)
        if ahead:
            self._ahead[fleet.id] = ahead
        domains = []
        changed = False
        for domain in fleet.domains:
            backoff = promotion_backoff(fleet.policy, domain.id, recent, now=now)
            update = {
                "auth_failing": domain.id in self._auth_failing,
                "last_supervisor_error": self._heartbeat_errors.get(domain.id),
                "promotion_backoff_until": None if backoff is None else backoff.until,
            }
            if all(getattr(domain, name) == value for name, value in update.items()):
                domains.append(domain)  # already says so: no copy per tick and domain
                continue
            changed = True
            domains.append(domain.model_copy(update=update))
        return fleet.model_copy(update={"domains": tuple(domains)}) if changed else fleet

    # ---- step 1: heartbeats ------------------------------------------------------------------

    async def _poll(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, url: str
    ) -> SupervisorStatus | _Refused | None:
        try:
            status = await self._client.status(url, timeout_s=self._options.heartbeat_timeout_s)
        except SupervisorUnauthorizedError as exc:
            self._reach[domain.id] = Reach.ANSWERED
            self._heartbeat_errors[domain.id] = str(exc)
            return _Refused(str(exc))
        except SupervisorCallError as exc:
            self._reach[domain.id] = _reach_of(exc)
            message = str(exc)
            if self._heartbeat_errors.get(domain.id) != message:
                self._heartbeat_errors[domain.id] = message
                logger.warning(
                    "heartbeat of domain %s failed: %s",
                    domain.slug,
                    message,
                    extra=log_fields(fleet, domain=domain),
                )
            return None
        self._reach[domain.id] = Reach.ANSWERED
        if self._heartbeat_errors.pop(domain.id, None) is not None:
            logger.info(
                "heartbeat of domain %s answers again",
                domain.slug,
                extra=log_fields(fleet, domain=domain),
            )
        return status

    async def _auth_verdict(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, refused: _Refused | None, now: datetime
    ) -> None:
        """Report a supervisor refusing the token loudly, and its recovery once."""
        if refused is None:
            if self._auth_failing.pop(domain.id, None) is None:
                return
            self._auth_logged_at.pop(domain.id, None)
            logger.warning(
                "supervisor of domain %s accepts the server's token again",
                domain.slug,
                extra=log_fields(fleet, domain=domain),
            )
            await self._store.append_event(
                fleet_id=fleet.id,
                payload=DomainSupervisorAuthorized(),
                at=now,
                domain_id=domain.id,
            )
            return
        first = domain.id not in self._auth_failing
        self._auth_failing[domain.id] = refused.message
        mono = time.monotonic()
        last = self._auth_logged_at.get(domain.id)
        if first or last is None or mono - last >= AUTH_LOG_INTERVAL_S:
            self._auth_logged_at[domain.id] = mono
            logger.error(
                "supervisor of domain %s (fleet %s) refuses the server's token: %s. This is a "
                "configuration error (HARU_SUPERVISOR_TOKEN differs from the supervisor's); "
                "the domain is NOT judged down and nothing fails over because of it",
                domain.slug,
                fleet.slug,
                refused.message,
                extra=log_fields(fleet, domain=domain),
            )
        if first:
            await self._store.append_event(
                fleet_id=fleet.id,
                payload=DomainSupervisorUnauthorized(
                    message=refused.message, role=_role(fleet, domain)
                ),
                at=now,
                domain_id=domain.id,
            )

    async def _heartbeats(
        self, fleet: FleetSnapshot, in_flight: Operation | None
    ) -> tuple[FleetSnapshot, frozenset[UUID]]:
        """Poll every supervisor once and record what they answered.

        Returns the fleet as it stands afterwards and the ids of the domains that answered.
        """
        # A domain without a supervisor URL has nothing to poll (nothing could drive it).
        polled = [(d, d.supervisor_url) for d in fleet.domains if d.supervisor_url is not None]
        if not polled:
            return fleet, frozenset()
        # The domains an in-flight operation drives: their in-between slot states are its own.
        busy = (
            set()
            if in_flight is None
            else {in_flight.target_domain_id, in_flight.source_domain_id} - {None}
        )
        answers = await self._round(fleet, polled)
        now = self._clock()
        reached = [d.id for d, answer in answers if answer is not None]
        partitioned = await self._note_partition(
            fleet, polled=[d.id for d, _ in polled], reached=reached, now=now
        )
        await self._note_dead(fleet, {d.id: a for d, a in answers}, reached, now)
        landed = False
        verdicts: list[tuple[DomainSnapshot, SupervisorStatus | None, bool]] = []
        for domain, answer in answers:
            refused = answer if isinstance(answer, _Refused) else None
            await self._auth_verdict(fleet, domain, refused, now)
            status = answer if isinstance(answer, SupervisorStatus) else None
            self._heartbeat_answers[domain.id] = status
            if status is None:
                reason = "unauthorized" if refused is not None else "unreachable"
                self._metrics.heartbeat_failed(fleet.slug, domain.slug, reason=reason)
            else:
                landed |= await self._mirror_slots(
                    fleet, domain, status, now, busy=domain.id in busy
                )
            verdicts.append((domain, status, refused is not None))
        # Slot health first, then the heartbeats (DESIGN 7.3), every answering domain's in one
        # statement.
        read = {d.id: d.last_seen_at for d, status, _ in verdicts if status is not None}
        answered = frozenset(read)
        seen, replaced = (
            await self._store.record_heartbeats(read, at=now)
            if read
            else (frozenset[UUID](), frozenset[UUID]())
        )
        for domain, status, _ in verdicts:
            if status is not None:
                # The duty cycle counts the interval this write replaced, if it did (one
                # replica per interval).
                self._metrics.heartbeat_answered(
                    fleet,
                    domain,
                    status,
                    now,
                    replaced=domain.last_seen_at if domain.id in replaced else None,
                )
        if len(seen) < len(answered):
            # A newer heartbeat (another process, a clock ahead) is stored: judging staleness
            # from this snapshot's older value would be wrong. Re-read.
            landed = True
        for domain, status, unauthorized in verdicts:
            if partitioned and status is None:
                continue  # this server's network, not the domain's: left as it was
            landed |= await self._judge_domain(
                fleet, domain, status, now, unauthorized=unauthorized
            )
        if landed:
            return await self._load(str(fleet.id)), answered
        if not seen:
            return fleet, answered
        domains = tuple(
            d.model_copy(update={"last_seen_at": now}) if d.id in seen else d for d in fleet.domains
        )
        return fleet.model_copy(update={"domains": domains}), answered

    async def _note_partition(
        self, fleet: FleetSnapshot, *, polled: list[UUID], reached: list[UUID], now: datetime
    ) -> bool:
        """Record whether this round reached no supervisor of ``fleet`` (evented on change).

        While it reaches none, this process judges no domain and fails nothing over: its own
        network and every domain lost at once look the same from here. The gauge
        ``haru_reconcile_partitioned`` and a ``server.partitioned`` event (when the store is
        reachable) say so; ``server.partition.healed`` when a supervisor answers again.
        """
        partitioned = server_partitioned(polled, reached)
        self._metrics.partitioned(fleet.slug, cut_off=partitioned)
        payload: ServerPartitioned | ServerPartitionHealed
        if partitioned and fleet.id not in self._partitioned:
            self._partitioned.add(fleet.id)
            logger.warning(
                "fleet %s: no supervisor answered this server's heartbeats (%d domains); this "
                "server may be cut off from the network: no domain is judged and nothing fails "
                "over until one answers again",
                fleet.slug,
                len(polled),
                extra=log_fields(fleet),
            )
            payload = ServerPartitioned(
                domains=len(polled), host=socket.gethostname(), pid=os.getpid()
            )
        elif not partitioned and fleet.id in self._partitioned:
            self._partitioned.discard(fleet.id)
            logger.info(
                "fleet %s: supervisors answer this server again",
                fleet.slug,
                extra=log_fields(fleet),
            )
            payload = ServerPartitionHealed(host=socket.gethostname(), pid=os.getpid())
        else:
            return partitioned
        await self._store.append_event(fleet_id=fleet.id, payload=payload, at=now)
        return partitioned

    def _proxy_kicked(self, fleet: FleetSnapshot, now: datetime) -> bool:
        """Whether a proxy recorded a refused connect to the active, new to this process.

        Then the loop comes back at once for a fresh heartbeat (never a failover by itself).
        """
        active = fleet.active_domain
        if active is None or active.connect_failed_at is None:
            return False
        seen = self._proxy_seen.get(active.id)
        if not proxy_kick(active, seen=seen, now=now, window_ms=PROXY_EVIDENCE_WINDOW_MS):
            return False
        self._proxy_seen[active.id] = active.connect_failed_at
        logger.info(
            "fleet %s: a proxy could not connect to active domain %s at %s; heartbeat again now",
            fleet.slug,
            active.slug,
            active.connect_failed_at.isoformat(),
            extra=log_fields(fleet, domain=active),
        )
        return True

    async def _endpoints(self, domain: DomainSnapshot) -> dict[tuple[str, int], Reach]:
        """How a bounded connect to each serving endpoint of ``domain`` ended (concurrently)."""
        links = serving_endpoints(domain)
        reaches = await asyncio.gather(
            *(connect_reach(h, p, timeout_s=ENDPOINT_CONNECT_TIMEOUT_S) for h, p in links)
        )
        return dict(zip(links, reaches, strict=True))

    async def _observe(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, answer: _Answer, reached: list[UUID]
    ) -> tuple[tuple[str, ...], DeadEvidence | None, int, Reach | None]:
        """One observation of ``domain``: the proven-dead models, the evidence, endpoints."""
        status = answer if isinstance(answer, SupervisorStatus) else None
        if status is not None:
            models = active_proven_dead(fleet, domain, status)
            return models, ("models_refused" if models else None), 0, Reach.ANSWERED
        supervisor = None if answer is not None else self._reach.get(domain.id)
        if not check_endpoints(fleet, domain, supervisor=supervisor, reached=reached):
            return (), None, 0, supervisor
        endpoints = await self._endpoints(domain)
        if host_unreachable(
            fleet, domain, supervisor=supervisor, endpoints=endpoints, reached=reached
        ):
            names = tuple(dict.fromkeys(b.name for b in inference_bindings(domain)))
            return names, "host_unreachable", len(endpoints), supervisor
        logger.info(
            "domain %s: supervisor %s but a serving endpoint does not (%s): weak evidence",
            domain.slug,
            None if supervisor is None else supervisor.value,
            ", ".join(f"{h}:{p} {r.value}" for (h, p), r in endpoints.items()),
            extra=log_fields(fleet, domain=domain),
        )
        return (), None, 0, supervisor

    async def _note_dead(
        self,
        fleet: FleetSnapshot,
        answers: dict[UUID, _Answer],
        reached: list[UUID],
        now: datetime,
    ) -> None:
        """Follow the run of observations proving the active dead (and count weak evidence).

        Any other observation ends it, and so does none (a poll still running this round): the
        confirmation needs a fresh proof, never an old one. The first proof is evented
        (``domain.dead_suspected``), and so is a run that ends before it failed the active
        (``domain.dead_cleared``).
        """
        for domain in fleet.domains:
            previous = self._dead.get(domain.id)
            if domain.supervisor_url is None or domain.id not in answers:
                # Not polled, or its poll is still running: no fresh observation.
                if previous is not None:
                    await self._clear_dead(fleet, domain, previous, now)
                continue
            answer = answers[domain.id]
            models, evidence, endpoints, supervisor = await self._observe(
                fleet, domain, answer, reached
            )
            proxy_failed = proxy_connect_failed(domain, now=now, window_ms=PROXY_EVIDENCE_WINDOW_MS)
            self._note_weak(
                fleet,
                domain,
                weak_evidence(
                    fleet,
                    domain,
                    status=answer if isinstance(answer, SupervisorStatus) else None,
                    supervisor=supervisor,
                    proxy_failed=proxy_failed,
                    proven=evidence is not None,
                ),
            )
            since = dead_since(
                None if previous is None else previous.since, proven=evidence is not None, now=now
            )
            if since is None or evidence is None:
                if previous is not None:
                    await self._clear_dead(fleet, domain, previous, now)
                continue
            self._dead[domain.id] = _Proof(since, models, evidence)
            if previous is not None:
                continue
            logger.warning(
                "domain %s: proven dead (%s: %s); confirming in %d ms",
                domain.slug,
                evidence,
                ", ".join(models),
                fleet.policy.dead_confirm_ms,
                extra=log_fields(fleet, domain=domain),
            )
            self._metrics.dead_evidence(fleet.slug, evidence, "suspected")
            await self._store.append_event(
                fleet_id=fleet.id,
                payload=DomainDeadSuspected(
                    evidence=evidence,
                    models=models,
                    endpoints=endpoints,
                    proxy_connect_failed_at=domain.connect_failed_at if proxy_failed else None,
                    dead_confirm_ms=fleet.policy.dead_confirm_ms,
                ),
                at=now,
                domain_id=domain.id,
            )

    async def _clear_dead(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, proof: _Proof, now: datetime
    ) -> None:
        self._dead.pop(domain.id, None)
        logger.info(
            "domain %s: no longer proven dead",
            domain.slug,
            extra=log_fields(fleet, domain=domain),
        )
        self._metrics.dead_evidence(fleet.slug, proof.evidence, "cleared")
        await self._store.append_event(
            fleet_id=fleet.id,
            payload=DomainDeadCleared(evidence=proof.evidence, suspected_at=proof.since),
            at=now,
            domain_id=domain.id,
        )

    def _note_weak(self, fleet: FleetSnapshot, domain: DomainSnapshot, kind: str | None) -> None:
        """Count weak evidence against the active (visible, never a fast failover)."""
        if kind is None:
            self._weak.pop(domain.id, None)
            return
        self._metrics.weak(fleet.slug, kind)
        if self._weak.get(domain.id) != kind:
            self._weak[domain.id] = kind
            logger.info(
                "active domain %s: weak evidence (%s): the grace (%d ms) and the staleness "
                "(%d ms) decide",
                domain.slug,
                kind,
                fleet.policy.degraded_grace_ms,
                fleet.policy.heartbeat_stale_ms,
                extra=log_fields(fleet, domain=domain),
            )

    def _left_running(self, fleet: FleetSnapshot, polling: set[UUID]) -> dict[UUID, _Answer]:
        """The answers of the polls earlier ticks of ``fleet`` left running that are done now.

        Drops those done and those of domains not polled any more (cancelled).
        """
        earlier: dict[UUID, _Answer] = {}
        for domain_id, left in list(self._polls.items()):
            if left.fleet_id != fleet.id:
                continue
            if domain_id not in polling:
                # A domain that left the fleet, or has no supervisor URL any more.
                left.task.cancel()
                del self._polls[domain_id]
                self._suspects.discard(domain_id)
            elif left.task.done():
                del self._polls[domain_id]
                if not left.task.cancelled():
                    earlier[domain_id] = left.task.result()
                    if earlier[domain_id] is not None:
                        self._suspects.discard(domain_id)  # it answers again: wait for it
        return earlier

    async def _round(
        self, fleet: FleetSnapshot, polled: list[tuple[DomainSnapshot, str]]
    ) -> list[tuple[DomainSnapshot, _Answer]]:
        """Each domain's heartbeat answer that is in, after waiting a bounded round.

        A domain gets a new poll unless one is still running; the tick waits for its new
        polls up to ``heartbeat_round_s``, never for older ones nor for a suspect's (a domain
        whose latest poll outlived its round), so calls to different domains never wait for
        each other beyond that. A domain whose poll is still running is left out (unjudged
        this tick: neither seen nor failed); the answer of a poll an earlier tick left
        running (or its failure once the poll's own bound ran out) is taken by the first
        tick that finds it done, unless that tick's new poll answers in its round.
        """
        earlier = self._left_running(fleet, {d.id for d, _ in polled})
        started: list[asyncio.Task[_Answer]] = []
        for domain, url in polled:
            poll = self._polls.get(domain.id)
            if poll is not None and poll.url != url:
                poll.task.cancel()  # the supervisor moved (a relaunch): poll the new address
                poll = None
            if poll is None:
                task = asyncio.create_task(self._poll(fleet, domain, url))
                self._polls[domain.id] = _PollInFlight(fleet.id, url, task)
                if domain.id not in self._suspects:
                    started.append(task)
        if started:
            await asyncio.wait(started, timeout=self._options.heartbeat_round_s)
        answers: list[tuple[DomainSnapshot, _Answer]] = []
        for domain, _ in polled:
            task = self._polls[domain.id].task
            if task.done():
                del self._polls[domain.id]
                answer = None if task.cancelled() else task.result()
                answers.append((domain, answer))
                if answer is not None:
                    self._suspects.discard(domain.id)  # it answers within a round again
                continue
            self._suspects.add(domain.id)
            if domain.id in earlier:
                answers.append((domain, earlier[domain.id]))
        return answers

    async def _mirror_slots(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        status: SupervisorStatus,
        now: datetime,
        *,
        busy: bool,
    ) -> bool:
        landed = False
        # One CAS per slot: one dead GPU must not drag its siblings.
        for change in slot_health_changes(fleet, domain, status, busy=busy):
            moved = await self._store.transition_slot(
                change.slot_id,
                kind=change.kind,
                from_states=(change.from_state,),
                to=change.to_state,
                at=now,
            )
            if moved:
                landed = True
                await self._store.append_event(
                    fleet_id=fleet.id,
                    payload=SlotStateChanged(
                        kind=change.kind,
                        from_state=change.from_state.value,
                        to_state=change.to_state.value,
                        cause="heartbeat",
                    ),
                    at=now,
                    domain_id=domain.id,
                    slot_id=change.slot_id,
                )
        return landed

    async def _judge_domain(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        status: SupervisorStatus | None,
        now: datetime,
        *,
        unauthorized: bool,
    ) -> bool:
        change = domain_change_on_heartbeat(fleet, domain, status, unauthorized=unauthorized)
        if change is None:
            return False
        moved = await self._store.transition_domain(
            domain.id, from_states=(change.from_state,), to=change.to_state, at=now
        )
        if moved:
            logger.info(
                "domain %s: %s -> %s",
                domain.slug,
                change.from_state.value,
                change.to_state.value,
                extra=log_fields(fleet, domain=domain),
            )
            await self._store.append_event(
                fleet_id=fleet.id,
                payload=_domain_change_payload(change),
                at=now,
                domain_id=domain.id,
            )
        return moved

    # ---- step 2: escalation and failover -----------------------------------------------------

    async def _confirm_dead(self, fleet: FleetSnapshot) -> FleetSnapshot:
        """Fail the active at once when its heartbeats proved it dead for ``deadConfirmMs``."""
        now = self._clock()
        active_id = fleet.active_domain_id
        proof = None if active_id is None else self._dead.get(active_id)
        if proof is None:
            return fleet
        domain_id = detect_dead_active(fleet, now=now, since=proof.since)
        if domain_id is None:
            return fleet
        escalated = await self._store.escalate_domain_if_fleet_idle(
            domain_id=domain_id,
            fleet_id=fleet.id,
            at=now,
            heartbeat_stale_ms=fleet.policy.heartbeat_stale_ms,
        )
        if not escalated:
            return fleet
        self._dead.pop(domain_id, None)
        logger.warning(
            "fleet %s: active domain proven dead (%s: %s), confirmed; failed",
            fleet.slug,
            proof.evidence,
            ", ".join(proof.models),
            extra=log_fields(fleet, domain=domain_id),
        )
        self._metrics.dead_evidence(fleet.slug, proof.evidence, "confirmed")
        await self._store.append_event(
            fleet_id=fleet.id,
            payload=DomainDegradedEscalated(
                from_state=DomainState.DEGRADED,
                to_state=DomainState.FAILED,
                degraded_grace_ms=fleet.policy.degraded_grace_ms,
                dead_models=proof.models,
                dead_confirm_ms=fleet.policy.dead_confirm_ms,
                evidence=proof.evidence,
                suspected_at=proof.since,
            ),
            at=now,
            domain_id=domain_id,
        )
        return await self.annotate(await self._load(str(fleet.id)))

    async def _escalate(self, fleet: FleetSnapshot) -> FleetSnapshot:
        now = self._clock()
        domain_id = detect_degraded_escalation(fleet, now=now)
        if domain_id is None:
            return fleet
        escalated = await self._store.escalate_domain_if_fleet_idle(
            domain_id=domain_id,
            fleet_id=fleet.id,
            at=now,
            heartbeat_stale_ms=fleet.policy.heartbeat_stale_ms,
        )
        if not escalated:
            return fleet
        logger.warning(
            "fleet %s: degraded active domain escalated to failed",
            fleet.slug,
            extra=log_fields(fleet, domain=fleet.active_domain_id),
        )
        await self._store.append_event(
            fleet_id=fleet.id,
            payload=DomainDegradedEscalated(
                from_state=DomainState.DEGRADED,
                to_state=DomainState.FAILED,
                degraded_grace_ms=fleet.policy.degraded_grace_ms,
            ),
            at=now,
            domain_id=domain_id,
        )
        return await self.annotate(await self._load(str(fleet.id)))

    async def _failover(self, fleet: FleetSnapshot, answered: frozenset[UUID]) -> Operation | None:
        now = self._clock()
        # An active that answered this tick's heartbeat is not stale, whatever its recorded
        # lastSeenAt says: the store may have taken longer to record the answer (a SQLite
        # write lock held past heartbeatStaleMs) than the active took to give it.
        decision = detect_failover(fleet, now=now, answered=answered)
        if decision is None:
            return None
        operation, _ = await request_operation(
            self._store,
            self._metrics,
            fleet,
            kind=OperationKind.PROMOTE,
            target_domain_id=decision.target_domain_id,
            at=now,
            trigger="automatic",
            why=f"automatic failover: {decision.reason}",
            event=lambda _: OperationAutoFailover(
                reason=decision.reason,
                active_domain_id=decision.active_domain_id,
                target_domain_id=decision.target_domain_id,
            ),
        )
        return operation

    async def _confirmed_now(self, fleet: FleetSnapshot, domain_id: UUID, reason: str) -> bool:
        """Whether the supervisor confirms, now, that the domain is owed a restore demote.

        The recorded slot states may come from a racing reconciler's heartbeat that polled
        before a demote started training (or slept vLLM) and landed after it recorded its
        result; a restore demote acts only on a fresh proof (:func:`restore_confirmed`; the
        next heartbeat repairs the stale record). This process's own latest heartbeat answer
        must agree first, so a standby whose vLLM crashed (its inference slot ``failed``,
        nothing a demote could fix) costs no extra supervisor call per tick.
        """
        domain = fleet.domain(domain_id)
        if domain is None or domain.supervisor_url is None:
            return False
        if domain_id in self._suspects:
            return False  # its heartbeats outlive their round (hung?): no call to wait for
        seen = self._heartbeat_answers.get(domain_id)
        if seen is None or not restore_confirmed(domain, seen, reason):
            return False
        try:
            status = await self._client.status(
                domain.supervisor_url, timeout_s=self._options.heartbeat_timeout_s
            )
        except SupervisorCallError:
            return False
        return restore_confirmed(domain, status, reason)

    async def _restore_posture(self, fleet: FleetSnapshot) -> Operation | None:
        """Queue a demote of a standby out of posture (backed off per target).

        A supervisor restart stops a standby's trainers; the heartbeat mirrors its training
        slot to ``idle``, and without this nothing would start them again. A failover whose
        ``demote_old_sleep`` timed out while the old active was ``failed`` could not queue its
        restore demote (a failed domain is not demotable); once the domain is ``ready`` again
        with its vLLM proven awake, this queues it.
        """
        if not (restore_candidates(fleet) or awake_standbys(fleet)):
            return None
        now = self._clock()
        recent = await self._store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
        for decision in detect_restores(fleet, recent, now=now):
            if await self._confirmed_now(fleet, decision.target_domain_id, decision.reason):
                break
        else:
            return None
        operation, _ = await request_operation(
            self._store,
            self._metrics,
            fleet,
            kind=OperationKind.DEMOTE,
            target_domain_id=decision.target_domain_id,
            at=now,
            trigger="restore",
            why=f"standby out of standby posture: {decision.reason}",
            event=lambda _: OperationRestoreDemote(
                cause_operation_id=None,
                target_domain_id=decision.target_domain_id,
                reason=decision.reason,
            ),
        )
        return operation

    # ---- step 3: the in-flight operation -----------------------------------------------------

    async def _advance(self, fleet: FleetSnapshot, operation: Operation) -> tuple[Operation, bool]:
        """Advance ``operation`` by one step, or several with chaining.

        Returns:
            The operation's state after the tick, and whether a follow-up operation was queued.
        """
        chain_end = time.monotonic() + self._options.chain_budget_s
        # The step whose first slot move rode the CAS that started it (run next, this tick).
        entered: OperationStep | None = None
        while True:
            if operation.state is OperationState.PENDING:
                claimed = await self._claim(fleet, operation)
                if claimed is None:
                    return await self._reread(operation), False
                operation = claimed
                entered = operation.current_step
            step = operation.current_step
            if operation.state is not OperationState.RUNNING or step is None:
                return operation, False
            result = await self._resolve(fleet, operation, step, entered=step is entered)
            operation, progressed, queued = await self._apply(fleet, operation, step, result)
            entered = operation.current_step if progressed else None
            if queued or not progressed or operation.state is not OperationState.RUNNING:
                return operation, queued
            if not self._options.chaining or time.monotonic() >= chain_end:
                return operation, False
            # The same snapshot serves the next step: executors read only what the layout
            # and the operation fix (bindings, URLs, source, policy), and every write they
            # make is guarded by the state it expects, so a racer's progress is never undone.

    async def _claim(self, fleet: FleetSnapshot, operation: Operation) -> Operation | None:
        now = self._clock()
        step = first_step(operation.kind)
        # The started event lands in the claim's own statement (one write, not two).
        started = OperationEvent.of(
            OperationStarted(kind=operation.kind, target_domain_id=operation.target_domain_id)
        )
        if not await self._store.claim_operation(
            operation.id,
            first_step=step,
            at=now,
            events=(started,),
            entry_mirror=self._entry_mirror(fleet, operation, step),
        ):
            return None
        self._metrics.operation_started(operation.kind.value)
        return operation.model_copy(
            update={"state": OperationState.RUNNING, "current_step": step, "step_started_at": now}
        )

    @staticmethod
    def _entry_mirror(
        fleet: FleetSnapshot, operation: Operation, step: OperationStep | None
    ) -> SlotMirror | None:
        target = fleet.domain(operation.target_domain_id)
        if step is None or target is None:
            return None
        return entry_mirror(step, target)

    async def _reread(self, operation: Operation) -> Operation:
        fresh = await self._store.get_operation(operation.id)
        return operation if fresh is None else fresh

    async def _resolve(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, *, entered: bool
    ) -> StepResult:
        now = self._clock()
        started = operation.step_started_at or now
        policy = fleet.policy
        guard_until = await route_guard_until(
            self._store,
            self._options.tuning,
            fleet,
            operation,
            step,
            now,
            recent_limit=RECENT_OPERATIONS,
        )
        if guard_until is not None and guard_until > started:
            # The route-guard wait comes on top of the step's budget (it never consumes it):
            # the budget counts from the end of the guard.
            started = guard_until
        if is_step_overdue(policy, step, started_at=started, now=now):
            return await self._timeout(fleet, operation, step)
        target = fleet.domain(operation.target_domain_id)
        if target is None:
            return Failed(
                OperationErrorCode.TARGET_MISSING,
                f"target domain {operation.target_domain_id} is no longer part of the fleet",
            )
        remaining = step_remaining_ms(policy, step, started_at=started, now=now)
        ctx = StepContext(
            store=self._store,
            client=self._client,
            tuning=self._options.tuning,
            fleet=fleet,
            operation=operation,
            step=step,
            target=target,
            now=now,
            remaining_ms=remaining,
            deadline=time.monotonic() + remaining / 1000,
            entered=entered,
            guard_until=guard_until,
            proxy=self._proxy,
        )
        return await run_step(ctx)

    async def _timeout(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep
    ) -> StepResult:
        budget = step_budget_ms(fleet.policy, step)
        if is_best_effort(step):
            # Never start training next to vLLM servers that may still be awake.
            return Done(
                OperationStepDone(step=step, timed_out=True, budget_ms=budget),
                complete=step is OperationStep.DEMOTE_OLD_SLEEP,
                degrade_source=True,
            )
        if step is OperationStep.SWITCH_ACTIVE:
            fresh = await self._reread(operation)
            pointer = await self._store.get_fleet_route_pointer(str(fleet.id))
            at_target = pointer is not None and pointer.active_domain_id == fresh.target_domain_id
            if fresh.routing_committed or at_target:
                return Done(OperationStepDone(step=step, timed_out=True, routing_committed=True))
        return Failed(
            OperationErrorCode.STEP_TIMEOUT,
            f"step {step.value} did not finish within its budget of {budget} ms",
        )

    async def _apply(
        self,
        fleet: FleetSnapshot,
        operation: Operation,
        step: OperationStep,
        result: StepResult,
    ) -> tuple[Operation, bool, bool]:
        """Apply one step result with ONE operation CAS.

        Returns:
            The operation after it, whether this tick's CAS landed, and whether a follow-up
            operation was queued.
        """
        match result:
            case Pending(reason=reason):
                logger.debug(
                    "operation %s step %s pending: %s",
                    operation.id,
                    step.value,
                    reason,
                    extra=log_fields(fleet, operation=operation, step=step),
                )
                return operation, False, False
            case Failed():
                return await self._fail(fleet, operation, step, result)
            case Done():
                return await self._done(fleet, operation, step, result)

    async def _done(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, result: Done
    ) -> tuple[Operation, bool, bool]:
        now = self._clock()
        following = None if result.complete else next_step(operation.kind, step)
        step_done = OperationEvent.of(result.detail)
        outcome = OperationSucceeded(
            kind=operation.kind, target_domain_id=operation.target_domain_id
        )
        succeeded = OperationEvent.of(outcome)
        # The step's events land in its CAS statement, except after a best-effort timeout,
        # whose source-degrade event must come first.
        inline = not result.degrade_source
        if following is None:
            landed = await self._store.complete_operation(
                operation.id,
                from_step=step,
                at=now,
                events=(step_done, succeeded) if inline else (),
                exit_mirror=result.mirror,
            )
        else:
            # advance_step returns the new step's fencing token (None: the CAS lost).
            fence = await self._store.advance_step(
                operation.id,
                from_step=step,
                to_step=following,
                at=now,
                events=(step_done,) if inline else (),
                exit_mirror=result.mirror,
                entry_mirror=self._entry_mirror(fleet, operation, following),
            )
            landed = fence is not None
        if not landed:
            return await self._reread(operation), False, False
        self._step_metrics(operation, step, "done", now)
        if following is None:
            self._metrics.operation_succeeded(operation.kind.value)
            self._metrics.operation_ended(
                operation.kind.value,
                outcome="succeeded",
                seconds=(now - operation.created_at).total_seconds(),
            )
        if not inline:
            await self._degrade_source(fleet, operation, step, now)
            await self._event(fleet, operation, result.detail, now)
        if following is not None:
            logger.info(
                "operation %s: %s done, next %s",
                operation.id,
                step.value,
                following.value,
                extra=log_fields(fleet, operation=operation, step=step),
            )
            return (
                operation.model_copy(update={"current_step": following, "step_started_at": now}),
                True,
                False,
            )
        logger.info(
            "operation %s (%s) succeeded",
            operation.id,
            operation.kind.value,
            extra=log_fields(fleet, operation=operation, step=step),
        )
        if not inline:
            await self._event(fleet, operation, outcome, now)
        queued = False
        source = operation.source_domain_id
        if result.degrade_source and source is not None and source != operation.target_domain_id:
            # A best-effort demote step ran out of budget (e.g. across a server restart): the
            # old active may be half demoted. A demote finishes the job from what it observes:
            # vLLM proven asleep, then training restarted.
            queued = await self._restore(
                fleet, source, operation, now, reason=f"{step.value} timed out"
            )
        return await self._reread(operation), True, queued

    def _step_metrics(
        self, operation: Operation, step: OperationStep, outcome: str, now: datetime
    ) -> None:
        started = operation.step_started_at
        seconds = 0.0 if started is None else (now - started).total_seconds()
        self._metrics.step_resolved(
            operation.kind.value, step.value, outcome=outcome, seconds=seconds
        )

    async def _degrade_source(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, now: datetime
    ) -> None:
        source = operation.source_domain_id
        degraded = False
        if source is not None and source != operation.target_domain_id:
            degraded = await self._store.transition_domain(
                source, from_states=(DomainState.READY,), to=DomainState.DEGRADED, at=now
            )
        logger.warning(
            "operation %s: best-effort step %s timed out; source domain %s %s",
            operation.id,
            step.value,
            source,
            "degraded" if degraded else "left as is",
            extra=log_fields(fleet, domain=source, operation=operation, step=step),
        )
        await self._event(
            fleet,
            operation,
            OperationStepTimeoutBestEffort(
                step=step, source_domain_id=source, source_degraded=degraded
            ),
            now,
            domain_id=source,
        )

    async def _fail(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, result: Failed
    ) -> tuple[Operation, bool, bool]:
        now = self._clock()
        error = OperationError(step=step, code=result.code.value, message=result.message)
        promote = operation.kind is OperationKind.PROMOTE
        landed = await self._store.fail_operation(
            operation.id,
            error=error,
            at=now,
            expected_step=step,
            # Before the commit point this guard is always true; at switch_active it keeps a
            # fail from undoing a pointer move that landed meanwhile.
            target_not_routed=promote,
        )
        if not landed:
            return await self._reread(operation), False, False
        self._step_metrics(operation, step, "failed", now)
        self._metrics.operation_failed(operation.kind.value, result.code.value)
        self._metrics.operation_ended(
            operation.kind.value,
            outcome="failed",
            seconds=(now - operation.created_at).total_seconds(),
        )
        logger.warning(
            "operation %s (%s) failed at %s: %s: %s",
            operation.id,
            operation.kind.value,
            step.value,
            result.code.value,
            result.message,
            extra=log_fields(fleet, operation=operation, step=step),
        )
        await self._event(
            fleet,
            operation,
            OperationFailed(
                step=step,
                code=result.code,
                message=result.message,
                failed_models=result.failed_models,
            ),
            now,
        )
        queued = False
        if promote:
            await self._backoff_event(fleet, operation, now)
            if result.code is OperationErrorCode.SUPERVISOR_UNAUTHORIZED:
                # A demote would be refused the same way; the auth failure is reported loudly.
                logger.error(
                    "operation %s: target's supervisor refuses the server's token; its standby "
                    "posture is restored once the token is fixed (demote it then)",
                    operation.id,
                    extra=log_fields(fleet, operation=operation, step=step),
                )
            else:
                # Whatever step failed (training stopped, vLLM woken, probe), a demote returns
                # the target to standby posture: vLLM asleep, training restarted.
                queued = await self._restore(
                    fleet, operation.target_domain_id, operation, now, reason=result.code.value
                )
        return await self._reread(operation), True, queued

    async def _backoff_event(self, fleet: FleetSnapshot, failed: Operation, now: datetime) -> None:
        recent = await self._store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
        backoff = promotion_backoff(fleet.policy, failed.target_domain_id, recent, now=now)
        if backoff is None:  # pragma: no cover - the failed promote itself is among them
            return
        logger.warning(
            "fleet %s: %d consecutive failed promotion(s) of domain %s; automatic promotions "
            "of it wait %d ms (until %s)",
            fleet.slug,
            backoff.consecutive_failures,
            failed.target_domain_id,
            backoff.delay_ms,
            backoff.until.isoformat(),
            extra=log_fields(fleet, operation=failed),
        )
        await self._event(
            fleet,
            failed,
            OperationPromotionBackoff(
                target_domain_id=failed.target_domain_id,
                consecutive_failures=backoff.consecutive_failures,
                delay_ms=backoff.delay_ms,
                until=backoff.until,
            ),
            now,
        )

    async def _restore(
        self,
        fleet: FleetSnapshot,
        domain_id: UUID,
        cause: Operation,
        now: datetime,
        *,
        reason: str,
    ) -> bool:
        """Queue a demote that returns ``domain_id`` to standby posture after ``cause``."""
        fresh = await self._load(str(fleet.id))
        decision = decide_demotion(fresh, domain_id)
        if not isinstance(decision, CreateOperation):
            # Deferred, not dropped: once the domain is a ready standby again, the posture
            # restore (``_restore_posture``) queues the demote if its vLLM is proven awake or
            # its training stopped.
            logger.warning(
                "operation %s: domain cannot be returned to standby yet (%s); its restore "
                "waits until it is demotable",
                cause.id,
                decision.message,
                extra=log_fields(fleet, domain=domain_id, operation=cause),
            )
            return False
        operation, created = await request_operation(
            self._store,
            self._metrics,
            fleet,
            kind=OperationKind.DEMOTE,
            target_domain_id=decision.target_domain_id,
            at=now,
            trigger="restore",
            why=f"restore standby after operation {cause.id}: {reason}",
            event=lambda _: OperationRestoreDemote(
                cause_operation_id=cause.id, target_domain_id=domain_id, reason=reason
            ),
        )
        if not created:
            return operation.state in (OperationState.PENDING, OperationState.RUNNING)
        return True

    async def _event(
        self,
        fleet: FleetSnapshot,
        operation: Operation,
        payload: EventPayload,
        now: datetime,
        *,
        domain_id: UUID | None = None,
    ) -> None:
        await self._store.append_event(
            fleet_id=fleet.id,
            payload=payload,
            at=now,
            domain_id=domain_id if domain_id is not None else operation.target_domain_id,
            operation_id=operation.id,
        )


def _domain_change_payload(
    change: DomainChange,
) -> DomainStateChanged | DomainNotReady | DomainHeartbeatFailed:
    model: type[DomainStateChanged | DomainNotReady | DomainHeartbeatFailed]
    if change.event is EventType.DOMAIN_NOT_READY:
        model = DomainNotReady
    elif change.event is EventType.DOMAIN_HEARTBEAT_FAILED:
        model = DomainHeartbeatFailed
    else:
        model = DomainStateChanged
    verdict = change.detail
    return model(
        from_state=change.from_state,
        to_state=change.to_state,
        role=verdict.role,
        reachable=verdict.reachable,
        supervisor_ready=verdict.supervisor_ready,
        active_ready=verdict.active_ready,
        models_not_awake=verdict.models_not_awake,
    )


def _reach_of(exc: SupervisorCallError) -> Reach:
    """How a failed heartbeat's connection ended (only refused / no route are strong)."""
    if isinstance(exc, SupervisorConnectError):
        return Reach(exc.reason)
    if isinstance(exc, SupervisorTimeoutError):
        # A connect nobody answered and a slow answer both end here: weak either way.
        return Reach.SLOW
    if isinstance(exc, SupervisorRejectedError):
        return Reach.ANSWERED  # an error status came from the host
    return Reach.BROKEN  # TLS, plain HTTP refused, a reset after connecting, a bad answer


def _role(fleet: FleetSnapshot, domain: DomainSnapshot) -> Literal["active", "standby"]:
    return "active" if fleet.active_domain_id == domain.id else "standby"
