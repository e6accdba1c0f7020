"""What the provisioner drives per provider: a SkyPilot cluster or a SkyServe service.

:class:`~haru_server._provisioning.Provisioner` runs one step machine (claim, launch, await
the launch, await the address, await readiness, watch for loss, relaunch, teardown) for
every provisioned domain; a :class:`Backend` supplies what differs between providers: the
launch, how ``sky`` status reads (normalised to :class:`Observed`), the address, teardown,
and whether a supervisor must answer before the domain is ready.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from haru_driver_skypilot import (
    SERVING_TOKEN_SECRET,
    TLS_CERT_SECRET,
    TLS_KEY_SECRET,
    TOKEN_SECRET,
    ClusterInfo,
    ClusterStatus,
    DomainDriver,
    domain_task,
    model_ports,
    serving_path,
)
from haru_driver_skyserve import ServiceDriver, ServiceStatus, domain_service, endpoint_url
from haru_protocol import DomainSnapshot, Provider, Provisioning, SlotSpec

ABSENT = "absent"
"""``clusterStatus`` of a cluster or service that SkyPilot does not know."""

_SERVICE_LOST = frozenset(
    {
        ServiceStatus.FAILED,
        ServiceStatus.FAILED_CLEANUP,
        ServiceStatus.CONTROLLER_FAILED,
        ServiceStatus.SHUTTING_DOWN,
    }
)
"""Service statuses that count as lost: no replica serves and SkyServe will not bring one
back by itself (failed replicas, a failed controller, or going away). NO_REPLICA counts
only once it has lasted ``no_replica_grace_s`` (see :class:`ServiceBackend`)."""

NO_REPLICA_GRACE_S = 120.0
"""How long a service may show NO_REPLICA before it counts as lost."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What one ``sky status`` / ``sky serve status`` read says, normalised.

    Attributes:
        shown: The status as SkyPilot spells it (``absent`` when it does not know the name).
        launched: The launch went through (a process that did not run it need not relaunch).
        addressable: Ready to record the address: the cluster is UP, or the service is READY
            with the layout's number of READY replicas and an endpoint.
        lost: Stopped, preempted or gone (the domain fails; a relaunch may follow).
        endpoint: A service's endpoint as printed (``HOST:PORT`` or a URL).
        ready_replicas: A service's READY replicas.
    """

    shown: str
    launched: bool
    addressable: bool
    lost: bool
    endpoint: str | None = None
    ready_replicas: int | None = None


@dataclass(frozen=True, slots=True)
class Address:
    """The URLs recorded on a domain and its model bindings."""

    supervisor_url: str | None
    serving_base_url: str
    model_urls: Mapping[str, str]


_TASK_SECRETS = frozenset({TOKEN_SECRET, SERVING_TOKEN_SECRET, TLS_CERT_SECRET, TLS_KEY_SECRET})
"""Secrets every ``skypilot`` task declares; any other name given is declared as extra."""


def _https(endpoint: str) -> str:
    """An endpoint over TLS (SkyPilot prints ``HOST:PORT`` or an http URL)."""
    rest = endpoint.split("://", 1)[1] if "://" in endpoint else endpoint
    return f"https://{rest}"


def _model_urls(base: str, slots: Sequence[SlotSpec], settings: Provisioning) -> dict[str, str]:
    return {port.name: base + serving_path(port.name) for port in model_ports(slots, settings)}


def _specs(domain: DomainSnapshot) -> list[SlotSpec]:
    return [slot.spec for slot in domain.slots]


class Backend(Protocol):
    """One provider's part of the provisioned-domain lifecycle."""

    provider: Provider
    noun: Literal["cluster", "service"]
    """What SkyPilot runs for the domain (messages and events)."""
    launch_command: str
    teardown_command: str
    has_supervisor: bool
    """Whether the domain is ready only once its supervisor heartbeats (else: once addressed)."""

    def launch(
        self,
        name: str,
        domain: DomainSnapshot,
        settings: Provisioning,
        *,
        role: Literal["active", "standby"],
        secrets: Mapping[str, str],
    ) -> Coroutine[Any, Any, None]:
        """Render the domain (raising the driver's errors now) and return the launch to run."""
        ...

    async def read_status(self, name: str, settings: Provisioning) -> Observed:
        """Read SkyPilot's status of ``name``."""
        ...

    async def address(
        self, name: str, domain: DomainSnapshot, settings: Provisioning, observed: Observed
    ) -> Address | None:
        """The domain's URLs once ``observed`` is addressable (None: not known yet)."""
        ...

    async def teardown(self, name: str) -> None:
        """Tear the cluster or service down."""
        ...

    def awaited(self, settings: Provisioning) -> str:
        """What ``clusterUpTimeoutMs`` waits for, in words."""
        ...


def cluster_observed(info: ClusterInfo | None) -> Observed:
    """A cluster's status read as :class:`Observed` (``None``: SkyPilot does not know it)."""
    if info is None:
        return Observed(ABSENT, launched=False, addressable=False, lost=True)
    up = info.status is ClusterStatus.UP
    lost = info.status is ClusterStatus.STOPPED
    return Observed(info.status.value, launched=up, addressable=up, lost=lost)


