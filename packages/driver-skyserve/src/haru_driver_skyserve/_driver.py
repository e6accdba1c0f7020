"""The SkyServe driver: one service per domain, driven through ``sky serve``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from haru_driver_skypilot import (
    InvalidSpecError,
    SkyCliError,
    SkyRunner,
    SkySdk,
    SkyTimeoutError,
    SkyTimeouts,
    StatusSource,
    check_name,
    resolve_sdk,
    strip_ansi,
    temporary_yaml,
)

from haru_driver_skyserve._render import render_service_yaml
from haru_driver_skyserve._spec import ServiceSpec
from haru_driver_skyserve._status import ServiceInfo, find_service, parse_service_status

logger = logging.getLogger(__name__)

DOWN_POLL_S = 2.0
"""Seconds between two ``sky serve status`` reads while a service's termination runs."""


class ServiceDriver(Protocol):
    """What services need from a service-per-domain provisioner (inject fakes in tests)."""

    async def launch_service(
        self, spec: ServiceSpec, *, secrets: Mapping[str, str] | None = None
    ) -> None:
        """Bring up the service ``spec.name`` (``secrets``: the value of each of its secrets)."""
        ...

    async def get_service_status(self, name: str) -> ServiceInfo | None:
        """The service's status, or ``None`` when SkyServe does not know it."""
        ...

    async def teardown_service(self, name: str) -> None:
        """Tear the service and its replicas down; return once SkyServe lists it no more."""
        ...


class SkyServeDriver:
    """:class:`ServiceDriver` over the ``sky serve`` CLI (status optionally through the SDK).

    Commands (``NAME`` is the service name, ``FILE`` a rendered service YAML in a temp dir
    removed after the call)::

        sky serve up -n NAME -y FILE       (timeouts.launch)
        sky serve status NAME              (timeouts.status; there is no JSON flag)
        sky serve down NAME -y --purge     (timeouts.down, with the wait until it is gone)
    """

    def __init__(
        self,
        runner: SkyRunner | None = None,
        *,
        timeouts: SkyTimeouts | None = None,
        status_source: StatusSource = "cli",
        sdk: SkySdk | None = None,
        down_poll_s: float = DOWN_POLL_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Create a driver.

        Args:
            runner: Runs ``sky``; a default :class:`~haru_driver_skypilot.SkyRunner` when
                ``None``.
            timeouts: Per-command time bounds; defaults when ``None``.
            status_source: Where :meth:`get_service_status` reads from: ``"cli"`` (default),
                ``"sdk"``, or ``"auto"`` (SDK when SkyPilot is importable).
            sdk: The SDK facade used when status comes from the SDK.
            down_poll_s: Seconds between status reads while waiting for a termination.
            sleep: The sleep of that wait (inject to keep tests fast).

        Raises:
            SkySdkError: ``status_source="sdk"`` and SkyPilot is not installed.
        """
        self._runner = runner if runner is not None else SkyRunner()
        self._timeouts = timeouts if timeouts is not None else SkyTimeouts()
        self._sdk = resolve_sdk(status_source, sdk)
        self._down_poll_s = down_poll_s
        self._sleep = sleep

    @property
    def uses_sdk(self) -> bool:
        """Whether status is read through SkyPilot's Python SDK rather than the CLI."""
        return self._sdk is not None

    async def launch_service(
        self, spec: ServiceSpec, *, secrets: Mapping[str, str] | None = None
    ) -> None:
        """Run ``sky serve up -n NAME -y [--secret NAME ...] FILE``.

        Each ``--secret NAME`` carries no value on the command line: ``sky`` reads it from its
        environment, where ``secrets`` puts it (as for ``sky launch``).

        Raises:
            InvalidSpecError: a secret of the task has no value in ``secrets``.
            SkyCommandError: the command failed, timed out or could not start.
        """
        secrets = secrets or {}
        names = spec.task.secrets
        missing = [name for name in names if not secrets.get(name)]
        if missing:
            raise InvalidSpecError(f"no value for the secrets {missing!r}")
        flags = [arg for name in names for arg in ("--secret", name)]
        text = render_service_yaml(spec)
        async with temporary_yaml(text, filename=f"{spec.name}.yaml") as path:
            await self._runner.run(
                ["serve", "up", "-n", spec.name, "-y", *flags, str(path)],
                timeout=self._timeouts.launch,
                extra_env={name: secrets[name] for name in names},
                # Never twice: a second `sky serve up` is a second launch.
                retry_cold=False,
            )
        logger.info("brought up SkyServe service %s", spec.name)

    async def get_service_status(self, name: str) -> ServiceInfo | None:
        """Run ``sky serve status NAME`` (or the SDK) and return the service's status.

        Raises:
            SkyCommandError: the command failed, timed out or could not start.
            SkyOutputError: the output is not the documented table or absence message.
            UnknownStatusError: the status is outside SkyServe's vocabulary.
            SkySdkError: the SDK call failed (SDK mode).
        """
        check_name(name)
        if self._sdk is not None:
            records = await self._sdk.service_records([name], timeout=self._timeouts.status)
            return find_service(records, name)
        result = await self._runner.run(["serve", "status", name], timeout=self._timeouts.status)
        return parse_service_status(result.stdout, name, argv=result.argv)

    async def teardown_service(self, name: str) -> None:
        """Run ``sky serve down NAME -y --purge``, then wait until SkyServe lists it no more.

        SkyServe's ``down`` only schedules the termination (the controller tears the replicas
        down later) and, without ``--purge``, skips a service in a failed status
        (CONTROLLER_FAILED, FAILED_CLEANUP) with exit 0 and a "Skipping its termination"
        line; with no serve controller at all it exits 1 with ``No live services.``, which
        means nothing is left (``sky/serve/serve_utils.py`` ``terminate_services``,
        ``sky/utils/controller_utils.py``). So the service is gone only once ``sky serve
        status`` no longer lists it; that wait shares the ``timeouts.down`` bound.

        Raises:
            SkyCommandError: the command failed, or the service was still listed at the end
                of ``timeouts.down``.
        """
        check_name(name)
        deadline = time.monotonic() + self._timeouts.down
        try:
            await self._runner.run(
                ["serve", "down", name, "-y", "--purge"], timeout=self._timeouts.down
            )
        except SkyCliError as exc:
            if "No live services" not in strip_ansi(f"{exc.stderr}\n{exc.stdout_tail}"):
                raise
            logger.info("SkyServe service %s: no serve controller, nothing to tear down", name)
            return
        while True:
            info = await self.get_service_status(name)
            if info is None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise SkyTimeoutError(
                    f"SkyServe still lists service {name} as {info.status.value} after "
                    f"`sky serve down` ({self._timeouts.down:g} s)",
                    argv=("sky", "serve", "status", name),
                    timeout=self._timeouts.down,
                )
            await self._sleep(min(self._down_poll_s, left))
        logger.info("tore down SkyServe service %s", name)
