"""The lifecycle of provisioned (``skypilot`` and ``skyserve``) domains, driven by the tick.

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

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from haru_db import StateStore
from haru_driver_skypilot import (
    SERVING_TOKEN_SECRET,
    TOKEN_SECRET,
    ClusterInfo,
    DomainDriver,
    SkyCliError,
    SkyCommandError,
    SkyDriverError,
    SkyTimeoutError,
    cluster_name,
)
from haru_driver_skyserve import ServiceDriver
from haru_protocol import (
    DomainAddressRecorded,
    DomainClusterLost,
    DomainLaunchStarted,
    DomainLaunchSucceeded,
    DomainProvisioningFailed,
    DomainRelaunch,
    DomainSnapshot,
    DomainState,
    DomainStateChanged,
    DomainTeardown,
    DomainUpRequested,
    EventPayload,
    EventType,
    FleetSnapshot,
    InferenceSlotState,
    Operation,
    Provider,
    Provisioning,
    ProvisioningFailure,
    SlotKind,
    SlotStateChanged,
)

from haru_server._backends import (
    ABSENT,
    NO_REPLICA_GRACE_S,
    Backend,
    ClusterBackend,
    Observed,
    ServiceBackend,
)
from haru_server._clock import Clock
from haru_server._pki import FleetPki, PkiError

logger = logging.getLogger(__name__)

MESSAGE_LIMIT = 1024
"""Longest message kept in a ``domain.provisioning.failed`` event."""

_D = DomainState
_I = InferenceSlotState
_STREAK_EVENTS = frozenset(
    {EventType.DOMAIN_RELAUNCH, EventType.DOMAIN_STATE_CHANGED, EventType.DOMAIN_UP_REQUESTED}
)
"""The events a relaunch streak is read from: relaunches, back to a ``ready`` or an ``up``."""
_STREAK_PAGE = 100
CLEANUP_TRIES = 3
"""How many times one cleanup ``sky down`` runs before it is given up (each failure an event)."""
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


MAX_CONCURRENT_LAUNCHES = 4
"""Launches one process runs at once; more wait their turn. A local SkyPilot API server runs
at most 4 launch-type requests at once (``sky/server/requests/executor.py``, the long
request queue), and a launch queued there would spend its ``launchTimeoutMs`` invisibly."""
PREFLIGHT_RETRY_S = 60.0
"""Seconds before a failed ``sky`` preflight is tried again."""


@dataclass(frozen=True, slots=True)
class ProvisionerOptions:
    """Tuning of the provisioned-domain lifecycle.

    Attributes:
        status_interval_s: Least seconds between two batched ``sky status`` reads (one call
            for every ``skypilot`` cluster this process watches, in the background: the tick
            never waits for it). 0 reads as soon as the last read ended.
        refresh: Read with ``--refresh`` (SkyPilot asks the clouds now). Without it the API
            server answers from its cache, refreshed about once a minute and never for a
            cluster with a running launch request, so a preemption shows up to a minute
            late.
        max_concurrent_launches: Launches run at once by this process (the rest queue).
        no_replica_grace_s: How long a ``skyserve`` service may show NO_REPLICA before it
            counts as lost.
        preflight: Check ``sky`` (version, API server) before the first command.
    """

    status_interval_s: float = 10.0
    refresh: bool = True
    max_concurrent_launches: int = MAX_CONCURRENT_LAUNCHES
    no_replica_grace_s: float = NO_REPLICA_GRACE_S
    preflight: bool = True


@dataclass(slots=True)
class _Reads:
    """The batched ``sky status`` reads of every ``skypilot`` cluster this process watches.

    A domain that wants a status names its cluster in ``wanted``; one background read asks
    SkyPilot about all of them; a domain takes a result only from a read that started after
    it asked (``results`` keeps each name's latest, with its read's start).
    """

    wanted: set[str]
    results: dict[str, tuple[float, Observed]]
    task: asyncio.Task[None] | None = None
    started_at: float | None = None


@dataclass(slots=True)
class _Launch:
    attempt: int
    task: asyncio.Task[None]


@dataclass(slots=True)
class _Streak:
    """The relaunch streak of a failed domain, read from the store once per failure.

    ``since`` is the ``state_updated_at`` it was read at: a newer one (the domain moved)
    makes it stale.
    """

    since: datetime
    relaunches: int
    exhausted: bool


@dataclass(slots=True)
class _Cleanup:
    """A ``sky down`` of a failed domain's cluster, retried up to :data:`CLEANUP_TRIES`."""

    name: str
    why: str
    task: asyncio.Task[None]
    tries: int = 1


