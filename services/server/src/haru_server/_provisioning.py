"""The lifecycle of provisioned (``skypilot`` and ``skyserve``) domains, driven by the tick.

:class:`Provisioner` is the facade the reconciler drives: one :meth:`Provisioner.step` per
tick, dispatching each domain by its state. The steps below live in
:mod:`haru_server._provisioning_launch` (1 to 4) and :mod:`haru_server._provisioning_recovery`
(5 to 7), what they share in :mod:`haru_server._provisioning_base`, the SkyPilot status reads
in :mod:`haru_server._sky_status`.

One step machine for both providers; a :class:`~haru_server._backends.Backend` supplies what
differs (``sky launch``/``sky status``/``sky down`` of a cluster, or ``sky serve
up``/``status``/``down`` of a service; see the bottom of this docstring). Each step is
re-runnable after a crash and writes by compare-and-swap:

1. ``provisioning`` with no claim for the current attempt: :meth:`StateStore.claim_launch`
   (attempt N to N + 1; of racing processes one wins), then ``sky launch -d`` runs as a
   background task owned by this process, so the tick never waits for it. Its outcome is
   recorded with :meth:`StateStore.mark_launched`, or the domain fails with an event carrying
   the argv, exit code and bounded stderr. A launch past ``launchTimeoutMs`` is cancelled (its
   process group killed) and the domain fails.
   A cluster still listed under the domain's name is torn down before the launch (SkyPilot
   would reuse it). After a failed, killed or lost launch, a cluster-up or supervisor-ready
   timeout, and spent relaunches, ``sky down`` runs in the background (at most
   :data:`CLEANUP_TRIES` tries, each a ``domain.teardown`` event): killing ``sky launch``
   does not cancel its request, and a setup failure leaves the cluster UP.
2. A claim without ``launched_at`` and no task here (the server restarted, or another process
   launched): ``sky status`` decides. UP counts as launched; anything else waits until the
   launch budget is spent, then the domain fails. The same attempt is never launched twice.
3. Launched, no address: wait for ``sky status`` UP within ``clusterUpTimeoutMs`` (counted
   from the launch's start), then ``sky status --ip`` and
   :meth:`StateStore.record_domain_address` (supervisor, gateway and per-model URLs).
4. Addressed: the heartbeat moves the domain to ``ready`` once the supervisor answers;
   past ``supervisorReadyTimeoutMs`` the domain fails.
5. ``ready``/``degraded``: a cluster that ``sky status`` reports STOPPED or does not know any
   more is lost: the domain fails (auto-failover follows as for any failed active).
6. ``failed`` after a launch, cluster STOPPED or gone, ``relaunch`` on, no operation in
   flight: after an exponential backoff (from the failure) the domain goes back to
   ``provisioning`` and step 1 relaunches it, at most ``relaunchMaxAttempts`` times in a row
   (the count restarts when the domain is ready again or the operator runs ``haru domain
   up``). One event per attempt; the streak is counted from those events, so a restarted
   server continues it. A relaunch whose launch fails stays in the streak and backs off.
   For twice ``clusterUpTimeoutMs`` after the failure the cluster is watched: one still
   listed after a launch that never went through, or INIT past ``clusterUpTimeoutMs``
   (SkyPilot's unhealthy state), is torn down.
7. ``stopping`` (``haru domain down``, or removed by ``haru apply``): ``sky down`` runs as a
   background task; done, the domain is ``stopped`` (``domain.teardown``); failed, an event
   and a new try next tick. A removed domain is read apart from the fleet's snapshot
   (:meth:`StateStore.list_removed_teardowns`) until it is ``stopped``.

A ``skyserve`` domain differs in: the launch is ``sky serve up`` (the same service whatever
the role: replicas never sleep); "launched" is a service SkyServe knows and has not lost;
step 3 waits for the service to be READY with the layout's ``replicas`` READY replicas and
an endpoint, which becomes the serving base URL (no supervisor URL); step 4 needs no
heartbeat: its inference slots go to ``serving`` and the domain to ``ready`` at once; a
service FAILED, FAILED_CLEANUP, CONTROLLER_FAILED, NO_REPLICA, SHUTTING_DOWN or gone is
lost (its slots go to ``failed``); teardown is ``sky serve down``.
"""

from __future__ import annotations

import contextlib
import logging
from uuid import UUID

from haru_driver_skypilot import ClusterInfo, SkyDriverError
from haru_protocol import (
    DomainSnapshot,
    DomainState,
    FleetSnapshot,
    Operation,
    Provider,
)

from haru_server._backends import Observed
from haru_server._provisioning_memory import DomainMemory, ProvisionerOptions, settings_of
from haru_server._provisioning_recovery import RecoverySteps

logger = logging.getLogger(__name__)

_D = DomainState

__all__ = ("Provisioner", "ProvisionerOptions")


