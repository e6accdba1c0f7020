"""The supervisor's connection to its local vLLM servers: sessions, versions, admin posts.

:class:`VllmConnection` keeps what the supervisor knows of each server (its version, read
again after a lost connection; the action in flight; an unfinished sleep), reads
``GET /version`` and the request gauges of ``/metrics``, and posts the admin routes. The
verbs built on it (status, sleep, wake, drain, probe) are those of
:class:`~haru_supervisor._vllm.VllmAdminClient`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from haru_protocol import ModelAction, SupervisorModel, join_url
from pydantic import SecretStr

from haru_supervisor._errors import VllmAdminError
from haru_supervisor._vllm_wire import (
    BODY_LIMIT,
    DISABLE_LOG_STATS_FLAG,
    EXCERPT,
    METRICS_LIMIT,
    METRICS_PATH,
    RUNNING_METRIC,
    VERSION_PATH,
    VLLM_HOST,
    WAITING_METRIC,
    BodyTooLargeError,
    describe,
    excerpt,
    is_connection_lost,
    json_object,
    parse_vllm_version,
    read_capped,
    sum_metrics,
    version_refusal,
)

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Monotonic seconds; injected so tests control budgets."""


@dataclass(frozen=True, kw_only=True)
class VllmTimeouts:
    """Bounds on calls to a local vLLM server.

    Attributes:
        admin_s: ``/sleep`` and ``/wake_up``: they return only once the engine finished, which
            takes tens of seconds for a large model (level-1 sleep of an 8B model: about 10 s).
        read_s: ``/is_sleeping`` and ``/metrics``: heartbeats poll them, so they are tight.
        drain_poll_s: Interval between ``/metrics`` reads while draining before a sleep.
        drain_quiet_s: A drain ends only after two zero readings at least this far apart: a
            request that read the routing pointer just before the switch may still be on its
            way to this server when the first zero is read.
    """

    admin_s: float = 120.0
    read_s: float = 5.0
    drain_poll_s: float = 0.1
    drain_quiet_s: float = 0.2


@dataclass
class _Server:
    """What the supervisor knows of one vLLM server."""

    action: ModelAction | None = None
    """The sleep or wake sent and not finished yet."""
    sleep_unfinished: bool = False
    """A sleep timed out or lost its connection: it may still run in vLLM."""
    version: str | None = None
    """``GET /version``; None until read, and again once the connection was lost."""
    answered: bool = False
    """``GET /version`` was answered since the last connection loss (maybe without one)."""
    refusal: str | None = None
    sleeping: bool | None = None
    """What the last status said (None: unknown, an action in flight, or no answer)."""
    gauges_reported: bool = False
    version_unparsed_reported: bool = False