class ClusterBackend:
    """``skypilot`` domains: one cluster, ``sky launch -d`` / ``sky status`` / ``sky down``."""

    provider = Provider.SKYPILOT
    noun: Literal["cluster", "service"] = "cluster"
    launch_command = "sky launch"
    teardown_command = "sky down"
    has_supervisor = True

    def __init__(self, driver: DomainDriver) -> None:
        self.driver = driver

    def launch(
        self,
        name: str,
        domain: DomainSnapshot,
        settings: Provisioning,
        *,
        role: Literal["active", "standby"],
        secrets: Mapping[str, str],
    ) -> Coroutine[Any, Any, None]:
        spec = domain_task(
            name,
            domain.placement,
            _specs(domain),
            settings,
            start_asleep=role == "standby",
            extra_secrets=tuple(sorted(set(secrets) - _TASK_SECRETS)),
        )
        return self.driver.launch_domain(spec, secrets=secrets)

    async def read_status(self, name: str, settings: Provisioning) -> Observed:
        return cluster_observed(await self.driver.get_domain_status(name))

    async def read_statuses(self, names: Sequence[str], *, refresh: bool) -> dict[str, Observed]:
        """One ``sky status`` of every name (a name SkyPilot does not know is ``absent``)."""
        infos = await self.driver.get_domain_statuses(names, refresh=refresh)
        return {name: cluster_observed(infos.get(name)) for name in names}

    async def address(
        self, name: str, domain: DomainSnapshot, settings: Provisioning, observed: Observed
    ) -> Address | None:
        # SkyPilot's endpoint of each port, not the head's IP: on Kubernetes, RunPod and
        # Vast the IP with the task's port does not reach it.
        supervisor = await self.driver.get_endpoint(name, settings.supervisor_port)
        if supervisor is None:
            return None
        base = await self.driver.get_endpoint(name, settings.gateway_port)
        if base is None:
            return None
        # Both over TLS with the certificate issued before the launch (see haru_server._pki):
        # the supervisor and the gateway serve it; the server trusts the fleet's CA.
        serving = _https(base)
        return Address(
            supervisor_url=_https(supervisor),
            serving_base_url=serving,
            model_urls=_model_urls(serving, _specs(domain), settings),
        )

    async def teardown(self, name: str) -> None:
        await self.driver.teardown_domain(name)

    def awaited(self, settings: Provisioning) -> str:
        return "UP"


class ServiceBackend:
    """``skyserve`` domains: one service, ``sky serve up`` / ``status`` / ``down``.

    The domain is ready once the service has ``replicas`` READY replicas and an endpoint;
    the endpoint is its serving base URL. No supervisor: nothing heartbeats, nothing sleeps.
    """

    provider = Provider.SKYSERVE
    noun: Literal["cluster", "service"] = "service"
    launch_command = "sky serve up"
    teardown_command = "sky serve down"
    has_supervisor = False

    def __init__(
        self,
        driver: ServiceDriver,
        *,
        clock: Callable[[], float],
        no_replica_grace_s: float = NO_REPLICA_GRACE_S,
    ) -> None:
        """Create it.

        Args:
            driver: The SkyServe driver.
            clock: Seconds (the provisioner's clock), to time NO_REPLICA.
            no_replica_grace_s: How long NO_REPLICA may last before the service is lost:
                SkyServe replaces preempted replicas by itself, and shows NO_REPLICA until
                one is back (``sky/serve/serve_state.py`` ``ServiceStatus``).
        """
        self.driver = driver
        self._clock = clock
        self._grace = no_replica_grace_s
        self._no_replica_since: dict[str, float] = {}

    def launch(
        self,
        name: str,
        domain: DomainSnapshot,
        settings: Provisioning,
        *,
        role: Literal["active", "standby"],
        secrets: Mapping[str, str],
    ) -> Coroutine[Any, Any, None]:
        # Same service whatever the role: a SkyServe replica never sleeps, and runs no
        # supervisor (so it needs no supervisor token, only the serving credential).
        spec = domain_service(name, domain.placement, _specs(domain), settings)
        return self.driver.launch_service(spec, secrets=secrets)

    async def read_status(self, name: str, settings: Provisioning) -> Observed:
        info = await self.driver.get_service_status(name)
        if info is None:
            self._no_replica_since.pop(name, None)
            return Observed(ABSENT, launched=False, addressable=False, lost=True)
        lost = info.status in _SERVICE_LOST
        if info.status is ServiceStatus.NO_REPLICA:
            since = self._no_replica_since.setdefault(name, self._clock())
            lost = self._clock() - since >= self._grace
        else:
            self._no_replica_since.pop(name, None)
        ready = info.ready_replicas or 0
        addressable = (
            info.status is ServiceStatus.READY
            and ready >= settings.replicas
            and info.endpoint is not None
        )
        return Observed(
            info.status.value,
            launched=not lost,
            addressable=addressable,
            lost=lost,
            endpoint=info.endpoint,
            ready_replicas=info.ready_replicas,
        )

    async def address(
        self, name: str, domain: DomainSnapshot, settings: Provisioning, observed: Observed
    ) -> Address | None:
        if observed.endpoint is None:
            return None
        base = endpoint_url(observed.endpoint)
        return Address(
            supervisor_url=None,
            serving_base_url=base,
            model_urls=_model_urls(base, _specs(domain), settings),
        )

    async def teardown(self, name: str) -> None:
        await self.driver.teardown_service(name)

    def awaited(self, settings: Provisioning) -> str:
        return f"READY with {settings.replicas} READY replica(s) and an endpoint"
