"""Driving an operation (DESIGN 7.3, 7.4): claim it, run its current step, record the result.

One call drives a fleet's in-flight operation by one step, or by several while steps finish at
once (chaining, bounded per tick). The step itself (act on a supervisor, then prove the
effect) is :func:`haru_server._steps.run_step`; this module times the step against its
budget and records its result with ONE operation CAS (the next step, success or failure, each
with its events). What follows that CAS (events written after it, a degraded source, the
promotion backoff, the demote that returns a domain to standby posture) is
:mod:`haru_server._operation_followups`.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING
from uuid import UUID

from haru_core import (
    first_step,
    is_best_effort,
    is_step_overdue,
    next_step,
    step_budget_ms,
    step_remaining_ms,
)
from haru_db import OperationEvent, SlotMirror
from haru_protocol import (
    FleetSnapshot,
    Operation,
    OperationError,
    OperationErrorCode,
    OperationFailed,
    OperationKind,
    OperationStarted,
    OperationState,
    OperationStep,
    OperationStepDone,
    OperationSucceeded,
)

from haru_server._logfields import log_fields
from haru_server._operation_followups import (
    announce_backoff,
    degrade_source,
    operation_event,
    queue_restore_demote,
)
from haru_server._reconcile_context import RECENT_OPERATIONS, ReconcileContext
from haru_server._steps import (
    Done,
    Failed,
    Pending,
    StepContext,
    StepResult,
    entry_mirror,
    route_guard_until,
    run_step,
)

if TYPE_CHECKING:
    from haru_server._proxy import InferenceProxy

logger = logging.getLogger(__name__)


class OperationDriver:
    """Drives in-flight operations step by step, every write a CAS.

    Args:
        ctx: The reconciler's store, client, clock, tuning and metrics.
        proxy: This process's inference proxy, told of each flip made here (None: none runs).
    """

    def __init__(self, ctx: ReconcileContext, proxy: InferenceProxy | None) -> None:
        self._ctx = ctx
        self._proxy = proxy
        self._last_pending: dict[UUID, tuple[UUID, OperationStep, str]] = {}
        """Per fleet: the operation, step and reason of the last pending result seen here."""

    async def drive_operation(
        self, fleet: FleetSnapshot, operation: Operation
    ) -> tuple[Operation, bool]:
        """Advance ``operation`` by one step, or several with chaining.

        Returns:
            The operation's state after the tick, and whether a follow-up operation was queued.
        """
        chain_end = time.monotonic() + self._ctx.options.chain_budget_s
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
            result = await self._run_current_step(fleet, operation, step, entered=step is entered)
            operation, progressed, queued = await self._record_step_result(
                fleet, operation, step, result
            )
            entered = operation.current_step if progressed else None
            if queued or not progressed or operation.state is not OperationState.RUNNING:
                return operation, queued
            if not self._ctx.options.chaining or time.monotonic() >= chain_end:
                return operation, False
            # The same snapshot serves the next step: executors read only what the layout
            # and the operation fix (bindings, URLs, source, policy), and every write they
            # make is guarded by the state it expects, so a racer's progress is never undone.

    async def _claim(self, fleet: FleetSnapshot, operation: Operation) -> Operation | None:
        now = self._ctx.clock()
        step = first_step(operation.kind)
        # The started event lands in the claim's own statement (one write, not two).
        started = OperationEvent.of(
            OperationStarted(kind=operation.kind, target_domain_id=operation.target_domain_id)
        )
        if not await self._ctx.store.claim_operation(
            operation.id,
            first_step=step,
            at=now,
            events=(started,),
            entry_mirror=self._entry_mirror(fleet, operation, step),
        ):
            return None
        self._ctx.metrics.operation_started(operation.kind.value)
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
        fresh = await self._ctx.store.get_operation(operation.id)
        return operation if fresh is None else fresh

    async def _run_current_step(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, *, entered: bool
    ) -> StepResult:
        now = self._ctx.clock()
        started = operation.step_started_at or now
        policy = fleet.policy
        guard_until = await route_guard_until(
            self._ctx.store,
            self._ctx.options.tuning,
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
            return await self._result_on_timeout(fleet, operation, step)
        target = fleet.domain(operation.target_domain_id)
        if target is None:
            return Failed(
                OperationErrorCode.TARGET_MISSING,
                f"target domain {operation.target_domain_id} is no longer part of the fleet",
            )
        remaining = step_remaining_ms(policy, step, started_at=started, now=now)
        ctx = StepContext(
            store=self._ctx.store,
            client=self._ctx.client,
            tuning=self._ctx.options.tuning,
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

    async def _result_on_timeout(
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
            pointer = await self._ctx.store.get_fleet_route_pointer(str(fleet.id))
            at_target = pointer is not None and pointer.active_domain_id == fresh.target_domain_id
            if fresh.routing_committed or at_target:
                return Done(OperationStepDone(step=step, timed_out=True, routing_committed=True))
        message = f"step {step.value} did not finish within its budget of {budget} ms"
        last = self._last_pending.get(fleet.id)
        if last is not None and last[:2] == (operation.id, step):
            # What the step waited for, as this process last saw it (another replica's or a
            # restarted process's last view is not known here).
            message += f"; last seen waiting: {last[2]}"
        return Failed(OperationErrorCode.STEP_TIMEOUT, message)

    async def _record_step_result(
        self,
        fleet: FleetSnapshot,
        operation: Operation,
        step: OperationStep,
        result: StepResult,
    ) -> tuple[Operation, bool, bool]:
        """Record one step result with ONE operation CAS.

        Returns:
            The operation after it, whether this tick's CAS landed, and whether a follow-up
            operation was queued.
        """
        match result:
            case Pending(reason=reason):
                self._last_pending[fleet.id] = (operation.id, step, reason)
                logger.debug(
                    "operation %s step %s pending: %s",
                    operation.id,
                    step.value,
                    reason,
                    extra=log_fields(fleet, operation=operation, step=step),
                )
                return operation, False, False
            case Failed():
                return await self._record_step_failed(fleet, operation, step, result)
            case Done():
                return await self._record_step_done(fleet, operation, step, result)

    async def _record_step_done(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, result: Done
    ) -> tuple[Operation, bool, bool]:
        now = self._ctx.clock()
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
            landed = await self._ctx.store.complete_operation(
                operation.id,
                from_step=step,
                at=now,
                events=(step_done, succeeded) if inline else (),
                exit_mirror=result.mirror,
            )
        else:
            # advance_step returns the new step's fencing token (None: the CAS lost).
            fence = await self._ctx.store.advance_step(
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
            self._ctx.metrics.operation_succeeded(operation.kind.value)
            self._ctx.metrics.operation_ended(
                operation.kind.value,
                outcome="succeeded",
                seconds=(now - operation.created_at).total_seconds(),
            )
        if not inline:
            await degrade_source(self._ctx, fleet, operation, step, now)
            await operation_event(self._ctx, fleet, operation, result.detail, now)
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
            await operation_event(self._ctx, fleet, operation, outcome, now)
        queued = False
        source = operation.source_domain_id
        if result.degrade_source and source is not None and source != operation.target_domain_id:
            # A best-effort demote step ran out of budget (e.g. across a server restart): the
            # old active may be half demoted. A demote finishes the job from what it observes:
            # vLLM proven asleep, then training restarted.
            queued = await queue_restore_demote(
                self._ctx, fleet, source, operation, now, reason=f"{step.value} timed out"
            )
        return await self._reread(operation), True, queued

    def _step_metrics(
        self, operation: Operation, step: OperationStep, outcome: str, now: datetime
    ) -> None:
        started = operation.step_started_at
        seconds = 0.0 if started is None else (now - started).total_seconds()
        self._ctx.metrics.step_resolved(
            operation.kind.value, step.value, outcome=outcome, seconds=seconds
        )

    async def _record_step_failed(
        self, fleet: FleetSnapshot, operation: Operation, step: OperationStep, result: Failed
    ) -> tuple[Operation, bool, bool]:
        now = self._ctx.clock()
        error = OperationError(step=step, code=result.code.value, message=result.message)
        promote = operation.kind is OperationKind.PROMOTE
        failed = OperationFailed(
            step=step,
            code=result.code,
            message=result.message,
            failed_models=result.failed_models,
        )
        landed = await self._ctx.store.fail_operation(
            operation.id,
            error=error,
            at=now,
            expected_step=step,
            # Before the commit point this guard is always true; at switch_active it keeps a
            # fail from undoing a pointer move that landed meanwhile.
            target_not_routed=promote,
            events=(OperationEvent.of(failed),),
        )
        if not landed:
            return await self._reread(operation), False, False
        self._step_metrics(operation, step, "failed", now)
        self._ctx.metrics.operation_failed(operation.kind.value, result.code.value)
        self._ctx.metrics.operation_ended(
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
        queued = False
        if promote:
            await announce_backoff(self._ctx, fleet, operation, now)
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
                queued = await queue_restore_demote(
                    self._ctx,
                    fleet,
                    operation.target_domain_id,
                    operation,
                    now,
                    reason=result.code.value,
                )
        return await self._reread(operation), True, queued
