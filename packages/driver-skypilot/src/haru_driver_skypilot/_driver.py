"""The SkyPilot domain driver: launch, status, stop and teardown of one cluster per domain."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Protocol

from haru_driver_skypilot._errors import InvalidSpecError, SkyCliError, SkyOutputError
from haru_driver_skypilot._render import render_task_yaml
from haru_driver_skypilot._runner import SkyRunner, SkyTimeouts, strip_ansi, temporary_yaml
from haru_driver_skypilot._sdk import SkyPilotSdk, SkySdk, StatusSource, sdk_available
from haru_driver_skypilot._spec import TaskSpec, check_name
from haru_driver_skypilot._status import ClusterInfo, find_cluster, parse_status_json

logger = logging.getLogger(__name__)

# An IPv4/IPv6 address or a host name, as `sky status --ip` prints the head's address.
_ADDRESS_RE = re.compile(r"[0-9A-Za-z.:\-]+")


class DomainDriver(Protocol):
    """What services need from a cluster-per-domain provisioner (inject fakes in tests)."""

    async def launch_domain(
        self, spec: TaskSpec, *, secrets: Mapping[str, str] | None = None
    ) -> None:
        """Provision (or re-use) the cluster ``spec.name`` and start ``spec.run`` on it.

        ``secrets`` holds the value of each name in ``spec.secrets``.
        """
        ...

    async def get_head_ip(self, name: str) -> str | None:
        """The head node's address, or ``None`` when SkyPilot does not know the cluster."""
        ...

    async def get_domain_status(self, name: str) -> ClusterInfo | None:
        """The cluster's status, or ``None`` when SkyPilot does not know the cluster."""
        ...

    async def stop_domain(self, name: str) -> None:
        """Stop the cluster (keeps its disks); a no-op for an unknown cluster."""
        ...

    async def teardown_domain(self, name: str) -> None:
        """Terminate the cluster; a no-op for an unknown cluster."""
        ...


def resolve_sdk(status_source: StatusSource, sdk: SkySdk | None) -> SkySdk | None:
    """The SDK to read status through, or ``None`` for the CLI.

    Args:
        status_source: ``"cli"``, ``"sdk"`` or ``"auto"`` (SDK when importable).
        sdk: An SDK to use instead of :class:`SkyPilotSdk` (tests inject fakes).

    Raises:
        SkySdkError: ``"sdk"`` was asked for and SkyPilot is not installed.
    """
    match status_source:
        case "cli":
            return None
        case "sdk":
            return sdk if sdk is not None else SkyPilotSdk()
        case "auto":
            if sdk is not None:
                return sdk
            return SkyPilotSdk() if sdk_available() else None
    raise ValueError(f"unknown status source {status_source!r}")


class SkyPilotDriver:
    """:class:`DomainDriver` over the ``sky`` CLI (status optionally through the SDK).

    Commands (``NAME`` is the cluster name, ``FILE`` a rendered task YAML in a temp dir
    removed after the call)::

        sky launch -c NAME -y -d FILE      (timeouts.launch)
        sky status NAME -o json            (timeouts.status)
        sky stop NAME -y                   (timeouts.stop)
        sky down NAME -y                   (timeouts.down)
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
            runner: Runs ``sky``; a default :class:`SkyRunner` when ``None``.
            timeouts: Per-command time bounds; :class:`SkyTimeouts` defaults when ``None``.
            status_source: Where :meth:`get_domain_status` reads from (see
                :data:`StatusSource`); the CLI by default.
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

    async def launch_domain(
        self, spec: TaskSpec, *, secrets: Mapping[str, str] | None = None
    ) -> None:
        """Run ``sky launch -c NAME -y -d [--secret NAME ...] FILE``.

        ``-d`` returns once the run is submitted. Each ``--secret NAME`` carries no value on
        the command line: ``sky`` reads it from its environment, where ``secrets`` puts it.

        Raises:
            InvalidSpecError: a secret of the spec has no value in ``secrets``.
            SkyCommandError: the launch failed, timed out or could not start.
        """
        secrets = secrets or {}
        missing = [name for name in spec.secrets if not secrets.get(name)]
        if missing:
            raise InvalidSpecError(f"no value for the secrets {missing!r}")
        text = render_task_yaml(spec)
        flags = [arg for name in spec.secrets for arg in ("--secret", name)]
        async with temporary_yaml(text, filename=f"{spec.name}.yaml") as path:
            await self._runner.run(
                ["launch", "-c", spec.name, "-y", "-d", *flags, str(path)],
                timeout=self._timeouts.launch,
                extra_env={name: secrets[name] for name in spec.secrets},
                # Never twice: a second `sky launch` is a second full launch.
                retry_cold=False,
            )
        logger.info("launched SkyPilot cluster %s", spec.name)

    async def get_head_ip(self, name: str) -> str | None:
        """Run ``sky status --ip NAME``: the head node's address, ``None`` when there is none yet.

        SkyPilot 0.14 prints the address alone on its last line. For a cluster it does not
        know it exits 1 (``ValueError: Cluster ... not found`` on stderr), for one that is not
        UP it exits 1 (``... is not in UP status``) (``sky/client/cli/command.py``: ``status``
        with ``--ip``; ``sky/core.py``: ``endpoints``/``status``): any non-zero exit is "no
        address yet", and so is an older client's ``not found`` line with exit 0.

        Raises:
            SkyCommandError: the command timed out or could not start.
            SkyOutputError: the output holds no address.
        """
        check_name(name)
        try:
            result = await self._runner.run(["status", "--ip", name], timeout=self._timeouts.status)
        except SkyCliError as exc:
            logger.info("no address for SkyPilot cluster %s yet (exit %d)", name, exc.returncode)
            return None
        lines = [line.strip() for line in strip_ansi(result.stdout).splitlines() if line.strip()]
        if not lines or "not found" in lines[-1].lower():
            return None
        address = lines[-1]
        if _ADDRESS_RE.fullmatch(address) is None:
            raise SkyOutputError(
                "`sky status --ip` printed no address", argv=result.argv, output=result.stdout
            )
        return address

    async def get_domain_status(self, name: str) -> ClusterInfo | None:
        """Run ``sky status NAME -o json`` (or the SDK) and return the cluster's record.

        An unknown cluster is ``None``: SkyPilot prints ``Cluster(s) not found`` and ``[]``
        and exits 0.

        Raises:
            SkyCommandError: the command failed, timed out or could not start.
            SkyOutputError: the output holds no JSON list or an unknown status.
            SkySdkError: the SDK call failed (SDK mode).
        """
        check_name(name)
        if self._sdk is not None:
            records = await self._sdk.cluster_records([name], timeout=self._timeouts.status)
            return find_cluster(records, name)
        result = await self._runner.run(
            ["status", name, "-o", "json"], timeout=self._timeouts.status
        )
        return find_cluster(
            parse_status_json(result.stdout, argv=result.argv), name, argv=result.argv
        )

    async def stop_domain(self, name: str) -> None:
        """Run ``sky stop NAME -y``.

        Raises:
            SkyCommandError: the command failed, timed out or could not start.
        """
        check_name(name)
        await self._runner.run(["stop", name, "-y"], timeout=self._timeouts.stop)
        logger.info("stopped SkyPilot cluster %s", name)

    async def teardown_domain(self, name: str) -> None:
        """Run ``sky down NAME -y``.

        Raises:
            SkyCommandError: the command failed, timed out or could not start.
        """
        check_name(name)
        await self._runner.run(["down", name, "-y"], timeout=self._timeouts.down)
        logger.info("tore down SkyPilot cluster %s", name)