@dataclass(slots=True)
class _Memory:
    """What this process knows of one domain beyond the store."""

    launch: _Launch | None = None
    teardown: asyncio.Task[None] | None = None
    cleanup: _Cleanup | None = None
    status_read_at: float | None = None
    addressed_at: datetime | None = None
    status_asked_at: float | None = None
    """When the domain asked the batched read for its cluster's status (monotonic)."""
    streak: _Streak | None = None
    name: tuple[int, str] | None = None
    """The cluster name of launch attempt N, as ``(N, name)``."""


@dataclass(frozen=True, slots=True)
class _Failure:
    reason: ProvisioningFailure
    message: str
    argv: tuple[str, ...] | None = None
    exit_code: int | None = None
    stderr: str | None = None
    cluster_status: str | None = None


def _failure_from_error(reason: ProvisioningFailure, exc: BaseException) -> _Failure:
    message = (str(exc) or type(exc).__name__)[:MESSAGE_LIMIT]
    if isinstance(exc, SkyCliError):
        return _Failure(reason, message, exc.argv, exc.returncode, exc.stderr or exc.stdout_tail)
    if isinstance(exc, SkyCommandError):
        return _Failure(reason, message, exc.argv)
    return _Failure(reason, message)


def _ms(value: int) -> timedelta:
    return timedelta(milliseconds=value)


def _role(fleet: FleetSnapshot, domain: DomainSnapshot) -> Literal["active", "standby"]:
    return "active" if fleet.active_domain_id == domain.id else "standby"


