"""Failover decisions (DESIGN 7.3): observations turned into escalation, failover and restore.

While a fleet has no operation in flight, each tick asks, in order: is the active proven dead
long enough (fail it), has a degraded active outlasted its grace (fail it), should a standby be
promoted (an automatic failover), is a standby out of its posture (a restore demote). The
answers are :mod:`haru_core`'s pure rules, read from the snapshot that :meth:`annotate` extends
with this process's heartbeat memory; this module writes them: a CAS, an operation, an event.
"""

from __future__ import annotations

import logging
from datetime import datetime
from uuid import UUID

from haru_core import (
    awake_standbys,
    detect_dead_active,
    detect_degraded_escalation,
    detect_failover,
    detect_restores,
    fleet_times_ahead,
    operations_ahead,
    promotion_backoff,
    restore_candidates,
    restore_confirmed,
)
from haru_protocol import (
    DomainDegradedEscalated,
    DomainState,
    FleetSnapshot,
    Operation,
    OperationAutoFailover,
    OperationKind,
)
from haru_supervisor_client import SupervisorCallError

from haru_server._dead_proof import DeadProofs
from haru_server._heartbeat_round import HeartbeatRound
from haru_server._logfields import log_fields
from haru_server._operation_requests import request_operation, request_restore_demote
from haru_server._reconcile_context import RECENT_OPERATIONS, ReconcileContext

logger = logging.getLogger(__name__)


