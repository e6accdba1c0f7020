"""SkyPilot status reads for the provisioner: the ``sky`` preflight, batched ``sky status``.

The tick never waits for ``sky``: one background ``sky status N1 N2 ...`` reads every
``skypilot`` cluster this process watches, at most once per ``status_interval_s``, and a
domain takes a result only from a read that started after it asked. A read starts at the end
of a provisioning round (never halfway through it), and it also names the clusters that took
the previous read's result: they are about to ask again, so the domains stay in one read
instead of taking turns. The preflight (``sky
--version``, ``sky api info``) runs once before the first command, off the tick as well.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from haru_driver_skypilot import DomainDriver, SkyDriverError
from haru_protocol import DomainSnapshot, Provider

from haru_server._backends import Backend, ClusterBackend, Observed
from haru_server._provisioning_memory import DomainMemory, ProvisionerOptions, settings_of

logger = logging.getLogger(__name__)

PREFLIGHT_RETRY_S = 60.0
"""Seconds before a failed ``sky`` preflight is tried again."""


@dataclass(slots=True)
class _Reads:
    """The batched ``sky status`` reads of every ``skypilot`` cluster this process watches.

    A domain that wants a status names its cluster in ``wanted``; one background read asks
    SkyPilot about all of them; a domain takes a result only from a read that started after
    it asked (``results`` keeps each name's latest, with its read's start). ``took`` names
    the clusters whose domain took a result since the last read started.
    """

    wanted: set[str]
    results: dict[str, tuple[float, Observed]]
    took: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    started_at: float | None = None


class StatusReads:
    """What SkyPilot says of the provisioner's clusters and services, read off the tick.

    Args:
        driver: The SkyPilot driver (its preflight).
        clusters: The ``skypilot`` backend (the batched read).
        backends: Every provider's backend (a ``skyserve`` service is read on its own).
        options: Tuning (``status_interval_s``, ``refresh``, ``preflight``).
    """

    def __init__(
        self,
        driver: DomainDriver,
        clusters: ClusterBackend,
        backends: Mapping[Provider, Backend],
        options: ProvisionerOptions,
    ) -> None:
        self._driver = driver
        self._clusters = clusters
        self._backends = backends
        self._options = options
        self._reads = _Reads(wanted=set(), results={})
        self._preflight_ok = not options.preflight
        self._preflight_at: float | None = None
        self._preflight_task: asyncio.Task[None] | None = None

    def tasks(self) -> list[asyncio.Task[None]]:
        """The background tasks running now (the provisioner cancels them on close)."""
        return [t for t in (self._reads.task, self._preflight_task) if t is not None]

    def preflight(self) -> bool:
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

    async def status(
        self, domain: DomainSnapshot, name: str, memory: DomainMemory
    ) -> Observed | None:
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
            return await self._backends[domain.provider].read_status(name, settings_of(domain))
        if memory.status_asked_at is None:
            memory.status_asked_at = mono
        got = self._reads.results.get(name)
        if got is not None and got[0] >= memory.status_asked_at:
            memory.status_asked_at = None
            self._reads.took.add(name)
            return got[1]
        self._reads.wanted.add(name)
        return None

    def start_read(self) -> None:
        """Start the batched read if a cluster waits for one and none runs (end of a round).

        Called once per provisioning round, after every domain asked: a read started halfway
        through a round would miss the domains that take a result later in it, and two
        domains out of step would then take turns instead of sharing reads.
        """
        reads = self._reads
        if reads.task is not None and not reads.task.done():
            return
        mono = time.monotonic()
        last = reads.started_at
        if last is not None and mono - last < self._options.status_interval_s:
            return
        if not reads.wanted:
            return
        names = sorted(reads.wanted | reads.took)
        reads.wanted = set()
        reads.took = set()
        reads.started_at = mono
        reads.task = asyncio.create_task(self._read_all(names, mono), name="haru-sky-status")

    async def _read_all(self, names: list[str], started: float) -> None:
        """One ``sky status N1 N2 ... [--refresh] -o json``; bounded by the status timeout."""
        try:
            seen = await self._clusters.read_statuses(names, refresh=self._options.refresh)
        except SkyDriverError as exc:
            logger.warning("SkyPilot status read of %d cluster(s) failed: %s", len(names), exc)
            self._reads.wanted.update(names)  # asked again by the next read
            return
        for name, observed in seen.items():
            self._reads.results[name] = (started, observed)
