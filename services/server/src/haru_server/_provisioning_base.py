"""What every step of the provisioner shares: its state, a launch's cluster name, the writes.

:class:`ProvisionerBase` holds the store, the clock, the backends, the secrets and this
process's memory of each domain; names the cluster of a domain's launch attempt; and writes
what several steps write: an event, a failed domain (with its cleanup ``sky down``). The
steps themselves are in :mod:`haru_server._provisioning_launch` (launch to ready) and
:mod:`haru_server._provisioning_recovery` (loss, cleanup, relaunch, teardown).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from uuid import UUID

from haru_db import StateStore
from haru_driver_skypilot import SERVING_TOKEN_SECRET, TOKEN_SECRET, DomainDriver, cluster_name
from haru_driver_skyserve import ServiceDriver
from haru_protocol import (
    DomainLaunchStarted,
    DomainProvisioningFailed,
    DomainSnapshot,
    DomainState,
    EventPayload,
    EventType,
    FleetSnapshot,
    Provider,
    ProvisioningFailure,
)

from haru_server._backends import Backend, ClusterBackend, ServiceBackend
from haru_server._clock import Clock
from haru_server._pki import FleetPki
from haru_server._provisioning_memory import Cleanup, DomainMemory, Failure, ProvisionerOptions
from haru_server._sky_status import StatusReads

logger = logging.getLogger(__name__)

_D = DomainState
_CLEANED_AFTER: frozenset[ProvisioningFailure] = frozenset(
    {
        "launch_failed",
        "launch_timeout",
        "launch_lost",
        "cluster_up_timeout",
        "supervisor_ready_timeout",
    }
)
"""Failures after which the cluster is torn down at once: a launch that failed or was killed
may still have (or later bring) a cluster up (SkyPilot keeps a setup failure's cluster UP, and
killing ``sky launch`` does not cancel its request), and one that never got ready bills all
the same. A ``cluster_lost`` cluster is gone or STOPPED: the relaunch downs it first."""


class ProvisionerBase:
    """The state and the shared writes of :class:`~haru_server._provisioning.Provisioner`."""

    def __init__(
        self,
        store: StateStore,
        driver: DomainDriver,
        *,
        clock: Clock,
        supervisor_token: str | Callable[[], str | None] | None,
        serving_token: str | None = None,
        options: ProvisionerOptions | None = None,
        service_driver: ServiceDriver | None = None,
        pki: FleetPki | None = None,
    ) -> None:
        self._store = store
        self._pki = pki
        self._driver = driver
        self._options = options or ProvisionerOptions()
        self._clusters = ClusterBackend(driver)
        self._backends: dict[Provider, Backend] = {Provider.SKYPILOT: self._clusters}
        if service_driver is not None:
            self._backends[Provider.SKYSERVE] = ServiceBackend(
                service_driver,
                clock=lambda: clock().timestamp(),
                no_replica_grace_s=self._options.no_replica_grace_s,
            )
        self._clock = clock
        self._supervisor_token = supervisor_token
        self._serving_token = serving_token
        self._memory: dict[UUID, DomainMemory] = {}
        self._reads = StatusReads(driver, self._clusters, self._backends, self._options)
        self._launch_slots = asyncio.Semaphore(self._options.max_concurrent_launches)

    def _base_secrets(self) -> Mapping[str, str]:
        """The tokens every launch gets; a callable token is asked now (a rotated file)."""
        token = self._supervisor_token
        secrets = {
            TOKEN_SECRET: token() if callable(token) else token,
            SERVING_TOKEN_SECRET: self._serving_token,
        }
        return {k: v for k, v in secrets.items() if v is not None}

    async def _name(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: DomainMemory
    ) -> str:
        """The cluster name of the domain's current launch attempt.

        The name its ``domain.launch.started`` event recorded: a domain launched before names
        became unique (``haru-<fleet>-<domain>``) is still found and torn down under its old
        name. A new launch always takes :func:`~haru_driver_skypilot.cluster_name`.
        """
        attempt = domain.launch_attempt
        cached = memory.name
        if cached is not None and cached[0] == attempt:
            return cached[1]
        name = cluster_name(fleet.slug, domain.slug)
        if attempt > 0:
            page = await self._store.list_domain_events(
                fleet.id, domain.id, types=(EventType.DOMAIN_LAUNCH_STARTED,), limit=1
            )
            data = page[0].data if page else None
            if not isinstance(data, DomainLaunchStarted) or data.attempt != attempt:
                # None of this attempt: pruned, or an older release died before writing it.
                return name
            name = data.cluster
        memory.name = (attempt, name)
        return name

    def _backend(self, domain: DomainSnapshot) -> Backend:
        return self._backends[domain.provider]

    # ---- writes --------------------------------------------------------------------------

    async def _fail(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        attempt: int,
        failure: Failure,
        now: datetime,
    ) -> None:
        memory = self._memory.setdefault(domain.id, DomainMemory())
        name = await self._name(fleet, domain, memory)
        failed = DomainProvisioningFailed(
            cluster=name,
            attempt=attempt,
            reason=failure.reason,
            message=failure.message,
            argv=failure.argv,
            exit_code=failure.exit_code,
            stderr=failure.stderr,
            cluster_status=failure.cluster_status,
        )
        if not await self._move(fleet, domain, domain.state, _D.FAILED, failed, now):
            return
        logger.error(
            "domain %s: provisioning failed (%s): %s", domain.slug, failure.reason, failure.message
        )
        if failure.reason in _CLEANED_AFTER:
            self._start_cleanup(domain, memory, name, failure.reason)

    def _start_cleanup(
        self, domain: DomainSnapshot, memory: DomainMemory, name: str, why: str
    ) -> None:
        """Run ``sky down NAME`` in the background (the failed step drives it to its end)."""
        if memory.cleanup is not None and not memory.cleanup.task.done():
            return
        logger.warning("domain %s: tearing down cluster %s after %s", domain.slug, name, why)
        memory.cleanup = Cleanup(name, why, self._down(domain, name))

    def _down(self, domain: DomainSnapshot, name: str) -> asyncio.Task[None]:
        return asyncio.create_task(
            self._backend(domain).teardown(name), name=f"haru-cleanup-{name}"
        )

    async def _move(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        from_state: DomainState,
        to: DomainState,
        payload: EventPayload,
        now: datetime,
    ) -> bool:
        """Move the domain from ``from_state`` to ``to``, ``payload`` riding the same write."""
        return await self._store.transition_domain(
            domain.id,
            from_states=(from_state,),
            to=to,
            at=now,
            events=(payload,),
            fleet_id=fleet.id,
        )

    async def _event(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, payload: EventPayload, now: datetime
    ) -> None:
        await self._store.append_event(
            fleet_id=fleet.id, payload=payload, at=now, domain_id=domain.id
        )
