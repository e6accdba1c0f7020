"""The SkyServe driver: one service per domain, driven through ``sky serve``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from haru_driver_skypilot import (
    InvalidSpecError,
    SkyRunner,
    SkySdk,
    SkyTimeouts,
    StatusSource,
    check_name,
    resolve_sdk,
    temporary_yaml,
)

from haru_driver_skyserve._render import render_service_yaml
from haru_driver_skyserve._spec import ServiceSpec
from haru_driver_skyserve._status import ServiceInfo, find_service, parse_service_status

logger = logging.getLogger(__name__)


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
        """Tear the service and its replicas down."""
        ...


class SkyServeDriver:
    """:class:`ServiceDriver` over the ``sky serve`` CLI (status optionally through the SDK).

    Commands (``NAME`` is the service name, ``FILE`` a rendered service YAML in a temp dir
    removed after the call)::

        sky serve up -n NAME -y FILE       (timeouts.launch)
        sky serve status NAME              (timeouts.status; there is no JSON flag)
        sky serve down NAME -y             (timeouts.down)
    """

    def __init__(
        self,
        runner: SkyRunner | None = None,
        *,
        timeouts: SkyTimeouts | None = None,
        status_source: StatusSource = "cli",
        sdk: SkySdk | None = None,
    ) -> None:
        """Create a driver.

        Args:
            runner: Runs ``sky``; a default :class:`~haru_driver_skypilot.SkyRunner` when
                ``None``.
            timeouts: Per-command time bounds; defaults when ``None``.
            status_source: Where :meth:`get_service_status` reads from: ``"cli"`` (default),
                ``"sdk"``, or ``"auto"`` (SDK when SkyPilot is importable).
            sdk: The SDK facade used when status comes from the SDK.

        Raises:
            SkySdkError: ``status_source="sdk"`` and SkyPilot is not installed.
        """
        self._runner = runner if runner is not None else SkyRunner()
        self._timeouts = timeouts if timeouts is not None else SkyTimeouts()
        self._sdk = resolve_sdk(status_source, sdk)

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
        """Run ``sky serve down NAME -y``.

        Raises:
            SkyCommandError: the command failed, timed out or could not start.
        """
        check_name(name)
        await self._runner.run(["serve", "down", name, "-y"], timeout=self._timeouts.down)
        logger.info("tore down SkyServe service %s", name)
