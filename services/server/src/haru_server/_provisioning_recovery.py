"""The provisioner after the way up: loss, cleanup and relaunch of a failed domain, teardown.

Steps 5 to 7 of the lifecycle (:mod:`haru_server._provisioning`): a launched cluster that
SkyPilot reports lost fails its domain; a failed domain's cluster is torn down in the
background (bounded tries) and, when lost, relaunched after the backoff that its relaunch
streak sets (the streak folded from the domain's events by :func:`haru_core.fold_relaunch_streak`,
the decision :func:`haru_core.plan_relaunch`); a stopping domain's cluster is torn down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from datetime import datetime

from haru_core import (
    RELAUNCH_STREAK_EVENTS,
    RelaunchesSpent,
    RelaunchPlan,
    RelaunchStreak,
    domain_role,
    elapsed_since,
    fold_relaunch_streak,
    plan_relaunch,
)
from haru_protocol import (
    DomainClusterLost,
    DomainRelaunch,
    DomainSnapshot,
    DomainState,
    DomainTeardown,
    FleetSnapshot,
    InferenceSlotState,
    Operation,
    Provider,
)

from haru_server._backends import ABSENT
from haru_server._provisioning_launch import LaunchSteps
from haru_server._provisioning_memory import (
    CLEANUP_TRIES,
    MESSAGE_LIMIT,
    CachedStreak,
    DomainMemory,
    failure_from_error,
    ms,
    settings_of,
)

logger = logging.getLogger(__name__)

_D = DomainState
_I = InferenceSlotState
_STREAK_PAGE = 100


class RecoverySteps(LaunchSteps):
    """Steps 5 to 7: a lost cluster, a failed domain's cleanup and relaunch, teardown."""

    # ---- step 5: loss of a launched cluster ----------------------------------------------

    async def _watch(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool:
        if domain.launched_at is None:
            return False
        name = await self._name(fleet, domain, memory)
        seen = await self._reads.status(domain, name, memory)
        if seen is None or not seen.lost:
            return False
        now = self._clock()
        shown = seen.shown
        backend = self._backend(domain)
        lost = DomainClusterLost(
            cluster=name,
            attempt=domain.launch_attempt,
            cluster_status=shown,
            from_state=domain.state,
            role=domain_role(fleet, domain),
        )
        if await self._move(fleet, domain, domain.state, _D.FAILED, lost, now):
            if not backend.has_supervisor:
                # No heartbeat will say it: the service's slots serve no more.
                await self._mirror_slots(fleet, domain, (_I.SERVING,), _I.FAILED, now)
            logger.warning(
                "domain %s: %s %s is %s: domain failed", domain.slug, backend.noun, name, shown
            )
        return True

    # ---- step 6: cleanup of a failed domain's cluster, relaunch --------------------------

    async def _cleaning(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool | None:
        """Drive a cleanup ``sky down`` to its end; ``None`` when none runs."""
        cleanup = memory.cleanup
        if cleanup is None:
            return None
        if not cleanup.task.done():
            return False
        now = self._clock()
        exc = RuntimeError("cancelled") if cleanup.task.cancelled() else cleanup.task.exception()
        why = f"torn down because {cleanup.why}"
        if exc is None:
            memory.cleanup = None
            memory.status_read_at = None  # what is left, read at once
            memory.status_asked_at = None
            logger.info("domain %s: cluster %s %s", domain.slug, cleanup.name, why)
            await self._event(
                fleet, domain, DomainTeardown(cluster=cleanup.name, ok=True, message=why), now
            )
            return True
        failure = failure_from_error("launch_failed", exc)
        message = f"{why}: try {cleanup.tries} of {CLEANUP_TRIES} failed: {failure.message}"
        logger.error("domain %s: cluster %s not %s", domain.slug, cleanup.name, message)
        await self._event(
            fleet,
            domain,
            DomainTeardown(
                cluster=cleanup.name,
                ok=False,
                message=message[:MESSAGE_LIMIT],
                argv=failure.argv,
                exit_code=failure.exit_code,
                stderr=failure.stderr,
            ),
            now,
        )
        if cleanup.tries >= CLEANUP_TRIES:
            memory.cleanup = None  # given up: the failed step may find it again
        else:
            cleanup.tries += 1
            cleanup.task = self._down(domain, cleanup.name)
        return True

    async def _relaunch(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        memory: DomainMemory,
        in_flight: Operation | None,
    ) -> bool:
        now = self._clock()
        name = await self._name(fleet, domain, memory)
        policy = fleet.policy
        up_budget = ms(policy.cluster_up_timeout_ms)
        since = elapsed_since(domain.state_updated_at, now=now)
        # A failed domain's cluster is watched for twice clusterUpTimeoutMs after the failure:
        # a killed launch's request can still bring it up, and an INIT cluster that stays INIT
        # past clusterUpTimeoutMs is unhealthy, not launching.
        watching = domain.provider is Provider.SKYPILOT and since <= 2 * up_budget
        relaunching = settings_of(domain).relaunch and in_flight is None
        plan: RelaunchPlan | None = None
        if relaunching:
            cached = await self._streak(fleet, domain, memory)
            decided = plan_relaunch(
                policy,
                cached.streak,
                launched=domain.launched_at is not None,
                failed_at=domain.state_updated_at,
            )
            if isinstance(decided, RelaunchesSpent):
                if decided.announce:
                    cached.streak = replace(cached.streak, exhausted=True)
                    await self._give_up(fleet, domain, memory, name, decided.relaunches, now)
            else:
                plan = decided
        due = plan is not None and plan.due(now)
        if not (due or watching):
            return False
        seen = await self._reads.status(domain, name, memory)
        if seen is None:
            return False
        if domain.provider is Provider.SKYPILOT and seen.shown != ABSENT:
            if domain.launched_at is None:
                self._start_cleanup(domain, memory, name, f"a failed launch left it {seen.shown}")
                return False
            if seen.shown == "INIT" and since > up_budget:
                self._start_cleanup(domain, memory, name, "it stayed INIT past clusterUpTimeoutMs")
                return False
        if plan is None or not due or not seen.lost:
            # Still there (UP/INIT): not lost; what failed is for the heartbeat or the operator.
            return False
        relaunch = DomainRelaunch(
            cluster=name,
            relaunch=plan.relaunch,
            max_attempts=policy.relaunch_max_attempts,
            backoff_ms=plan.backoff_ms,
        )
        if not await self._move(fleet, domain, _D.FAILED, _D.PROVISIONING, relaunch, now):
            return True
        memory.streak = None
        logger.warning(
            "domain %s: relaunching %s (%d of %d)",
            domain.slug,
            name,
            plan.relaunch,
            policy.relaunch_max_attempts,
        )
        back = domain.model_copy(update={"state": _D.PROVISIONING, "state_updated_at": now})
        return await self._launch(fleet, back, memory)

    async def _give_up(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        memory: DomainMemory,
        name: str,
        relaunches: int,
        now: datetime,
    ) -> None:
        """Say once that the relaunches are spent, and tear down what is left of the cluster."""
        logger.error(
            "domain %s: %d relaunches of %s spent; it stays failed", domain.slug, relaunches, name
        )
        await self._event(
            fleet,
            domain,
            DomainRelaunch(
                cluster=name,
                relaunch=relaunches,
                max_attempts=fleet.policy.relaunch_max_attempts,
                backoff_ms=0,
                exhausted=True,
            ),
            now,
        )
        self._start_cleanup(domain, memory, name, "the relaunches were spent")

    async def _streak(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> CachedStreak:
        """The relaunches (and whether giving up was said) since the domain was last ready.

        Counted from the store's events, newest first, back to the last ``ready`` or
        ``haru domain up``, so a server restart continues the streak and its bound.
        """
        cached = memory.streak
        if cached is not None and cached.since == domain.state_updated_at:
            return cached
        streak = RelaunchStreak()
        before: int | None = None
        while True:
            page = await self._store.list_domain_events(
                fleet.id, domain.id, types=RELAUNCH_STREAK_EVENTS, before=before, limit=_STREAK_PAGE
            )
            streak = fold_relaunch_streak((event.data for event in page), streak)
            if streak.complete or len(page) < _STREAK_PAGE:
                break
            before = page[-1].id
        memory.streak = CachedStreak(domain.state_updated_at, streak)
        return memory.streak

    # ---- step 7: teardown ----------------------------------------------------------------

    async def _teardown(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool:
        name = await self._name(fleet, domain, memory)
        launch, memory.launch = memory.launch, None
        if launch is not None:
            launch.task.cancel()
            with contextlib.suppress(BaseException):
                await launch.task
        task = memory.teardown
        if task is None:
            memory.teardown = asyncio.create_task(
                self._backend(domain).teardown(name), name=f"haru-down-{name}"
            )
            return False
        if not task.done():
            return False
        memory.teardown = None
        now = self._clock()
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or exc is not None:
            failure = failure_from_error(
                "launch_failed", exc if exc is not None else RuntimeError("cancelled")
            )
            logger.error(
                "domain %s: %s of %s failed: %s",
                domain.slug,
                self._backend(domain).teardown_command,
                name,
                failure.message,
            )
            await self._event(
                fleet,
                domain,
                DomainTeardown(
                    cluster=name,
                    ok=False,
                    message=failure.message,
                    argv=failure.argv,
                    exit_code=failure.exit_code,
                    stderr=failure.stderr,
                ),
                now,
            )
            return False
        torn_down = DomainTeardown(cluster=name, ok=True)
        if await self._move(fleet, domain, _D.STOPPING, _D.STOPPED, torn_down, now):
            logger.info("domain %s: cluster %s torn down", domain.slug, name)
        return True
