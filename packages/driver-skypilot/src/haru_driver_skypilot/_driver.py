"""The SkyPilot domain driver: launch, status, stop and teardown of one cluster per domain."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from haru_driver_skypilot._errors import (
    InvalidSpecError,
    SkyCliError,
    SkyDriverError,
    SkyOutputError,
    SkyPreflightError,
)
from haru_driver_skypilot._render import render_task_yaml
from haru_driver_skypilot._runner import SkyRunner, SkyTimeouts, strip_ansi, temporary_yaml
from haru_driver_skypilot._sdk import SkyPilotSdk, SkySdk, StatusSource, sdk_available
from haru_driver_skypilot._spec import TaskSpec, check_name
from haru_driver_skypilot._status import ClusterInfo, find_cluster, parse_status_json

logger = logging.getLogger(__name__)

# An IPv4/IPv6 address or a host name, as `sky status --ip` prints the head's address.
_ADDRESS_RE = re.compile(r"[0-9A-Za-z.:\-]+")
# What `sky status --endpoint PORT` prints: HOST:PORT, [IPv6]:PORT or an http(s) URL.
_ENDPOINT_RE = re.compile(
    r"(?:https?://)?[0-9A-Za-z.\-]+(?::[0-9]+)?(?:/\S*)?|\[[0-9A-Fa-f:.]+\]:[0-9]+"
)
_VERSION_RE = re.compile(r"version\s+v?([0-9]+(?:\.[0-9]+)*)")

MIN_SKY_VERSION = (0, 12, 0)
"""The oldest SkyPilot whose CLI Haru drives: ``sky status -o json`` arrived in 0.12."""
TESTED_SKY_VERSION = "0.14.1"
"""The SkyPilot release the sky lane (``.ci/sky-lane.sh``) runs Haru's commands against."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for part in text.split("."):
        digits = re.match(r"[0-9]+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class SkyApiInfo:
    """What :meth:`SkyPilotDriver.preflight` found.

    Attributes:
        client_version: ``sky --version`` (e.g. ``"0.14.1"``).
        server_version: The API server's version, as ``sky api info -o json`` reports it.
        server_url: The API server's URL.
        started: Whether the preflight started a local API server (with
            :func:`~haru_driver_skypilot.sky_environment`, never Haru's environment).
    """

    client_version: str
    server_version: str | None
    server_url: str | None
    started: bool = False


class DomainDriver(Protocol):
    """What services need from a cluster-per-domain provisioner (inject fakes in tests)."""

    async def launch_domain(
        self, spec: TaskSpec, *, secrets: Mapping[str, str] | None = None
    ) -> None:
        """Provision (or re-use) the cluster ``spec.name`` and start ``spec.run`` on it.

        ``secrets`` holds the value of each name in ``spec.secrets``.
        """
        ...

    async def get_endpoint(self, name: str, port: int) -> str | None:
        """The base URL that reaches ``port`` of the cluster; ``None`` when there is none yet."""
        ...

    async def get_domain_status(self, name: str) -> ClusterInfo | None:
        """The cluster's status, or ``None`` when SkyPilot does not know the cluster."""
        ...

    async def get_domain_statuses(
        self, names: Sequence[str], *, refresh: bool = False
    ) -> dict[str, ClusterInfo]:
        """The status of each of ``names`` SkyPilot knows, in one call (absent: not known)."""
        ...

    async def preflight(self) -> SkyApiInfo:
        """Check that ``sky`` is recent enough and that its API server answers."""
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

        sky launch -c NAME -y -d FILE              (timeouts.launch)
        sky status NAME... [--refresh] -o json     (timeouts.status)
        sky status --endpoint PORT NAME            (timeouts.status)
        sky stop NAME -y                           (timeouts.stop)
        sky down NAME -y                           (timeouts.down)
        sky --version; sky api info -o json; sky api start   (preflight, timeouts.status)
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

    async def get_endpoint(self, name: str, port: int) -> str | None:
        """Run ``sky status --endpoint PORT NAME``: the URL that reaches ``port``, or ``None``.

        The head's IP is not an address on every cloud: on Kubernetes ``--ip`` is the pod's
        internal IP (ports go through a LoadBalancer, an ingress or the pod IP), and RunPod and
        Vast map each port to another external port. SkyPilot's endpoint query knows
        (``sky/client/cli/command.py`` ``_show_endpoint``, ``sky/core.py`` ``endpoints``): it
        prints ``HOST:PORT`` (or a URL) on its last line, and exits non-zero for an unknown
        cluster, one not UP, or a port with no endpoint yet, all "no address yet" here.

        Returns:
            ``http://HOST:PORT`` (the printed URL when SkyPilot prints one), or ``None``.

        Raises:
            SkyCommandError: the command timed out or could not start.
            SkyOutputError: the output holds no endpoint.
        """
        check_name(name)
        try:
            result = await self._runner.run(
                ["status", "--endpoint", str(port), name], timeout=self._timeouts.status
            )
        except SkyCliError as exc:
            logger.info(
                "no endpoint for port %d of SkyPilot cluster %s yet (exit %d)",
                port,
                name,
                exc.returncode,
            )
            return None
        lines = [line.strip() for line in strip_ansi(result.stdout).splitlines() if line.strip()]
        endpoint = lines[-1] if lines else ""
        if _ENDPOINT_RE.fullmatch(endpoint) is None:
            raise SkyOutputError(
                f"`sky status --endpoint {port}` printed no endpoint",
                argv=result.argv,
                output=result.stdout,
            )
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        return url.rstrip("/")

    async def get_domain_statuses(
        self, names: Sequence[str], *, refresh: bool = False
    ) -> dict[str, ClusterInfo]:
        """Run ``sky status N1 N2 ... [--refresh] -o json`` (or the SDK): one call for all.

        Names SkyPilot does not know are absent from the answer (it prints ``Cluster(s) not
        found`` for them and lists the others). Naming clusters makes the CLI read every
        user's clusters (``all_users``); the SDK path asks for that explicitly.

        Args:
            names: The clusters to read (at least one).
            refresh: Ask the clouds now (``--refresh``) instead of taking the API server's
                cached status, which its refresh daemon updates about once a minute and not
                at all for a cluster with a running launch request.

        Raises:
            SkyCommandError: the command failed, timed out or could not start.
            SkyOutputError: the output holds no JSON list or an unknown status.
            SkySdkError: the SDK call failed (SDK mode).
        """
        wanted = list(dict.fromkeys(names))
        if not wanted:
            raise ValueError("no cluster names")
        for name in wanted:
            check_name(name)
        records: Sequence[Mapping[str, object]]
        if self._sdk is not None:
            records = await self._sdk.cluster_records(
                wanted, timeout=self._timeouts.status, refresh=refresh
            )
            argv = None
        else:
            flags = ["--refresh"] if refresh else []
            result = await self._runner.run(
                ["status", *wanted, *flags, "-o", "json"], timeout=self._timeouts.status
            )
            records = parse_status_json(result.stdout, argv=result.argv)
            argv = result.argv
        found: dict[str, ClusterInfo] = {}
        for name in wanted:
            info = find_cluster(records, name, argv=argv)
            if info is not None:
                found[name] = info
        return found

    async def preflight(self) -> SkyApiInfo:
        """Check ``sky`` before Haru relies on it; start a local API server if none runs.

        ``sky --version`` must be at least :data:`MIN_SKY_VERSION`; ``sky api info -o json``
        must report a healthy server of at least that version. ``sky api info`` never starts
        a server (``sky/client/cli/command.py`` ``api_info``); when it says none is
        connected, ``sky api start`` starts one here, with :func:`sky_environment` (so the
        server never holds Haru's variables, nor a launch's secrets, as it would if a
        launch's own call started it), and the check runs once more.

        Raises:
            SkyPreflightError: ``sky`` is missing, too old, or its API server does not answer.
        """
        try:
            result = await self._runner.run(["--version"], timeout=self._timeouts.status)
        except SkyDriverError as exc:
            raise SkyPreflightError(f"`sky --version` failed: {exc}") from exc
        found = _VERSION_RE.search(strip_ansi(result.stdout))
        if found is None:
            raise SkyPreflightError(f"`sky --version` printed no version: {result.stdout!r:.200}")
        client = found.group(1)
        if _version_tuple(client) < MIN_SKY_VERSION:
            raise SkyPreflightError(
                f"sky {client} is older than {'.'.join(map(str, MIN_SKY_VERSION))}, the oldest "
                f"Haru drives (tested with {TESTED_SKY_VERSION}): upgrade skypilot"
            )
        started = False
        for _ in range(2):
            info = await self._api_info()
            if info is not None:
                server, url = info
                if server is not None and _version_tuple(server) < MIN_SKY_VERSION:
                    raise SkyPreflightError(
                        f"the SkyPilot API server at {url} runs {server}, older than "
                        f"{'.'.join(map(str, MIN_SKY_VERSION))}: upgrade and restart it"
                    )
                return SkyApiInfo(client, server, url, started=started)
            if started:
                break
            logger.info("no SkyPilot API server answers: starting one (`sky api start`)")
            try:
                await self._runner.run(["api", "start"], timeout=self._timeouts.status)
            except SkyDriverError as exc:
                raise SkyPreflightError(f"`sky api start` failed: {exc}") from exc
            started = True
        raise SkyPreflightError(
            "the SkyPilot API server does not answer `sky api info` (start it with "
            "`sky api start`, or log in to a remote one with `sky api login`)"
        )

    async def _api_info(self) -> tuple[str | None, str | None] | None:
        """``(server version, url)`` from ``sky api info -o json``; ``None``: no server."""
        try:
            result = await self._runner.run(
                ["api", "info", "-o", "json"], timeout=self._timeouts.status
            )
        except SkyDriverError as exc:
            raise SkyPreflightError(f"`sky api info` failed: {exc}") from exc
        text = strip_ansi(result.stdout)
        start = text.find("{")
        if start < 0:
            return None  # "No SkyPilot API server is connected" / "Could not connect ..."
        try:
            document, _end = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError:
            return None
        server = document.get("server") if isinstance(document, dict) else None
        if not isinstance(server, dict):
            return None
        status = server.get("status")
        if status not in (None, "healthy"):
            raise SkyPreflightError(f"the SkyPilot API server reports status {status!r}")
        version = server.get("version")
        url = server.get("url")
        return (
            version if isinstance(version, str) else None,
            url if isinstance(url, str) else None,
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
