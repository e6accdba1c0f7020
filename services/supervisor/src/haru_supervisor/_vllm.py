"""The client of the local vLLM servers: every route the supervisor calls is pinned here.

Each model has its own ``vllm serve`` on ``127.0.0.1:<port>``, started with
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``. Its admin routes are unauthenticated
(vLLM's ``--api-key`` guards only ``/v1``), so they are only ever called on the loopback
interface, and only from here.

The client also keeps what it knows of each server (README "Fidelity to vLLM"): its version
(``GET /version``, read at start-up and again after the connection was lost; below 0.17
the server is refused), the sleep or wake it has sent and not seen finish (vLLM does not
answer ``/is_sleeping`` meanwhile: the server is busy, not down), and a sleep whose outcome
is unknown (it timed out), which must be confirmed before any wake.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
from haru_protocol import ModelAction, ModelStatus, ProbeResult, SupervisorModel, join_url
from packaging.version import InvalidVersion, Version
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from haru_supervisor._errors import VllmAdminError

logger = logging.getLogger(__name__)

VLLM_HOST: Final = "127.0.0.1"
"""vLLM's admin routes are unauthenticated: they are reached on the loopback interface only."""

SLEEP_PATH: Final = "/sleep"
WAKE_PATH: Final = "/wake_up"
IS_SLEEPING_PATH: Final = "/is_sleeping"
METRICS_PATH: Final = "/metrics"
CHAT_PATH: Final = "/v1/chat/completions"
VERSION_PATH: Final = "/version"

MIN_VLLM_VERSION: Final = (0, 17)
"""Oldest vLLM the supervisor drives: ``/sleep`` pauses the scheduler first (and takes
``mode``) from 0.17.0 (vllm#34528); before, a sleep does not pause and requests keep running
on, or reach, a sleeping engine."""

SLEEP_MODE: Final = "abort"
"""``/sleep?mode=``: always ``abort`` (README "Sleep after a drain: abort, not wait")."""

DISABLE_LOG_STATS_FLAG: Final = "--disable-log-stats"

RUNNING_METRIC: Final = "vllm:num_requests_running"
WAITING_METRIC: Final = "vllm:num_requests_waiting"

SLEEP_LEVEL: Final = 1
"""Level-1 sleep: weights offloaded to CPU RAM, KV cache dropped, process alive."""

_BODY_LIMIT: Final = 1024 * 1024
_METRICS_LIMIT: Final = 8 * 1024 * 1024
_EXCERPT: Final = 200

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


class _BodyTooLargeError(Exception):
    pass