class FailoverDecisions:
    """Decides, from what the heartbeats saw, whether to fail, fail over or restore a domain.

    Args:
        ctx: The reconciler's store, client, clock, tuning and metrics.
        heartbeats: The heartbeat round whose memory the decisions read.
        dead_proofs: The runs of proof that a domain is dead.
    """

    def __init__(
        self, ctx: ReconcileContext, heartbeats: HeartbeatRound, dead_proofs: DeadProofs
    ) -> None:
        self._ctx = ctx
        self._heartbeats = heartbeats
        self._dead_proofs = dead_proofs
        # Per fleet, recent operations seen holding a time from the future (next tick clamps).
        self._ahead: dict[UUID, frozenset[UUID]] = {}

    async def decide(
        self, fleet: FleetSnapshot, answered: frozenset[UUID]
    ) -> tuple[FleetSnapshot, Operation | None]:
        """Fail a dead or degraded active, then queue a failover or a posture restore.

        Run only while ``fleet`` has no operation in flight and this process's round reached
        a supervisor. ``answered``: the domains that answered this tick's heartbeat.

        Returns:
            The fleet as it stands afterwards, and the operation queued (None: none).
        """
        fleet = await self.annotate(fleet)
        fleet = await self._confirm_dead(fleet)
        fleet = await self._escalate(fleet)
        operation = await self._request_failover(fleet, answered)
        if operation is None:
            operation = await self._request_posture_restore(fleet)
        return fleet, operation

    async def annotate(self, fleet: FleetSnapshot) -> FleetSnapshot:
        """``fleet`` with what this process knows beyond the store, per domain.

        ``authFailing`` and ``lastSupervisorError`` come from this process's last heartbeat
        of each domain; ``promotionBackoffUntil`` from the fleet's recent operations. The
        failover decisions read them from the snapshot.
        """
        recent = await self._ctx.store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
        now = self._ctx.clock()
        ahead = operations_ahead(recent, now=now)
        if ahead:
            self._ahead[fleet.id] = ahead
        domains = []
        changed = False
        for domain in fleet.domains:
            backoff = promotion_backoff(fleet.policy, domain.id, recent, now=now)
            update = {
                "auth_failing": self._heartbeats.auth_failing(domain.id),
                "last_supervisor_error": self._heartbeats.last_error(domain.id),
                "promotion_backoff_until": None if backoff is None else backoff.until,
            }
            if all(getattr(domain, name) == value for name, value in update.items()):
                domains.append(domain)  # already says so: no copy per tick and domain
                continue
            changed = True
            domains.append(domain.model_copy(update=update))
        return fleet.model_copy(update={"domains": tuple(domains)}) if changed else fleet

    async def clamp_future_times(
        self, fleet: FleetSnapshot, operation: Operation | None
    ) -> tuple[FleetSnapshot, Operation | None]:
        """Write ``now`` over stored times from the future, so no decision waits them out.

        Decisions already count such a time as ``now`` (haru_core's clamp); once it is
        rewritten, the time since it grows again, and every process sees the same value.
        """
        now = self._ctx.clock()
        ahead = set(self._ahead.pop(fleet.id, frozenset()))
        if operation is not None:
            ahead |= operations_ahead((operation,), now=now)
        if not ahead and not fleet_times_ahead(fleet, now=now):
            return fleet, operation
        count = await self._ctx.store.clamp_future_times(fleet.id, operation_ids=ahead, at=now)
        if count == 0:
            return fleet, operation
        logger.warning(
            "fleet %s: %d stored row(s) held times from the future (a fast clock wrote them); "
            "clamped to now",
            fleet.slug,
            count,
            extra=log_fields(fleet),
        )
        fresh = None if operation is None else await self._ctx.store.get_operation(operation.id)
        return await self._ctx.load_fleet(str(fleet.id)), fresh if fresh is not None else operation

    async def _confirm_dead(self, fleet: FleetSnapshot) -> FleetSnapshot:
        """Fail the active at once when its heartbeats proved it dead for ``deadConfirmMs``."""
        now = self._ctx.clock()
        active_id = fleet.active_domain_id
        proof = self._dead_proofs.proof_of(active_id)
        if proof is None:
            return fleet
        domain_id = detect_dead_active(fleet, now=now, since=proof.since)
        if domain_id is None:
            return fleet
        payload = DomainDegradedEscalated(
            from_state=DomainState.DEGRADED,
            to_state=DomainState.FAILED,
            degraded_grace_ms=fleet.policy.degraded_grace_ms,
            dead_models=proof.models,
            dead_confirm_ms=fleet.policy.dead_confirm_ms,
            evidence=proof.evidence,
            suspected_at=proof.since,
        )
        if not await self._fail_active(fleet, domain_id, payload, at=now):
            return fleet
        self._dead_proofs.forget(domain_id)
        logger.warning(
            "fleet %s: active domain proven dead (%s: %s), confirmed; failed",
            fleet.slug,
            proof.evidence,
            ", ".join(proof.models),
            extra=log_fields(fleet, domain=domain_id),
        )
        self._ctx.metrics.dead_evidence(fleet.slug, proof.evidence, "confirmed")
        return await self.annotate(await self._ctx.load_fleet(str(fleet.id)))

    async def _escalate(self, fleet: FleetSnapshot) -> FleetSnapshot:
        now = self._ctx.clock()
        domain_id = detect_degraded_escalation(fleet, now=now)
        if domain_id is None:
            return fleet
        payload = DomainDegradedEscalated(
            from_state=DomainState.DEGRADED,
            to_state=DomainState.FAILED,
            degraded_grace_ms=fleet.policy.degraded_grace_ms,
        )
        if not await self._fail_active(fleet, domain_id, payload, at=now):
            return fleet
        logger.warning(
            "fleet %s: degraded active domain escalated to failed",
            fleet.slug,
            extra=log_fields(fleet, domain=fleet.active_domain_id),
        )
        return await self.annotate(await self._ctx.load_fleet(str(fleet.id)))

    async def _fail_active(
        self,
        fleet: FleetSnapshot,
        domain_id: UUID,
        payload: DomainDegradedEscalated,
        *,
        at: datetime,
    ) -> bool:
        """Fail the active domain if the fleet is idle, and record why; whether it landed.

        The guarded write (:meth:`StateStore.escalate_domain_if_fleet_idle`) is the decision,
        and ``payload`` rides it: a replica that lost the race to another one, or to an
        operation, writes no event.
        """
        return await self._ctx.store.escalate_domain_if_fleet_idle(
            domain_id=domain_id,
            fleet_id=fleet.id,
            at=at,
            heartbeat_stale_ms=fleet.policy.heartbeat_stale_ms,
            events=(payload,),
        )

    async def _request_failover(
        self, fleet: FleetSnapshot, answered: frozenset[UUID]
    ) -> Operation | None:
        now = self._ctx.clock()
        # An active that answered this tick's heartbeat is not stale, whatever its recorded
        # lastSeenAt says: the store may have taken longer to record the answer (a SQLite
        # write lock held past heartbeatStaleMs) than the active took to give it.
        decision = detect_failover(fleet, now=now, answered=answered)
        if decision is None:
            return None
        operation, _ = await request_operation(
            self._ctx.store,
            self._ctx.metrics,
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

    async def _restore_confirmed_now(
        self, fleet: FleetSnapshot, domain_id: UUID, reason: str
    ) -> bool:
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
        if self._heartbeats.is_suspect(domain_id):
            return False  # its heartbeats outlive their round (hung?): no call to wait for
        seen = self._heartbeats.latest_answer(domain_id)
        if seen is None or not restore_confirmed(domain, seen, reason):
            return False
        try:
            status = await self._ctx.client.status(
                domain.supervisor_url, timeout_s=self._ctx.options.heartbeat_timeout_s
            )
        except SupervisorCallError:
            return False
        return restore_confirmed(domain, status, reason)

    async def _request_posture_restore(self, fleet: FleetSnapshot) -> Operation | None:
        """Queue a demote of a standby out of posture (backed off per target).

        A supervisor restart stops a standby's trainers; the heartbeat mirrors its training
        slot to ``idle``, and without this nothing would start them again. A failover whose
        ``demote_old_sleep`` timed out while the old active was ``failed`` could not queue its
        restore demote (a failed domain is not demotable); once the domain is ``ready`` again
        with its vLLM proven awake, this queues it.
        """
        if not (restore_candidates(fleet) or awake_standbys(fleet)):
            return None
        now = self._ctx.clock()
        recent = await self._ctx.store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
        for decision in detect_restores(fleet, recent, now=now):
            if await self._restore_confirmed_now(fleet, decision.target_domain_id, decision.reason):
                break
        else:
            return None
        operation, _ = await request_restore_demote(
            self._ctx.store,
            self._ctx.metrics,
            fleet,
            decision.target_domain_id,
            at=now,
            why=f"standby out of standby posture: {decision.reason}",
            cause_operation_id=None,
            reason=decision.reason,
        )
        return operation
