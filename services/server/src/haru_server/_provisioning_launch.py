"""The provisioner's way up: claim and launch, the launch's outcome, the address, readiness.

Steps 1 to 4 of the lifecycle (:mod:`haru_server._provisioning`): a claimed launch runs as a
background task (a cluster still listed is torn down first); its outcome, or ``sky status``
for a claim this process does not run, marks it launched; ``sky status`` UP gives the
address; the supervisor's first heartbeat (or a ``skyserve`` service's READY replicas) makes
the domain ready. Each has its budget, past which the domain fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Mapping
from datetime import datetime
from typing import Any

from haru_core import clamp_to_now, domain_role
from haru_driver_skypilot import SkyDriverError, SkyTimeoutError, cluster_name
from haru_protocol import (
    DomainAddressRecorded,
    DomainLaunchStarted,
    DomainLaunchSucceeded,
    DomainSnapshot,
    DomainState,
    DomainStateChanged,
    DomainTeardown,
    FleetSnapshot,
    InferenceSlotState,
    Provider,
    ProvisioningFailure,
    SlotKind,
    SlotStateChanged,
)

from haru_server._backends import ABSENT
from haru_server._pki import PkiError
from haru_server._provisioning_base import ProvisionerBase
from haru_server._provisioning_memory import (
    DomainMemory,
    Failure,
    LaunchTask,
    failure_from_error,
    ms,
    settings_of,
)

logger = logging.getLogger(__name__)

_D = DomainState
_I = InferenceSlotState


class LaunchSteps(ProvisionerBase):
    """Steps 1 to 4: from ``provisioning`` to an addressed, ready domain."""

    # ---- step 1: claim and launch --------------------------------------------------------

    async def _launch(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool:
        now = self._clock()
        attempt = domain.launch_attempt + 1
        previous = await self._name(fleet, domain, memory) if domain.launch_attempt else None
        name = cluster_name(fleet.slug, domain.slug)
        role = domain_role(fleet, domain)
        if not await self._store.claim_launch(
            domain.id,
            expected_attempt=domain.launch_attempt,
            at=now,
            events=(DomainLaunchStarted(cluster=name, attempt=attempt, role=role),),
            fleet_id=fleet.id,
        ):
            return True  # another process claimed it (or the row moved): re-read
        memory.name = (attempt, name)
        logger.info("domain %s: launching cluster %s (attempt %d)", domain.slug, name, attempt)
        try:
            secrets = await self._launch_secrets(fleet, domain, attempt, now)
        except PkiError as exc:
            await self._fail(fleet, domain, attempt, Failure("launch_failed", str(exc)), now)
            return True
        try:
            launch = self._backend(domain).launch(
                name, domain, settings_of(domain), role=role, secrets=secrets
            )
        except SkyDriverError as exc:
            await self._fail(fleet, domain, attempt, failure_from_error("launch_failed", exc), now)
            return True
        # Never onto an existing cluster: SkyPilot would reuse it and queue the new job behind
        # the old one, which holds every GPU. Never `serve up` a service still listed:
        # SkyServe answers "Service N already exists." (sky/serve/service.py).
        olds = tuple(dict.fromkeys(n for n in (previous, name) if n is not None))
        launch = self._fresh_launch(fleet, domain, olds, launch)
        task = asyncio.create_task(launch, name=f"haru-launch-{name}-{attempt}")
        memory.launch = LaunchTask(attempt, task)
        memory.addressed_at = None
        return True

    async def _launch_secrets(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, attempt: int, now: datetime
    ) -> Mapping[str, str]:
        """The SkyPilot secrets of launch ``attempt``: the only way anything secret reaches it.

        A ``skypilot`` domain gets the supervisor token and a fresh key and certificate from
        the fleet's CA (so the server knows what to trust before the machine exists). Every
        further name added here is declared in the task and read by its run script.

        Raises:
            PkiError: The certificate cannot be issued (no store key, or the wrong one).
        """
        base = self._base_secrets()
        if domain.provider is not Provider.SKYPILOT:
            return base
        if self._pki is None:
            raise PkiError(
                "this server issues no certificates for skypilot domains (no PKI configured)"
            )
        issued = await self._pki.issue(
            fleet.id, fleet.slug, domain.id, domain.slug, attempt=attempt, now=now
        )
        logger.info(
            "domain %s: issued a certificate for %s (sha256 %s, expires %s)",
            domain.slug,
            issued.server_name,
            issued.fingerprint,
            issued.not_after.isoformat(),
        )
        return {**base, **issued.secrets()}

    async def _fresh_launch(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        names: tuple[str, ...],
        launch: Coroutine[Any, Any, None],
    ) -> None:
        """``sky down`` each of ``names`` that SkyPilot still lists, then run ``launch``.

        At most ``max_concurrent_launches`` of these run at once in this process; the others
        wait here, their ``launchTimeoutMs`` running.
        """
        backend = self._backend(domain)
        try:
            await self._launch_slots.acquire()
        except BaseException:
            launch.close()
            raise
        try:
            for old in names:
                seen = await backend.read_status(old, settings_of(domain))
                if seen.shown == ABSENT:
                    continue
                logger.warning(
                    "domain %s: %s %s is %s before a launch: tearing it down",
                    domain.slug,
                    backend.noun,
                    old,
                    seen.shown,
                )
                await backend.teardown(old)
                await self._event(
                    fleet,
                    domain,
                    DomainTeardown(
                        cluster=old,
                        ok=True,
                        message=f"it was {seen.shown} before a launch: torn down first",
                    ),
                    self._clock(),
                )
            await launch
        except BaseException:
            launch.close()
            raise
        finally:
            self._launch_slots.release()

    # ---- step 2: the launch's outcome ----------------------------------------------------

    async def _await_launch(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool:
        now = self._clock()
        attempt = domain.launch_attempt
        name = await self._name(fleet, domain, memory)
        started = clamp_to_now(domain.launch_started_at or now, now=now)
        overdue = now - started > ms(fleet.policy.launch_timeout_ms)
        launch = memory.launch
        if launch is not None and launch.attempt == attempt:
            if launch.task.done():
                memory.launch = None
                if launch.task.cancelled():
                    failure = Failure("launch_failed", "the launch was cancelled")
                    await self._fail(fleet, domain, attempt, failure, now)
                    return True
                exc = launch.task.exception()
                if exc is None:
                    return await self._launched(fleet, domain, name, now, observed=False)
                reason: ProvisioningFailure = (
                    "launch_timeout" if isinstance(exc, SkyTimeoutError) else "launch_failed"
                )
                await self._fail(fleet, domain, attempt, failure_from_error(reason, exc), now)
                return True
            if not overdue:
                return False
            memory.launch = None
            launch.task.cancel()
            with contextlib.suppress(BaseException):
                await launch.task
            failure = Failure(
                "launch_timeout",
                f"`{self._backend(domain).launch_command}` of {name} ran past launchTimeoutMs "
                f"({fleet.policy.launch_timeout_ms} ms) and was stopped",
            )
            await self._fail(fleet, domain, attempt, failure, now)
            return True
        # A claim this process does not run: it restarted, or another process launches.
        # Never launch this attempt again; SkyPilot says whether it went through.
        seen = await self._reads.status(domain, name, memory)
        if seen is not None and seen.launched:
            return await self._launched(fleet, domain, name, now, observed=True)
        if not overdue:
            return False
        if seen is None and now - started <= 2 * ms(fleet.policy.launch_timeout_ms):
            return False  # SkyPilot's answer is on its way (the background read)
        shown = None if seen is None else seen.shown
        failure = Failure(
            "launch_lost",
            f"no outcome of launch attempt {attempt} of {name} within launchTimeoutMs "
            f"({fleet.policy.launch_timeout_ms} ms); sky status: {shown or 'not read'}",
            cluster_status=shown,
        )
        await self._fail(fleet, domain, attempt, failure, now)
        return True

    async def _launched(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        name: str,
        now: datetime,
        *,
        observed: bool,
    ) -> bool:
        attempt = domain.launch_attempt
        if await self._store.mark_launched(
            domain.id,
            attempt=attempt,
            at=now,
            events=(DomainLaunchSucceeded(cluster=name, attempt=attempt, observed=observed),),
            fleet_id=fleet.id,
        ):
            logger.info("domain %s: cluster %s launched", domain.slug, name)
        return True

    # ---- step 3: UP, then the head's address ---------------------------------------------

    async def _await_up(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool:
        now = self._clock()
        attempt = domain.launch_attempt
        name = await self._name(fleet, domain, memory)
        started = clamp_to_now(domain.launch_started_at or now, now=now)
        backend = self._backend(domain)
        settings = settings_of(domain)
        if now - started > ms(fleet.policy.cluster_up_timeout_ms):
            failure = Failure(
                "cluster_up_timeout",
                f"{backend.noun} {name} was not {backend.awaited(settings)} within "
                f"clusterUpTimeoutMs ({fleet.policy.cluster_up_timeout_ms} ms) of its launch",
            )
            await self._fail(fleet, domain, attempt, failure, now)
            return True
        seen = await self._reads.status(domain, name, memory)
        if seen is None:
            return False
        if seen.lost:
            failure = Failure(
                "cluster_lost",
                f"{backend.noun} {name} is {seen.shown} after its launch",
                cluster_status=seen.shown,
            )
            await self._fail(fleet, domain, attempt, failure, now)
            return True
        if not seen.addressable:
            return False
        address = await backend.address(name, domain, settings, seen)
        if address is None:
            return False
        recorded = await self._store.record_domain_address(
            domain.id,
            attempt=attempt,
            supervisor_url=address.supervisor_url,
            serving_base_url=address.serving_base_url,
            model_urls=address.model_urls,
            at=now,
            events=(
                DomainAddressRecorded(
                    cluster=name,
                    attempt=attempt,
                    supervisor_url=address.supervisor_url,
                    serving_base_url=address.serving_base_url,
                ),
            ),
            fleet_id=fleet.id,
        )
        if recorded:
            memory.addressed_at = now
            logger.info(
                "domain %s: %s %s is %s at %s",
                domain.slug,
                backend.noun,
                name,
                seen.shown,
                address.serving_base_url,
            )
        return True

    # ---- step 4 of a skyserve domain: READY replicas are its readiness -------------------

    async def _service_ready(self, fleet: FleetSnapshot, domain: DomainSnapshot) -> bool:
        """Serve the slots, then the domain is ``ready`` (re-runnable: slots first)."""
        now = self._clock()
        await self._mirror_slots(fleet, domain, (_I.STARTING, _I.FAILED), _I.SERVING, now)
        ready = DomainStateChanged(
            from_state=_D.PROVISIONING, to_state=_D.READY, role=domain_role(fleet, domain)
        )
        if await self._move(fleet, domain, _D.PROVISIONING, _D.READY, ready, now):
            logger.info("domain %s: service ready", domain.slug)
        return True

    async def _mirror_slots(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        from_states: tuple[InferenceSlotState, ...],
        to: InferenceSlotState,
        now: datetime,
    ) -> None:
        """Move a supervisorless domain's inference slots as its service status says."""
        for slot in domain.slots:
            if slot.kind is not SlotKind.INFERENCE or slot.state not in from_states:
                continue
            await self._store.transition_slot(
                slot.id,
                kind=slot.kind,
                from_states=(slot.state,),
                to=to,
                at=now,
                events=(
                    SlotStateChanged(
                        kind=slot.kind,
                        from_state=slot.state.value,
                        to_state=to.value,
                        cause="service",
                    ),
                ),
                fleet_id=fleet.id,
                domain_id=domain.id,
            )

    # ---- step 4: the supervisor's first heartbeat ----------------------------------------

    async def _await_supervisor(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> bool:
        now = self._clock()
        name = await self._name(fleet, domain, memory)
        if memory.addressed_at is None:
            # Recorded by an earlier process: the budget counts from when this one saw it.
            memory.addressed_at = now
        budget = fleet.policy.supervisor_ready_timeout_ms
        if now - memory.addressed_at > ms(budget):
            failure = Failure(
                "supervisor_ready_timeout",
                f"the supervisor of {name} sent no good heartbeat within "
                f"supervisorReadyTimeoutMs ({budget} ms) of the address being recorded",
            )
            await self._fail(fleet, domain, domain.launch_attempt, failure, now)
            return True
        seen = await self._reads.status(domain, name, memory)
        if seen is not None and seen.lost:
            failure = Failure(
                "cluster_lost",
                f"cluster {name} is {seen.shown} while starting",
                cluster_status=seen.shown,
            )
            await self._fail(fleet, domain, domain.launch_attempt, failure, now)
            return True
        return False