class VllmConnection:
    """The state and the low-level calls of :class:`~haru_supervisor._vllm.VllmAdminClient`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        timeouts: VllmTimeouts | None = None,
        clock: Clock = time.monotonic,
        api_keys: Mapping[str, SecretStr] | None = None,
        on_drain: Callable[[float], None] | None = None,
    ) -> None:
        """Create a client.

        Args:
            session: The supervisor's HTTP session (it must not use proxies: the targets
                are on the loopback interface).
            timeouts: Bounds on each call; defaults to :class:`VllmTimeouts`.
            clock: Monotonic seconds, for the drain budget and probe latency.
            api_keys: A server's ``--api-key`` by model name, sent by the probe only.
            on_drain: Told how long each drain before a sleep took (metrics).
        """
        self._on_drain = on_drain
        self._session = session
        self._timeouts = timeouts if timeouts is not None else VllmTimeouts()
        self._clock = clock
        self._api_keys = dict(api_keys or {})
        self._servers: dict[str, _Server] = {}

    @property
    def timeouts(self) -> VllmTimeouts:
        """The bounds in effect."""
        return self._timeouts

    @staticmethod
    def url(model: SupervisorModel, path: str) -> str:
        """The URL of ``path`` on ``model``'s server (always on the loopback interface)."""
        return join_url(f"http://{VLLM_HOST}:{model.port}", path)

    def last_sleeping(self) -> dict[str, bool | None]:
        """Per model name, whether its server slept at its last status (None: unknown)."""
        return {name: server.sleeping for name, server in self._servers.items()}

    def _server(self, model: SupervisorModel) -> _Server:
        return self._servers.setdefault(model.name, _Server())

    def _lost(self, model: SupervisorModel, exc: BaseException) -> None:
        if is_connection_lost(exc):
            # It may come back as another process (another version): read it again then.
            server = self._server(model)
            server.version = None
            server.refusal = None
            server.answered = False

    # -- version -----------------------------------------------------------------------------

    async def connect(self, model: SupervisorModel) -> str | None:
        """Read ``GET /version`` (and check the gauges) unless already read since connected.

        Called at start-up for every model, and before each status, sleep, wake and probe
        while the version is unknown (never read, or the connection was lost since). Never
        raises: an unreachable server keeps an unknown version and is read again later.

        Returns:
            Why the server is refused (too old), or None.
        """
        server = self._server(model)
        if server.answered:
            return server.refusal
        timeout_s = self._timeouts.read_s
        try:
            async with self._session.get(
                self.url(model, VERSION_PATH), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                body = await read_capped(response, BODY_LIMIT)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, BodyTooLargeError) as exc:
            logger.debug(
                "%s: %s failed: %s",
                model.name,
                VERSION_PATH,
                describe(exc, port=model.port, timeout_s=timeout_s),
            )
            return server.refusal
        server.answered = True
        data = json_object(body) if status == 200 else None
        version = None if data is None else data.get("version")
        if not isinstance(version, str) or not version.strip():
            logger.warning(
                "%s: %s answered HTTP %d without a version: %s",
                model.name,
                VERSION_PATH,
                status,
                excerpt(body),
            )
            return server.refusal
        version = version.strip()[:EXCERPT]
        changed = server.version != version
        server.version = version
        server.refusal = version_refusal(version)
        if server.refusal is not None:
            logger.error("%s: %s", model.name, server.refusal)
        elif parse_vllm_version(version) is None and not server.version_unparsed_reported:
            server.version_unparsed_reported = True
            logger.warning(
                "%s: cannot parse the vLLM version %r; assuming >= 0.17", model.name, version
            )
        elif changed:
            logger.info("%s: vLLM %s on port %d", model.name, version, model.port)
        if not server.gauges_reported:
            await self.requests_in_flight(model, timeout_s=timeout_s)
        return server.refusal

    def version(self, model: SupervisorModel) -> str | None:
        """The server's version as last read (None: not read yet, or connection lost since)."""
        return self._server(model).version

    async def _check_supported(self, model: SupervisorModel) -> None:
        refusal = await self.connect(model)
        if refusal is not None:
            raise VllmAdminError(model.name, refusal)

    # -- admin -------------------------------------------------------------------------------

    async def _admin_post(
        self, model: SupervisorModel, path: str, params: Mapping[str, str]
    ) -> Mapping[str, object] | None:
        """POST an admin route; returns its JSON object body, or None for an empty/other body."""
        timeout_s = self._timeouts.admin_s
        try:
            async with self._session.post(
                self.url(model, path),
                params=params,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                body = await read_capped(response, BODY_LIMIT)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, BodyTooLargeError) as exc:
            self._lost(model, exc)
            # A refused connection never reached vLLM; anything else may have.
            unfinished = not isinstance(exc, aiohttp.ClientConnectorError)
            raise VllmAdminError(
                model.name,
                f"{path}: {describe(exc, port=model.port, timeout_s=timeout_s)}",
                unfinished=unfinished,
            ) from exc
        if not 200 <= status < 300:
            detail = excerpt(body)
            raise VllmAdminError(
                model.name, f"{path}: HTTP {status}" + (f": {detail}" if detail else "")
            )
        # Releases up to 0.31 answer an empty 200; newer ones a JSON object.
        return json_object(body) if body.strip() else None

    async def requests_in_flight(self, model: SupervisorModel, *, timeout_s: float) -> int | None:
        """Requests running plus waiting on ``model``'s server, from ``/metrics``.

        Returns:
            The sum, or None when ``/metrics`` failed or lacks either gauge (a server started
            with ``--disable-log-stats``: reported once, as an error naming the flag).
        """
        try:
            async with self._session.get(
                self.url(model, METRICS_PATH),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status != 200:
                    logger.warning(
                        "%s: %s answered HTTP %d", model.name, METRICS_PATH, response.status
                    )
                    return None
                body = await read_capped(response, METRICS_LIMIT)
        except (aiohttp.ClientError, TimeoutError, BodyTooLargeError) as exc:
            self._lost(model, exc)
            logger.warning(
                "%s: %s failed: %s",
                model.name,
                METRICS_PATH,
                describe(exc, port=model.port, timeout_s=timeout_s),
            )
            return None
        totals = sum_metrics(
            body.decode("utf-8", errors="replace"), frozenset((RUNNING_METRIC, WAITING_METRIC))
        )
        server = self._server(model)
        if RUNNING_METRIC not in totals or WAITING_METRIC not in totals:
            if not server.gauges_reported:
                server.gauges_reported = True
                logger.error(
                    "%s: %s has no %s / %s gauges, so the supervisor cannot tell whether "
                    "requests are in flight: a sleep cannot drain them first (they are "
                    "aborted). vLLM serves no gauges when started with %s: restart it without "
                    "that flag. (Reported once.)",
                    model.name,
                    METRICS_PATH,
                    RUNNING_METRIC,
                    WAITING_METRIC,
                    DISABLE_LOG_STATS_FLAG,
                )
            else:
                logger.debug("%s: %s still lacks the gauges", model.name, METRICS_PATH)
            return None
        server.gauges_reported = True
        return max(0, math.ceil(totals[RUNNING_METRIC] + totals[WAITING_METRIC]))