class Provisioner(RecoverySteps):
    """Drives the provisioned domains of a fleet one step per tick.

    Args:
        store: The state store.
        driver: The SkyPilot driver (production: :class:`haru_driver_skypilot.SkyPilotDriver`;
            tests run it against a fake ``sky``).
        clock: The application clock (budgets are measured on it).
        supervisor_token: The token the launched supervisors require; passed to ``sky`` as
            the secret ``HARU_SUPERVISOR_TOKEN``, never written anywhere. A callable is asked
            at each launch (the token of a rotated file).
        serving_token: The serving credential the launched gateways require; passed to
            ``sky`` as the secret ``HARU_SERVING_TOKEN`` the same way (a launch without it
            fails: the task asks for that secret).
        options: Tuning.
        service_driver: The SkyServe driver (production:
            :class:`haru_driver_skyserve.SkyServeDriver`); without one, ``skyserve`` domains
            are left alone.
        pki: Issues each ``skypilot`` launch its TLS certificate from the fleet's CA and
            keeps the supervisor client's trust in them; without one (or without its store
            key) a ``skypilot`` domain is never launched: it fails with a clear event.
    """

    async def close(self) -> None:
        """Cancel the launches this process still runs (their ``sky`` process groups die).

        Their claims stay: a later process finds the cluster through ``sky status``.
        """
        tasks = [m.launch.task for m in self._memory.values() if m.launch is not None]
        tasks += self._reads.tasks()
        tasks += [m.teardown for m in self._memory.values() if m.teardown is not None]
        tasks += [m.cleanup.task for m in self._memory.values() if m.cleanup is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def launching(self, domain_id: UUID) -> bool:
        """Whether this process runs a launch of the domain right now."""
        memory = self._memory.get(domain_id)
        return memory is not None and memory.launch is not None and not memory.launch.task.done()

    async def provision_round(self, fleet: FleetSnapshot, in_flight: Operation | None) -> bool:
        """Advance every provisioned domain of ``fleet`` by at most one step.

        A ``sky`` command that fails while reading status is logged and retried next tick
        (never a verdict on its own).

        Returns:
            Whether something was written (the caller re-reads the fleet).
        """
        landed = False
        if self._pki is not None:
            await self._pki.refresh(
                fleet.id,
                fleet.slug,
                {
                    d.id: (d.slug, str(d.supervisor_url))
                    for d in fleet.domains
                    if d.provider is Provider.SKYPILOT
                    and d.supervisor_url is not None
                    and str(d.supervisor_url).startswith("https://")
                },
            )
        driven = [d for d in fleet.domains if d.provider in self._backends]
        # A domain `haru apply` removed is out of the fleet's snapshot; its teardown is not.
        driven += [
            d
            for d in await self._store.list_removed_teardowns(fleet.id)
            if d.provider in self._backends
        ]
        if driven and not self._reads.preflight():
            return False
        for domain in driven:
            try:
                landed |= await self._domain(fleet, domain, in_flight)
            except SkyDriverError as exc:
                logger.warning("domain %s: SkyPilot status read failed: %s", domain.slug, exc)
        self._reads.start_read()
        return landed

    # ---- one domain ----------------------------------------------------------------------

    async def _domain(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, in_flight: Operation | None
    ) -> bool:
        memory = self._memory.setdefault(domain.id, DomainMemory())
        match domain.state:
            case _D.PROVISIONING:
                if self._claim_pending(domain):
                    return await self._launch(fleet, domain, memory)
                if domain.launched_at is None:
                    return await self._await_launch(fleet, domain, memory)
                if domain.serving_base_url is None:
                    return await self._await_up(fleet, domain, memory)
                if not self._backend(domain).has_supervisor:
                    return await self._service_ready(fleet, domain)
                return await self._await_supervisor(fleet, domain, memory)
            case _D.READY | _D.DEGRADED:
                memory.addressed_at = None
                return await self._watch(fleet, domain, memory)
            case _D.FAILED:
                cleaning = await self._cleaning(fleet, domain, memory)
                if cleaning is not None:
                    return cleaning
                return await self._relaunch(fleet, domain, memory, in_flight)
            case _D.STOPPING:
                return await self._teardown(fleet, domain, memory)
            case _:
                return False

    @staticmethod
    def _claim_pending(domain: DomainSnapshot) -> bool:
        # Never launched, or back in `provisioning` (a relaunch, `up`) since the last claim.
        started = domain.launch_started_at
        return domain.launch_attempt == 0 or (
            started is not None and started < domain.state_updated_at
        )

    # ---- operator ------------------------------------------------------------------------

    async def cluster_status(
        self, fleet: FleetSnapshot, domain: DomainSnapshot
    ) -> ClusterInfo | None:
        """``sky status`` of the domain's cluster now (``None``: SkyPilot does not know it).

        Raises:
            haru_driver_skypilot.SkyDriverError: the command failed.
        """
        memory = self._memory.setdefault(domain.id, DomainMemory())
        return await self._driver.get_domain_status(await self._name(fleet, domain, memory))

    def drives(self, domain: DomainSnapshot) -> bool:
        """Whether this provisioner drives ``domain`` (its provider has a backend here)."""
        return domain.provider in self._backends

    async def read_status(self, fleet: FleetSnapshot, domain: DomainSnapshot) -> Observed:
        """SkyPilot's status of the domain's cluster or service now.

        ``shown`` is ``absent`` when SkyPilot does not know it.

        Raises:
            KeyError: the domain's provider is not driven here (see :meth:`drives`).
            haru_driver_skypilot.SkyDriverError: the command failed.
        """
        memory = self._memory.setdefault(domain.id, DomainMemory())
        return await self._backend(domain).read_status(
            await self._name(fleet, domain, memory), settings_of(domain)
        )

    async def cluster_name(self, fleet: FleetSnapshot, domain: DomainSnapshot) -> str:
        """The name of the domain's cluster or service (the one its last launch used)."""
        return await self._name(fleet, domain, self._memory.setdefault(domain.id, DomainMemory()))