class Provisioner:
    """Drives the provisioned domains of a fleet one step per tick.

    Args:
        store: The state store.
        driver: The SkyPilot driver (production: :class:`haru_driver_skypilot.SkyPilotDriver`;
            tests run it against a fake ``sky``).
        clock: The application clock (budgets are measured on it).
        supervisor_token: The token the launched supervisors require; passed to ``sky`` as
            the secret ``HARU_SUPERVISOR_TOKEN``, never written anywhere.
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

    def __init__(
        self,
        store: StateStore,
        driver: DomainDriver,
        *,
        clock: Clock,
        supervisor_token: str | None,
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
        secrets = {TOKEN_SECRET: supervisor_token, SERVING_TOKEN_SECRET: serving_token}
        self._secrets: Mapping[str, str] = {k: v for k, v in secrets.items() if v is not None}
        self._memory: dict[UUID, _Memory] = {}
        self._reads = _Reads(wanted=set(), results={})
        self._launch_slots = asyncio.Semaphore(self._options.max_concurrent_launches)
        self._preflight_ok = not self._options.preflight
        self._preflight_at: float | None = None
        self._preflight_task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Cancel the launches this process still runs (their ``sky`` process groups die).

        Their claims stay: a later process finds the cluster through ``sky status``.
        """
        tasks = [m.launch.task for m in self._memory.values() if m.launch is not None]
        tasks += [t for t in (self._reads.task, self._preflight_task) if t is not None]
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

    async def step(self, fleet: FleetSnapshot, in_flight: Operation | None) -> bool:
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
        if driven and not self._preflight():
            return False
        for domain in driven:
            try:
                landed |= await self._domain(fleet, domain, in_flight)
            except SkyDriverError as exc:
                logger.warning("domain %s: SkyPilot status read failed: %s", domain.slug, exc)
        return landed

    # ---- one domain ----------------------------------------------------------------------

    async def _domain(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, in_flight: Operation | None
    ) -> bool:
        memory = self._memory.setdefault(domain.id, _Memory())
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

    async def _name(self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory) -> str:
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
                return name  # claimed, its event not written yet: a new launch's name
            name = data.cluster
        memory.name = (attempt, name)
        return name

    def _settings(self, domain: DomainSnapshot) -> Provisioning:
        return domain.provisioning if domain.provisioning is not None else Provisioning()

    def _backend(self, domain: DomainSnapshot) -> Backend:
        return self._backends[domain.provider]

    def _preflight(self) -> bool:
        """Whether ``sky`` passed its check; starts the check in the background if due.

        The check (``sky --version``, ``sky api info``, maybe ``sky api start``) runs once,
        off the tick; a failure is logged and tried again after :data:`PREFLIGHT_RETRY_S`.
        """
        if self._preflight_ok:
            return True
        task = self._preflight_task
        if task is not None and not task.done():
            return False
        mono = time.monotonic()
        if self._preflight_at is not None and mono - self._preflight_at < PREFLIGHT_RETRY_S:
            return False
        self._preflight_at = mono
        self._preflight_task = asyncio.create_task(self._check_sky(), name="haru-sky-preflight")
        return False

    async def _check_sky(self) -> None:
        try:
            info = await self._driver.preflight()
        except SkyDriverError as exc:
            # The message is the diagnosis: no traceback.
            logger.error("SkyPilot cannot be used, provisioned domains wait: %s", exc)  # noqa: TRY400
            return
        logger.info(
            "SkyPilot %s, API server %s at %s%s",
            info.client_version,
            info.server_version or "of unknown version",
            info.server_url or "an unknown URL",
            " (started by Haru, without Haru's environment)" if info.started else "",
        )
        self._preflight_ok = True

    async def _status(self, domain: DomainSnapshot, name: str, memory: _Memory) -> Observed | None:
        """What SkyPilot says of ``name``; None while no read newer than the ask has ended.

        A ``skypilot`` cluster is read by the batched background read (:meth:`_read_all`):
        the tick never waits for ``sky``. A ``skyserve`` service is read here, at most once
        per ``status_interval_s``.
        """
        mono = time.monotonic()
        if domain.provider is not Provider.SKYPILOT:
            last = memory.status_read_at
            if last is not None and mono - last < self._options.status_interval_s:
                return None
            memory.status_read_at = mono
            return await self._backend(domain).observe(name, self._settings(domain))
        if memory.status_asked_at is None:
            memory.status_asked_at = mono
        got = self._reads.results.get(name)
        if got is not None and got[0] >= memory.status_asked_at:
            memory.status_asked_at = None
            return got[1]
        self._reads.wanted.add(name)
        self._start_read(mono)
        return None

    def _start_read(self, mono: float) -> None:
        reads = self._reads
        if reads.task is not None and not reads.task.done():
            return
        last = reads.started_at
        if last is not None and mono - last < self._options.status_interval_s:
            return
        names = sorted(reads.wanted)
        if not names:
            return
        reads.wanted = set()
        reads.started_at = mono
        reads.task = asyncio.create_task(self._read_all(names, mono), name="haru-sky-status")

    async def _read_all(self, names: list[str], started: float) -> None:
        """One ``sky status N1 N2 ... [--refresh] -o json``; bounded by the status timeout."""
        try:
            seen = await self._clusters.observe_many(names, refresh=self._options.refresh)
        except SkyDriverError as exc:
            logger.warning("SkyPilot status read of %d cluster(s) failed: %s", len(names), exc)
            self._reads.wanted.update(names)  # asked again by the next read
            return
        for name, observed in seen.items():
            self._reads.results[name] = (started, observed)

    # ---- step 1: claim and launch --------------------------------------------------------

    async def _launch(self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory) -> bool:
        now = self._clock()
        attempt = domain.launch_attempt + 1
        previous = await self._name(fleet, domain, memory) if domain.launch_attempt else None
        name = cluster_name(fleet.slug, domain.slug)
        if not await self._store.claim_launch(
            domain.id, expected_attempt=domain.launch_attempt, at=now
        ):
            return True  # another process claimed it (or the row moved): re-read
        memory.name = (attempt, name)
        role = _role(fleet, domain)
        logger.info("domain %s: launching cluster %s (attempt %d)", domain.slug, name, attempt)
        await self._event(
            fleet,
            domain,
            DomainLaunchStarted(cluster=name, attempt=attempt, role=role),
            now,
        )
        try:
            secrets = await self._launch_secrets(fleet, domain, attempt, now)
        except PkiError as exc:
            await self._fail(fleet, domain, attempt, _Failure("launch_failed", str(exc)), now)
            return True
        try:
            launch = self._backend(domain).launch(
                name, domain, self._settings(domain), role=role, secrets=secrets
            )
        except SkyDriverError as exc:
            await self._fail(fleet, domain, attempt, _failure_from_error("launch_failed", exc), now)
            return True
        # Never onto an existing cluster: SkyPilot would reuse it and queue the new job behind
        # the old one, which holds every GPU. Never `serve up` a service still listed:
        # SkyServe answers "Service N already exists." (sky/serve/service.py).
        olds = tuple(dict.fromkeys(n for n in (previous, name) if n is not None))
        launch = self._fresh_launch(fleet, domain, olds, launch)
        task = asyncio.create_task(launch, name=f"haru-launch-{name}-{attempt}")
        memory.launch = _Launch(attempt, task)
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
        if domain.provider is not Provider.SKYPILOT:
            return self._secrets
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
        return {**self._secrets, **issued.secrets()}

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
                seen = await backend.observe(old, self._settings(domain))
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
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory
    ) -> bool:
        now = self._clock()
        attempt = domain.launch_attempt
        name = await self._name(fleet, domain, memory)
        started = domain.launch_started_at or now
        overdue = now - started > _ms(fleet.policy.launch_timeout_ms)
        launch = memory.launch
        if launch is not None and launch.attempt == attempt:
            if launch.task.done():
                memory.launch = None
                if launch.task.cancelled():
                    failure = _Failure("launch_failed", "the launch was cancelled")
                    await self._fail(fleet, domain, attempt, failure, now)
                    return True
                exc = launch.task.exception()
                if exc is None:
                    return await self._launched(fleet, domain, name, now, observed=False)
                reason: ProvisioningFailure = (
                    "launch_timeout" if isinstance(exc, SkyTimeoutError) else "launch_failed"
                )
                await self._fail(fleet, domain, attempt, _failure_from_error(reason, exc), now)
                return True
            if not overdue:
                return False
            memory.launch = None
            launch.task.cancel()
            with contextlib.suppress(BaseException):
                await launch.task
            failure = _Failure(
                "launch_timeout",
                f"`{self._backend(domain).launch_command}` of {name} ran past launchTimeoutMs "
                f"({fleet.policy.launch_timeout_ms} ms) and was stopped",
            )
            await self._fail(fleet, domain, attempt, failure, now)
            return True
        # A claim this process does not run: it restarted, or another process launches.
        # Never launch this attempt again; SkyPilot says whether it went through.
        seen = await self._status(domain, name, memory)
        if seen is not None and seen.launched:
            return await self._launched(fleet, domain, name, now, observed=True)
        if not overdue:
            return False
        if seen is None and now - started <= 2 * _ms(fleet.policy.launch_timeout_ms):
            return False  # SkyPilot's answer is on its way (the background read)
        shown = None if seen is None else seen.shown
        failure = _Failure(
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
        if await self._store.mark_launched(domain.id, attempt=attempt, at=now):
            logger.info("domain %s: cluster %s launched", domain.slug, name)
            await self._event(
                fleet,
                domain,
                DomainLaunchSucceeded(cluster=name, attempt=attempt, observed=observed),
                now,
            )
        return True

    # ---- step 3: UP, then the head's address ---------------------------------------------

    async def _await_up(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory
    ) -> bool:
        now = self._clock()
        attempt = domain.launch_attempt
        name = await self._name(fleet, domain, memory)
        started = domain.launch_started_at or now
        backend = self._backend(domain)
        settings = self._settings(domain)
        if now - started > _ms(fleet.policy.cluster_up_timeout_ms):
            failure = _Failure(
                "cluster_up_timeout",
                f"{backend.noun} {name} was not {backend.awaited(settings)} within "
                f"clusterUpTimeoutMs ({fleet.policy.cluster_up_timeout_ms} ms) of its launch",
            )
            await self._fail(fleet, domain, attempt, failure, now)
            return True
        seen = await self._status(domain, name, memory)
        if seen is None:
            return False
        if seen.lost:
            failure = _Failure(
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
            await self._event(
                fleet,
                domain,
                DomainAddressRecorded(
                    cluster=name,
                    attempt=attempt,
                    supervisor_url=address.supervisor_url,
                    serving_base_url=address.serving_base_url,
                ),
                now,
            )
        return True

    # ---- step 4 of a skyserve domain: READY replicas are its readiness -------------------

    async def _service_ready(self, fleet: FleetSnapshot, domain: DomainSnapshot) -> bool:
        """Serve the slots, then the domain is ``ready`` (re-runnable: slots first)."""
        now = self._clock()
        await self._mirror_slots(fleet, domain, (_I.STARTING, _I.FAILED), _I.SERVING, now)
        if not await self._store.transition_domain(
            domain.id, from_states=(_D.PROVISIONING,), to=_D.READY, at=now
        ):
            return True
        logger.info("domain %s: service ready", domain.slug)
        await self._event(
            fleet,
            domain,
            DomainStateChanged(
                from_state=_D.PROVISIONING, to_state=_D.READY, role=_role(fleet, domain)
            ),
            now,
        )
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
            if await self._store.transition_slot(
                slot.id, kind=slot.kind, from_states=(slot.state,), to=to, at=now
            ):
                await self._store.append_event(
                    fleet_id=fleet.id,
                    payload=SlotStateChanged(
                        kind=slot.kind,
                        from_state=slot.state.value,
                        to_state=to.value,
                        cause="service",
                    ),
                    at=now,
                    domain_id=domain.id,
                    slot_id=slot.id,
                )

    # ---- step 4: the supervisor's first heartbeat ----------------------------------------

    async def _await_supervisor(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory
    ) -> bool:
        now = self._clock()
        name = await self._name(fleet, domain, memory)
        if memory.addressed_at is None:
            # Recorded by an earlier process: the budget counts from when this one saw it.
            memory.addressed_at = now
        budget = fleet.policy.supervisor_ready_timeout_ms
        if now - memory.addressed_at > _ms(budget):
            failure = _Failure(
                "supervisor_ready_timeout",
                f"the supervisor of {name} sent no good heartbeat within "
                f"supervisorReadyTimeoutMs ({budget} ms) of the address being recorded",
            )
            await self._fail(fleet, domain, domain.launch_attempt, failure, now)
            return True
        seen = await self._status(domain, name, memory)
        if seen is not None and seen.lost:
            failure = _Failure(
                "cluster_lost",
                f"cluster {name} is {seen.shown} while starting",
                cluster_status=seen.shown,
            )
            await self._fail(fleet, domain, domain.launch_attempt, failure, now)
            return True
        return False

    # ---- step 5: loss of a launched cluster ----------------------------------------------

    async def _watch(self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory) -> bool:
        if domain.launched_at is None:
            return False
        name = await self._name(fleet, domain, memory)
        seen = await self._status(domain, name, memory)
        if seen is None or not seen.lost:
            return False
        now = self._clock()
        shown = seen.shown
        backend = self._backend(domain)
        moved = await self._store.transition_domain(
            domain.id, from_states=(domain.state,), to=_D.FAILED, at=now
        )
        if moved:
            if not backend.has_supervisor:
                # No heartbeat will say it: the service's slots serve no more.
                await self._mirror_slots(fleet, domain, (_I.SERVING,), _I.FAILED, now)
            logger.warning(
                "domain %s: %s %s is %s: domain failed", domain.slug, backend.noun, name, shown
            )
            await self._event(
                fleet,
                domain,
                DomainClusterLost(
                    cluster=name,
                    attempt=domain.launch_attempt,
                    cluster_status=shown,
                    from_state=domain.state,
                    role=_role(fleet, domain),
                ),
                now,
            )
        return True

    # ---- step 6: cleanup of a failed domain's cluster, relaunch --------------------------

    async def _cleaning(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory
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
        failure = _failure_from_error("launch_failed", exc)
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
        memory: _Memory,
        in_flight: Operation | None,
    ) -> bool:
        now = self._clock()
        name = await self._name(fleet, domain, memory)
        policy = fleet.policy
        up_budget = _ms(policy.cluster_up_timeout_ms)
        since = now - domain.state_updated_at
        # A failed domain's cluster is watched for twice clusterUpTimeoutMs after the failure:
        # a killed launch's request can still bring it up, and an INIT cluster that stays INIT
        # past clusterUpTimeoutMs is unhealthy, not launching.
        watching = domain.provider is Provider.SKYPILOT and since <= 2 * up_budget
        relaunching = self._settings(domain).relaunch and in_flight is None
        backoff_ms = 0
        streak: _Streak | None = None
        if relaunching:
            streak = await self._streak(fleet, domain, memory)
            # A first launch that failed is the operator's call; a relaunch that failed
            # (a capacity error right after a preemption) is part of the streak.
            relaunching = domain.launched_at is not None or streak.relaunches > 0
        if streak is not None and relaunching:
            if streak.relaunches >= policy.relaunch_max_attempts:
                relaunching = False
                if not streak.exhausted:
                    streak.exhausted = True
                    await self._give_up(fleet, domain, memory, name, streak.relaunches, now)
            else:
                backoff_ms = min(
                    policy.relaunch_backoff_base_ms * 2**streak.relaunches,
                    policy.relaunch_backoff_max_ms,
                )
        due = relaunching and now >= domain.state_updated_at + _ms(backoff_ms)
        if not (due or watching):
            return False
        seen = await self._status(domain, name, memory)
        if seen is None:
            return False
        if domain.provider is Provider.SKYPILOT and seen.shown != ABSENT:
            if domain.launched_at is None:
                self._start_cleanup(domain, memory, name, f"a failed launch left it {seen.shown}")
                return False
            if seen.shown == "INIT" and since > up_budget:
                self._start_cleanup(domain, memory, name, "it stayed INIT past clusterUpTimeoutMs")
                return False
        if not due or streak is None or not seen.lost:
            # Still there (UP/INIT): not lost; what failed is for the heartbeat or the operator.
            return False
        if not await self._store.transition_domain(
            domain.id, from_states=(_D.FAILED,), to=_D.PROVISIONING, at=now
        ):
            return True
        memory.streak = None
        relaunch = streak.relaunches + 1
        logger.warning(
            "domain %s: relaunching %s (%d of %d)",
            domain.slug,
            name,
            relaunch,
            policy.relaunch_max_attempts,
        )
        await self._event(
            fleet,
            domain,
            DomainRelaunch(
                cluster=name,
                relaunch=relaunch,
                max_attempts=policy.relaunch_max_attempts,
                backoff_ms=backoff_ms,
            ),
            now,
        )
        back = domain.model_copy(update={"state": _D.PROVISIONING, "state_updated_at": now})
        return await self._launch(fleet, back, memory)

    async def _give_up(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        memory: _Memory,
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
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory
    ) -> _Streak:
        """The relaunches (and whether giving up was said) since the domain was last ready.

        Counted from the store's events, newest first, back to the last ``ready`` or
        ``haru domain up``, so a server restart continues the streak and its bound.
        """
        cached = memory.streak
        if cached is not None and cached.since == domain.state_updated_at:
            return cached
        relaunches = 0
        exhausted = False
        before: int | None = None
        reset = False
        while not reset:
            page = await self._store.list_domain_events(
                fleet.id, domain.id, types=_STREAK_EVENTS, before=before, limit=_STREAK_PAGE
            )
            for event in page:
                data = event.data
                if isinstance(data, DomainUpRequested) or (
                    isinstance(data, DomainStateChanged) and data.to_state is _D.READY
                ):
                    reset = True
                    break
                if isinstance(data, DomainRelaunch):
                    exhausted |= data.exhausted
                    relaunches += not data.exhausted
            if len(page) < _STREAK_PAGE:
                break
            before = page[-1].id
        memory.streak = _Streak(domain.state_updated_at, relaunches, exhausted)
        return memory.streak

    # ---- step 7: teardown ----------------------------------------------------------------

    async def _teardown(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, memory: _Memory
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
            failure = _failure_from_error(
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
        if await self._store.transition_domain(
            domain.id, from_states=(_D.STOPPING,), to=_D.STOPPED, at=now
        ):
            logger.info("domain %s: cluster %s torn down", domain.slug, name)
            await self._event(fleet, domain, DomainTeardown(cluster=name, ok=True), now)
        return True

    # ---- operator ------------------------------------------------------------------------

    async def cluster_status(
        self, fleet: FleetSnapshot, domain: DomainSnapshot
    ) -> ClusterInfo | None:
        """``sky status`` of the domain's cluster now (``None``: SkyPilot does not know it).

        Raises:
            haru_driver_skypilot.SkyDriverError: the command failed.
        """
        memory = self._memory.setdefault(domain.id, _Memory())
        return await self._driver.get_domain_status(await self._name(fleet, domain, memory))

    def drives(self, domain: DomainSnapshot) -> bool:
        """Whether this provisioner drives ``domain`` (its provider has a backend here)."""
        return domain.provider in self._backends

    async def observe(self, fleet: FleetSnapshot, domain: DomainSnapshot) -> Observed:
        """SkyPilot's status of the domain's cluster or service now.

        ``shown`` is ``absent`` when SkyPilot does not know it.

        Raises:
            KeyError: the domain's provider is not driven here (see :meth:`drives`).
            haru_driver_skypilot.SkyDriverError: the command failed.
        """
        memory = self._memory.setdefault(domain.id, _Memory())
        return await self._backend(domain).observe(
            await self._name(fleet, domain, memory), self._settings(domain)
        )

    async def cluster_name(self, fleet: FleetSnapshot, domain: DomainSnapshot) -> str:
        """The name of the domain's cluster or service (the one its last launch used)."""
        return await self._name(fleet, domain, self._memory.setdefault(domain.id, _Memory()))

    # ---- writes --------------------------------------------------------------------------

    async def _fail(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        attempt: int,
        failure: _Failure,
        now: datetime,
    ) -> None:
        memory = self._memory.setdefault(domain.id, _Memory())
        name = await self._name(fleet, domain, memory)
        moved = await self._store.transition_domain(
            domain.id, from_states=(domain.state,), to=_D.FAILED, at=now
        )
        if not moved:
            return
        logger.error(
            "domain %s: provisioning failed (%s): %s", domain.slug, failure.reason, failure.message
        )
        await self._event(
            fleet,
            domain,
            DomainProvisioningFailed(
                cluster=name,
                attempt=attempt,
                reason=failure.reason,
                message=failure.message,
                argv=failure.argv,
                exit_code=failure.exit_code,
                stderr=failure.stderr,
                cluster_status=failure.cluster_status,
            ),
            now,
        )
        if failure.reason in _CLEANED_AFTER:
            self._start_cleanup(domain, memory, name, failure.reason)

    def _start_cleanup(self, domain: DomainSnapshot, memory: _Memory, name: str, why: str) -> None:
        """Run ``sky down NAME`` in the background (the failed step drives it to its end)."""
        if memory.cleanup is not None and not memory.cleanup.task.done():
            return
        logger.warning("domain %s: tearing down cluster %s after %s", domain.slug, name, why)
        memory.cleanup = _Cleanup(name, why, self._down(domain, name))

    def _down(self, domain: DomainSnapshot, name: str) -> asyncio.Task[None]:
        return asyncio.create_task(
            self._backend(domain).teardown(name), name=f"haru-cleanup-{name}"
        )

    async def _event(
        self, fleet: FleetSnapshot, domain: DomainSnapshot, payload: EventPayload, now: datetime
    ) -> None:
        await self._store.append_event(
            fleet_id=fleet.id, payload=payload, at=now, domain_id=domain.id
        )