def parse_vllm_version(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.0``, ``0.17.0rc1``, ``0.9.2.dev3``).

    Read as a PEP 440 version (vLLM's own scheme, ``packaging.version``); None for anything
    else (a source build may report any string).
    """
    try:
        release = Version(text.strip()).release
    except InvalidVersion:
        return None
    return (release[0], release[1] if len(release) > 1 else 0)


def version_refusal(version: str) -> str | None:
    """Why the supervisor refuses a server of this vLLM version, or None when it accepts it.

    An unparseable version is accepted (a source build may report anything): only a version
    proved older than :data:`MIN_VLLM_VERSION` is refused.
    """
    parsed = parse_vllm_version(version)
    if parsed is None or parsed >= MIN_VLLM_VERSION:
        return None
    minimum = ".".join(str(part) for part in MIN_VLLM_VERSION)
    shown = _excerpt(version.encode())
    return (
        f"vLLM {shown} is not supported: the supervisor needs vLLM >= {minimum}.0, whose "
        "/sleep pauses the scheduler before sleeping (older releases keep serving requests "
        "on a sleeping engine); upgrade vLLM"
    )


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


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """Read a response body, refusing more than ``limit`` bytes."""
    if response.content_length is not None and response.content_length > limit:
        raise _BodyTooLargeError
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise _BodyTooLargeError
        chunks.append(chunk)
    return b"".join(chunks)


def _excerpt(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", errors="replace").split())
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + "..."


def _describe(exc: BaseException, *, port: int, timeout_s: float) -> str:
    """One short line for a transport failure (never a stack trace, never a body dump)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {VLLM_HOST}:{port} ({exc.strerror or 'connection failed'})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    if isinstance(exc, _BodyTooLargeError):
        return "the response body is too large"
    text = str(exc) or type(exc).__name__
    return _excerpt(text.encode())


def _json_object(body: bytes) -> Mapping[str, object] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def sum_metrics(text: str, names: frozenset[str]) -> dict[str, float]:
    """Sum every sample of each metric in ``names`` in a Prometheus text exposition.

    Several engines (data parallel) or label sets each contribute a sample; the sum is what
    the server as a whole holds. A metric with no parseable sample is absent from the result.

    Each sample line of a wanted metric is read by prometheus-client's parser on its own, so
    one malformed line (or one of an unrelated metric) costs only that sample, not the whole
    exposition; the histograms vLLM also exports are never parsed.
    """
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(tuple(names)):
            continue
        try:
            samples = [
                sample
                for family in text_string_to_metric_families(line + "\n")
                for sample in family.samples
            ]
        except ValueError:
            continue
        for sample in samples:
            if sample.name in names and not math.isnan(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _is_connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the server's process may have gone (refused, or dropped)."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError))


def _is_refused(exc: BaseException) -> bool:
    """Whether ``exc`` proves nothing listens on the port (the server is gone, not slow)."""
    return (
        isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno == errno.ECONNREFUSED
    )


class VllmAdminClient:
    """Calls the local vLLM servers (admin routes, metrics, version, the probe's completion).

    One instance per supervisor, sharing one :class:`aiohttp.ClientSession`. It remembers,
    per served model name, what it learnt of each server (see the module docstring).
    """

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
        if _is_connection_lost(exc):
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
                body = await _read_capped(response, _BODY_LIMIT)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            logger.debug(
                "%s: %s failed: %s",
                model.name,
                VERSION_PATH,
                _describe(exc, port=model.port, timeout_s=timeout_s),
            )
            return server.refusal
        server.answered = True
        data = _json_object(body) if status == 200 else None
        version = None if data is None else data.get("version")
        if not isinstance(version, str) or not version.strip():
            logger.warning(
                "%s: %s answered HTTP %d without a version: %s",
                model.name,
                VERSION_PATH,
                status,
                _excerpt(body),
            )
            return server.refusal
        version = version.strip()[:_EXCERPT]
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

    # -- status ------------------------------------------------------------------------------

    async def status(self, model: SupervisorModel) -> ModelStatus:
        """The server's status as the supervisor knows it (never raises).

        While a sleep or wake sent by the supervisor runs, ``/is_sleeping`` is not asked (vLLM
        answers it only between engine steps): ``sleeping`` is null and ``action`` says why.
        After a sleep whose outcome is unknown, ``/is_sleeping`` is asked: an answer confirms
        it; no answer in time keeps the server "busy sleeping".
        """
        server = self._server(model)

        def build(
            sleeping: bool | None, action: ModelAction | None = None, *, down: bool = False
        ) -> ModelStatus:
            server.sleeping = sleeping
            return ModelStatus(
                name=model.name,
                port=model.port,
                sleeping=sleeping,
                action=action,
                vllm_version=server.version,
                error=server.refusal,
                down=down,
            )

        if server.action is not None:
            return build(None, server.action)
        # Concurrently: a status must answer within one read bound (heartbeats wait ~5 s).
        refusal, (sleeping, timed_out, refused) = await asyncio.gather(
            self.connect(model), self._read_sleeping(model)
        )
        if refusal is not None:
            return build(None, down=refused)
        if (started := self._server(model).action) is not None:
            # An action started while this read was on its way: it says more.
            return build(None, started)
        if server.sleep_unfinished:
            if sleeping is not None:
                server.sleep_unfinished = False
                logger.info(
                    "%s: the unfinished sleep is over (is_sleeping=%s)", model.name, sleeping
                )
            elif timed_out:
                return build(None, "sleep")
        return build(sleeping, down=refused)

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
                body = await _read_capped(response, _BODY_LIMIT)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            self._lost(model, exc)
            # A refused connection never reached vLLM; anything else may have.
            unfinished = not isinstance(exc, aiohttp.ClientConnectorError)
            raise VllmAdminError(
                model.name,
                f"{path}: {_describe(exc, port=model.port, timeout_s=timeout_s)}",
                unfinished=unfinished,
            ) from exc
        if not 200 <= status < 300:
            detail = _excerpt(body)
            raise VllmAdminError(
                model.name, f"{path}: HTTP {status}" + (f": {detail}" if detail else "")
            )
        # Releases up to 0.31 answer an empty 200; newer ones a JSON object.
        return _json_object(body) if body.strip() else None

    async def sleep(
        self,
        model: SupervisorModel,
        *,
        level: int = SLEEP_LEVEL,
        drain_timeout_s: float | None = None,
    ) -> None:
        """Put ``model``'s server to sleep; returns once the engine is asleep.

        Always ``mode=abort`` (README "Sleep after a drain: abort, not wait"): with a drain,
        the server first gets up to ``drain_timeout_s`` to finish its requests, and what is
        still there when the sleep pauses the engine ends with ``finish_reason: "abort"``
        instead of staying parked until the next wake.

        Args:
            model: The server.
            level: The sleep level (``/sleep?level=``).
            drain_timeout_s: When given, first wait up to this long for the requests in flight
                to finish (``/metrics`` running + waiting at 0), then sleep regardless.

        Raises:
            VllmAdminError: The server is refused (version), refused the sleep, failed or did
                not answer in time (then the sleep is "unfinished" until a status read or the
                next wake confirms the state).
        """
        await self._check_supported(model)
        server = self._server(model)
        server.action = "sleep"
        try:
            if drain_timeout_s is not None:
                await self._timed_drain(model, drain_timeout_s)
            body = await self._admin_post(
                model, SLEEP_PATH, {"level": str(level), "mode": SLEEP_MODE}
            )
        except VllmAdminError as exc:
            if exc.unfinished:
                server.sleep_unfinished = True
                logger.warning(
                    "%s: the sleep's outcome is unknown (%s); its state is confirmed before "
                    "any wake",
                    model.name,
                    exc.reason,
                )
            raise
        finally:
            server.action = None
        server.sleep_unfinished = False
        status = None if body is None else body.get("status")
        if status is not None and status != "sleeping":
            raise VllmAdminError(
                model.name, f"{SLEEP_PATH}: unexpected status {_excerpt(str(status).encode())!r}"
            )

    async def _confirm_sleep_finished(self, model: SupervisorModel) -> None:
        """Wait (up to the admin bound) until ``/is_sleeping`` answers after an unknown sleep.

        vLLM answers ``/is_sleeping`` only between engine steps, so an answer proves the
        executor's sleep is over (a ``mode=abort`` sleep is never deferred): only then may a
        wake follow, or the sleep would run after it and leave the server asleep.
        """
        server = self._server(model)
        deadline = self._clock() + self._timeouts.admin_s
        while True:
            sleeping, _, _ = await self._read_sleeping(model)
            if sleeping is not None:
                server.sleep_unfinished = False
                logger.info(
                    "%s: the unfinished sleep is over (is_sleeping=%s)", model.name, sleeping
                )
                return
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise VllmAdminError(
                    model.name,
                    "a sleep of this server timed out and /is_sleeping still does not answer "
                    f"after {self._timeouts.admin_s:g} s: not waking it while that sleep may "
                    "still run (retry the wake later)",
                )
            await asyncio.sleep(min(self._timeouts.drain_poll_s, remaining))

    async def wake(self, model: SupervisorModel) -> None:
        """Wake everything on ``model``'s server (no tags); returns once it is awake.

        After a sleep whose outcome is unknown, the state is confirmed first (see
        :meth:`_confirm_sleep_finished`): a wake is never sent while that sleep may still run.

        Raises:
            VllmAdminError: The server is refused (version), a previous sleep is still
                unfinished, or the wake was refused, failed, did not answer in time, or
                reports a partial wake (``"status": "sleeping"``).
        """
        await self._check_supported(model)
        server = self._server(model)
        server.action = "wake"
        try:
            if server.sleep_unfinished:
                await self._confirm_sleep_finished(model)
            body = await self._admin_post(model, WAKE_PATH, {})
        finally:
            server.action = None
        status = None if body is None else body.get("status")
        if status == "sleeping":
            raise VllmAdminError(model.name, f"{WAKE_PATH}: partial wake, the server still sleeps")
        if status is not None and status != "awake":
            raise VllmAdminError(
                model.name, f"{WAKE_PATH}: unexpected status {_excerpt(str(status).encode())!r}"
            )

    async def _read_sleeping(self, model: SupervisorModel) -> tuple[bool | None, bool, bool]:
        """``GET /is_sleeping``: (the answer; timed out; connection refused).

        The answer is True, False, or None when it proved nothing. A pooled connection the
        server dropped (a killed process resets it) is asked again once on a fresh one, so
        the first status after a kill already says whether anything listens.
        """
        value, timed_out, refused, dropped = await self._read_sleeping_once(model)
        if dropped:
            value, timed_out, refused, _ = await self._read_sleeping_once(model)
        return value, timed_out, refused

    async def _read_sleeping_once(
        self, model: SupervisorModel
    ) -> tuple[bool | None, bool, bool, bool]:
        timeout_s = self._timeouts.read_s
        try:
            async with self._session.get(
                self.url(model, IS_SLEEPING_PATH),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status != 200:
                    # Heartbeats poll this: a server that stays down must not flood the log.
                    logger.debug(
                        "%s: %s answered HTTP %d", model.name, IS_SLEEPING_PATH, response.status
                    )
                    return None, False, False, False
                body = await _read_capped(response, _BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            self._lost(model, exc)
            logger.debug(
                "%s: %s failed: %s",
                model.name,
                IS_SLEEPING_PATH,
                _describe(exc, port=model.port, timeout_s=timeout_s),
            )
            dropped = isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            dropped = dropped and not isinstance(exc, aiohttp.ClientConnectorError)
            return None, isinstance(exc, TimeoutError), _is_refused(exc), dropped
        data = _json_object(body)
        value = None if data is None else data.get("is_sleeping")
        if not isinstance(value, bool):
            logger.debug(
                "%s: %s body proves nothing: %s", model.name, IS_SLEEPING_PATH, _excerpt(body)
            )
            return None, False, False, False
        return value, False, False, False

    async def is_sleeping(self, model: SupervisorModel) -> bool | None:
        """``GET /is_sleeping``: True or False, or None when the answer proves nothing.

        Anything but a JSON object with a boolean ``is_sleeping`` (an error, a timeout, another
        body) proves nothing. Note that True also covers a paused or partly awake engine.
        """
        value, _, _ = await self._read_sleeping(model)
        return value

    # -- drain -------------------------------------------------------------------------------

    async def _timed_drain(self, model: SupervisorModel, timeout_s: float) -> bool:
        started = self._clock()
        try:
            return await self.drain(model, timeout_s=timeout_s)
        finally:
            if self._on_drain is not None:
                self._on_drain(self._clock() - started)

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
                body = await _read_capped(response, _METRICS_LIMIT)
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            self._lost(model, exc)
            logger.warning(
                "%s: %s failed: %s",
                model.name,
                METRICS_PATH,
                _describe(exc, port=model.port, timeout_s=timeout_s),
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

    async def drain(self, model: SupervisorModel, *, timeout_s: float) -> bool:
        """Wait, up to ``timeout_s``, until ``model``'s server has no request in flight.

        The gauges change only per engine step and do not count a request being tokenised, so
        a drain ends only after two zero readings ``drain_quiet_s`` apart.

        Returns:
            True when it drained; False when the budget ran out or the metrics could not tell
            (the caller sleeps anyway: a switchover never waits past its budget).
        """
        deadline = self._clock() + timeout_s
        if await self.is_sleeping(model) is True:
            # Already asleep: nothing can finish before a wake (the sleep's abort mode ends
            # whatever is parked there).
            return True
        quiet_since: float | None = None
        while True:
            remaining = deadline - self._clock()
            in_flight = await self.requests_in_flight(
                model, timeout_s=max(0.001, min(self._timeouts.read_s, remaining))
            )
            if in_flight is None:
                return False
            now = self._clock()
            if in_flight == 0:
                if quiet_since is None:
                    quiet_since = now
                if now - quiet_since >= self._timeouts.drain_quiet_s or now >= deadline:
                    return True
            else:
                quiet_since = None
            remaining = deadline - now
            if remaining <= 0:
                logger.warning(
                    "%s: %d request(s) still in flight after draining %.1f s; sleeping anyway "
                    "(they are aborted)",
                    model.name,
                    in_flight,
                    timeout_s,
                )
                return False
            await asyncio.sleep(min(self._timeouts.drain_poll_s, remaining))

    # -- probe -------------------------------------------------------------------------------

    async def probe(
        self,
        model: SupervisorModel,
        *,
        prompt: str,
        max_tokens: int,
        timeout_s: float,
    ) -> ProbeResult:
        """One non-streaming chat completion; ok only when the model answered something.

        An answer is a non-empty ``message.content``, a non-empty ``message.reasoning`` or
        ``message.reasoning_content`` (a reasoning parser may put a short answer there and
        leave ``content`` null), or ``finish_reason == "length"``. The model's API key, when
        configured, is sent as a bearer token. Never raises: the failure is the ``error``.
        """
        refusal = await self.connect(model)
        if refusal is not None:
            return ProbeResult(model=model.name, ok=False, latency_ms=0.0, error=refusal)
        payload = {
            "model": model.name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": False,
        }
        key = self._api_keys.get(model.name)
        headers = None if key is None else {"Authorization": f"Bearer {key.get_secret_value()}"}
        started = self._clock()
        error: str | None = None
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(
                    self.url(model, CHAT_PATH), json=payload, headers=headers
                ) as response:
                    body = await _read_capped(response, _BODY_LIMIT)
                    status = response.status
            if status == 401:
                error = "HTTP 401: the server wants an API key" + (
                    " (the configured key was refused)"
                    if key is not None
                    else " (set apiKeyEnv or apiKeyFile for this model)"
                )
            elif not 200 <= status < 300:
                detail = _excerpt(body)
                error = f"HTTP {status}" + (f": {detail}" if detail else "")
            elif not _has_answer(body):
                error = "the completion has no content, no reasoning, and did not stop at length"
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            self._lost(model, exc)
            error = _describe(exc, port=model.port, timeout_s=timeout_s)
        latency_ms = round((self._clock() - started) * 1000, 3)
        return ProbeResult(model=model.name, ok=error is None, latency_ms=latency_ms, error=error)


_ANSWER_FIELDS: Final = ("content", "reasoning", "reasoning_content")


def _has_answer(body: bytes) -> bool:
    data = _json_object(body)
    choices = None if data is None else data.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") == "length":
            return True
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        for name in _ANSWER_FIELDS:
            value = message.get(name)
            if isinstance(value, str) and value:
                return True
    return False
