"""The ``sky`` runner: argv only, time-bounded, one retry on a cold API server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from haru_exec import (
    Exec,
    ExecError,
    ExecResult,
    ExecSpawnError,
    ExecTimeoutError,
    run_exec,
)

from haru_driver_skypilot._errors import (
    SkyCliError,
    SkyOutputError,
    SkyTimeoutError,
    SkyUnavailableError,
    SkyVersionMismatchError,
)

logger = logging.getLogger(__name__)

_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")

# A `sky` call that failed because the local API server was not (yet) accepting connections:
# the request never reached a server, so running it again cannot do anything twice. The
# client's informational "Failed to connect to SkyPilot API server at ... Starting a local
# server." line is NOT such a failure: it precedes a request that then reached the server it
# started, and a command that failed afterwards failed for its own reasons
# (sky/client/common.py, sky/server/common.py: check_server_healthy_or_start_fn).
_COLD_SERVER_RE = re.compile(
    r"connection refused|connectionrefused|could not connect to skypilot api server",
    re.IGNORECASE,
)


SKY_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "TZ",
        "TMPDIR",
        "TERM",
        "VIRTUAL_ENV",
        "KUBECONFIG",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
    }
)
"""Variables a ``sky`` call keeps by name (see :func:`sky_environment`)."""

SKY_ENV_PREFIXES = (
    "SKYPILOT_",
    "LC_",
    "XDG_",
    "AWS_",
    "GOOGLE_",
    "GCLOUD_",
    "CLOUDSDK_",
    "AZURE_",
    "ARM_",
    "OCI_",
    "LAMBDA_",
    "RUNPOD_",
    "VAST_",
    "NEBIUS_",
    "CUDO_",
    "FLUIDSTACK_",
    "PAPERSPACE_",
    "DO_",
    "IBM_",
    "SCP_",
    "HYPERBOLIC_",
    "KUBERNETES_",
    "R2_",
    "CLOUDFLARE_",
)
"""Prefixes of the variables a ``sky`` call keeps: SkyPilot's own and clouds' credentials."""

SKY_ENV_DROPPED = frozenset({"PROMETHEUS_MULTIPROC_DIR"})
"""Variables a ``sky`` call never gets, even from an explicit environment: a ``HARU_WORKERS``
worker's metrics folder (a child that made prometheus_client metrics would write them into
the server's ``/metrics`` until the worker set stops)."""


