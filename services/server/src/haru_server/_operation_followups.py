"""What follows a recorded step result beyond its CAS (DESIGN 7.3, 7.4): events and repairs.

The operation driver (:mod:`haru_server._operation_driver`) records each step result with one
operation CAS; what comes after it lives here: the events written outside that statement, the
source domain degraded after a best-effort step timed out, the promotion backoff announced
after a failed promote, and the demote queued to return a domain to standby posture.
"""

from __future__ import annotations

import logging
from datetime import datetime
from uuid import UUID

from haru_core import CreateOperation, decide_demotion, promotion_backoff
from haru_protocol import (
    DomainState,
    EventPayload,
    FleetSnapshot,
    Operation,
    OperationPromotionBackoff,
    OperationState,
    OperationStep,
    OperationStepTimeoutBestEffort,
)

from haru_server._logfields import log_fields
from haru_server._operation_requests import request_restore_demote
from haru_server._reconcile_context import RECENT_OPERATIONS, ReconcileContext

logger = logging.getLogger(__name__)


async def operation_event(
    ctx: ReconcileContext,
    fleet: FleetSnapshot,
    operation: Operation,
    payload: EventPayload,
    now: datetime,
    *,
    domain_id: UUID | None = None,
) -> None:
    """Append ``payload`` about ``operation`` (its target's, unless ``domain_id`` is given)."""
    await ctx.store.append_event(
        fleet_id=fleet.id,
        payload=payload,
        at=now,
        domain_id=domain_id if domain_id is not None else operation.target_domain_id,
        operation_id=operation.id,
    )


async def degrade_source(
    ctx: ReconcileContext,
    fleet: FleetSnapshot,
    operation: Operation,
    step: OperationStep,
    now: datetime,
) -> None:
    """Mark the source domain degraded after best-effort ``step`` timed out, and say so.

    The event rides the degrade's statement when the source moves; when it does not, nothing
    changed, and the event (``sourceDegraded: false``) is a statement of its own.
    """
    source = operation.source_domain_id
    degraded = False
    if source is not None and source != operation.target_domain_id:
        degraded = await ctx.store.transition_domain(
            source,
            from_states=(DomainState.READY,),
            to=DomainState.DEGRADED,
            at=now,
            events=[_timed_out(step, source, degraded=True)],
            fleet_id=fleet.id,
            operation_id=operation.id,
        )
    logger.warning(
        "operation %s: best-effort step %s timed out; source domain %s %s",
        operation.id,
        step.value,
        source,
        "degraded" if degraded else "left as is",
        extra=log_fields(fleet, domain=source, operation=operation, step=step),
    )
    if not degraded:
        await operation_event(
            ctx, fleet, operation, _timed_out(step, source, degraded=False), now, domain_id=source
        )


def _timed_out(
    step: OperationStep, source: UUID | None, *, degraded: bool
) -> OperationStepTimeoutBestEffort:
    return OperationStepTimeoutBestEffort(
        step=step, source_domain_id=source, source_degraded=degraded
    )


async def announce_backoff(
    ctx: ReconcileContext, fleet: FleetSnapshot, failed: Operation, now: datetime
) -> None:
    """Log and record how long automatic promotions of ``failed``'s target now wait."""
    recent = await ctx.store.list_recent_operations(fleet.id, limit=RECENT_OPERATIONS)
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
    await operation_event(
        ctx,
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


async def queue_restore_demote(
    ctx: ReconcileContext,
    fleet: FleetSnapshot,
    domain_id: UUID,
    cause: Operation,
    now: datetime,
    *,
    reason: str,
) -> bool:
    """Queue a demote that returns ``domain_id`` to standby posture after ``cause``.

    Returns:
        Whether the fleet now has an operation queued or in flight (False: deferred).
    """
    fresh = await ctx.load_fleet(str(fleet.id))
    decision = decide_demotion(fresh, domain_id)
    if not isinstance(decision, CreateOperation):
        # Deferred, not dropped: once the domain is a ready standby again, the posture
        # restore (``FailoverDecisions``) queues the demote if its vLLM is proven awake or
        # its training stopped.
        logger.warning(
            "operation %s: domain cannot be returned to standby yet (%s); its restore "
            "waits until it is demotable",
            cause.id,
            decision.message,
            extra=log_fields(fleet, domain=domain_id, operation=cause),
        )
        return False
    operation, created = await request_restore_demote(
        ctx.store,
        ctx.metrics,
        fleet,
        decision.target_domain_id,
        at=now,
        why=f"restore standby after operation {cause.id}: {reason}",
        cause_operation_id=cause.id,
        reason=reason,
    )
    if not created:
        return operation.state in (OperationState.PENDING, OperationState.RUNNING)
    return True
