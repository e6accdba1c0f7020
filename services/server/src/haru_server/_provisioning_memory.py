"""What the provisioner keeps beyond the store: its tuning, its memory of each domain, a failure.

The store holds every decision; this is what one process adds to it: the launch and the
``sky down`` tasks it runs, a relaunch streak it read, the cluster name of a launch attempt,
when it last asked SkyPilot. A restarted process starts with none of it and loses nothing
the lifecycle needs: every step re-reads the store.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timedelta

from haru_core import RelaunchStreak
from haru_driver_skypilot import SkyCliError, SkyCommandError
from haru_protocol import DomainSnapshot, Provisioning, ProvisioningFailure

from haru_server._backends import NO_REPLICA_GRACE_S

MESSAGE_LIMIT = 1024
"""Longest message kept in a ``domain.provisioning.failed`` event."""
CLEANUP_TRIES = 3
"""How many times one cleanup ``sky down`` runs before it is given up (each failure an event)."""

MAX_CONCURRENT_LAUNCHES = 4
"""Launches one process runs at once; more wait their turn. A local SkyPilot API server runs
at most 4 launch-type requests at once (``sky/server/requests/executor.py``, the long
request queue), and a launch queued there would spend its ``launchTimeoutMs`` invisibly."""


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
class LaunchTask:
    attempt: int
    task: asyncio.Task[None]


@dataclass(slots=True)
class CachedStreak:
    """The relaunch streak of a failed domain, read from the store once per failure.

    ``since`` is the ``state_updated_at`` it was read at: a newer one (the domain moved)
    makes it stale.
    """

    since: datetime
    streak: RelaunchStreak


@dataclass(slots=True)
class Cleanup:
    """A ``sky down`` of a failed domain's cluster, retried up to :data:`CLEANUP_TRIES`."""

    name: str
    why: str
    task: asyncio.Task[None]
    tries: int = 1


@dataclass(slots=True)
class DomainMemory:
    """What this process knows of one domain beyond the store."""

    launch: LaunchTask | None = None
    teardown: asyncio.Task[None] | None = None
    cleanup: Cleanup | None = None
    status_read_at: float | None = None
    addressed_at: datetime | None = None
    status_asked_at: float | None = None
    """When the domain asked the batched read for its cluster's status (monotonic)."""
    streak: CachedStreak | None = None
    name: tuple[int, str] | None = None
    """The cluster name of launch attempt N, as ``(N, name)``."""


@dataclass(frozen=True, slots=True)
class Failure:
    reason: ProvisioningFailure
    message: str
    argv: tuple[str, ...] | None = None
    exit_code: int | None = None
    stderr: str | None = None
    cluster_status: str | None = None


def failure_from_error(reason: ProvisioningFailure, exc: BaseException) -> Failure:
    message = (str(exc) or type(exc).__name__)[:MESSAGE_LIMIT]
    if isinstance(exc, SkyCliError):
        return Failure(reason, message, exc.argv, exc.returncode, exc.stderr or exc.stdout_tail)
    if isinstance(exc, SkyCommandError):
        return Failure(reason, message, exc.argv)
    return Failure(reason, message)


def settings_of(domain: DomainSnapshot) -> Provisioning:
    return domain.provisioning if domain.provisioning is not None else Provisioning()


def ms(value: int) -> timedelta:
    return timedelta(milliseconds=value)