def sky_environment(source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a ``sky`` call gets: what SkyPilot needs of ``source``, nothing else.

    A ``sky`` command that finds no API server starts one, and that server inherits the
    command's environment for as long as it runs (``sky/server/common.py``: the local
    server is spawned from the client). Haru's own variables (the supervisor token, the
    database URL) must not live on in it, so only :data:`SKY_ENV_NAMES` and the
    :data:`SKY_ENV_PREFIXES` pass (cloud credentials, ``SKYPILOT_*``); a launch adds its
    secrets for that one call.

    Args:
        source: The environment to filter; this process's when ``None``.
    """
    env = os.environ if source is None else source
    return {
        name: value
        for name, value in env.items()
        if name in SKY_ENV_NAMES or name.startswith(SKY_ENV_PREFIXES)
    }


# The client and the API server speak different API versions (sky/exceptions.py
# APIVersionMismatchError, raised by sky/server/common.py check_server_healthy).
_VERSION_MISMATCH_RE = re.compile(r"APIVersionMismatchError|version mismatch", re.IGNORECASE)


def strip_ansi(text: str) -> str:
    """Remove terminal escape sequences (colours, bold) that ``sky`` prints even to pipes."""
    return _ANSI_RE.sub("", text)


def is_cold_server_failure(result: ExecResult) -> bool:
    """Whether a failed ``sky`` call looks like it hit a local API server still starting."""
    if result.ok:
        return False
    return _COLD_SERVER_RE.search(strip_ansi(f"{result.stdout}\n{result.stderr}")) is not None


@dataclass(frozen=True, slots=True)
class SkyTimeouts:
    """Time bounds, in seconds, of each kind of ``sky`` command.

    Attributes:
        launch: ``sky launch`` and ``sky serve up``: provisioning, setup and (for services)
            the controller launch take many minutes.
        status: ``sky status`` and ``sky serve status``: quick queries, but the first call
            may auto-start the local API server (about 20 s cold).
        stop: ``sky stop``: the client waits for the instances to stop.
        down: ``sky down`` and ``sky serve down``: the client waits for the termination.
    """

    launch: float = 1800.0
    status: float = 60.0
    stop: float = 300.0
    down: float = 300.0

    def __post_init__(self) -> None:
        for name in ("launch", "status", "stop", "down"):
            if not getattr(self, name) > 0:
                raise ValueError(f"timeout {name!r} must be positive")


class SkyRunner:
    """Runs ``sky`` subcommands through the protocol's exec boundary.

    Every call is an argv list (never a shell) with an explicit time bound. A call that fails
    because the local API server refused the connection (``Connection refused``, ``Could not
    connect to SkyPilot API server``) is retried ``cold_start_retries`` times after
    ``retry_delay`` seconds, unless the caller passes ``retry_cold=False`` (launches: a
    second ``sky launch`` is a second full launch); any other failure is raised at once.
    """

    def __init__(
        self,
        *,
        executable: str = "sky",
        execute: Exec = run_exec,
        env: Mapping[str, str] | None = None,
        cold_start_retries: int = 1,
        retry_delay: float = 3.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Create a runner.

        Args:
            executable: The ``sky`` binary: a name looked up on ``PATH`` or a path.
            execute: The exec function (inject a fake in tests).
            env: The complete environment of the child (less :data:`SKY_ENV_DROPPED`), or
                ``None`` for :func:`sky_environment` of this process's environment, read at
                each call (never Haru's whole environment: an API server the call starts
                keeps it).
            cold_start_retries: How many times to retry a cold-server failure.
            retry_delay: Seconds to wait before such a retry.
            sleep: The sleep function used for that wait (inject to keep tests fast).
        """
        if cold_start_retries < 0:
            raise ValueError("cold_start_retries must be >= 0")
        if retry_delay < 0:
            raise ValueError("retry_delay must be >= 0")
        self._executable = executable
        self._execute = execute
        self._env = None if env is None else dict(env)
        self._retries = cold_start_retries
        self._retry_delay = retry_delay
        self._sleep = sleep

    @property
    def executable(self) -> str:
        """The ``sky`` binary this runner calls."""
        return self._executable

    async def run(
        self,
        args: Sequence[str],
        *,
        timeout: float,
        extra_env: Mapping[str, str] | None = None,
        retry_cold: bool = True,
    ) -> ExecResult:
        """Run ``sky <args...>`` and return its result when it exits with status 0.

        Args:
            args: The arguments after ``sky``.
            timeout: Seconds the command may run (per attempt).
            extra_env: Variables added to the child's environment for this call only (the
                values of ``--secret NAME`` arguments); never logged.
            retry_cold: Whether a connection-refused failure may be retried (never for a
                command that must not run twice, such as ``sky launch``).

        Raises:
            SkyCliError: it exited non-zero (after the cold-server retry, if that applied).
            SkyTimeoutError: it ran past ``timeout`` and was killed.
            SkyUnavailableError: ``sky`` could not be started.
            SkyOutputError: it printed more than the exec boundary accepts.
        """
        argv = (self._executable, *args)
        env = sky_environment() if self._env is None else dict(self._env)
        for name in SKY_ENV_DROPPED:
            env.pop(name, None)
        if extra_env:
            env.update(extra_env)
        attempt = 0
        while True:
            logger.debug("running %s (timeout %.0f s)", argv, timeout)
            try:
                result = await self._execute(argv, timeout=timeout, env=env)
            except ExecTimeoutError as exc:
                raise SkyTimeoutError(str(exc), argv=argv, timeout=timeout) from exc
            except ExecSpawnError as exc:
                raise SkyUnavailableError(str(exc), argv=argv) from exc
            except ExecError as exc:
                raise SkyOutputError(str(exc), argv=argv) from exc
            if result.ok:
                return result
            if retry_cold and attempt < self._retries and is_cold_server_failure(result):
                attempt += 1
                logger.warning(
                    "%s failed on a cold SkyPilot API server (status %d); retrying in %.1f s",
                    argv[:3],
                    result.returncode,
                    self._retry_delay,
                )
                await self._sleep(self._retry_delay)
                continue
            error = SkyCliError.from_result(result)
            if _VERSION_MISMATCH_RE.search(strip_ansi(f"{result.stdout}\n{result.stderr}")):
                mismatch = SkyVersionMismatchError(
                    f"{error} (the sky client and its API server run different versions: "
                    "restart the API server with `sky api stop`)",
                    argv=error.argv,
                    returncode=error.returncode,
                    stderr=error.stderr,
                    stdout_tail=error.stdout_tail,
                )
                raise mismatch
            raise error


def _write_file(directory: str, filename: str, text: str) -> Path:
    path = Path(directory) / filename
    path.write_text(text, encoding="utf-8")
    return path


@contextlib.asynccontextmanager
async def temporary_yaml(text: str, *, filename: str) -> AsyncIterator[Path]:
    """Write ``text`` to a file in a fresh private temp dir; remove the dir on exit.

    The directory is created mode 0700 because ``envs`` may carry credentials.

    Args:
        text: The YAML document.
        filename: The file's name inside the temp dir (e.g. ``<cluster>.yaml``).
    """
    if "/" in filename or filename in {"", ".", ".."}:
        raise ValueError(f"bad file name {filename!r}")
    directory = await asyncio.to_thread(tempfile.mkdtemp, prefix="haru-sky-")
    try:
        yield await asyncio.to_thread(_write_file, directory, filename, text)
    finally:
        await asyncio.to_thread(shutil.rmtree, directory, True)
