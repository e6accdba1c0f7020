"""The client of the local vLLM servers: every route the supervisor calls is pinned here.

Each model has its own ``vllm serve`` on ``127.0.0.1:<port>``, started with
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``. Its admin routes are unauthenticated
(vLLM's ``--api-key`` guards only ``/v1``), so they are only ever called on the loopback
interface, and only from here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
from haru_protocol import ProbeResult, SupervisorModel, join_url

from haru_supervisor._errors import VllmAdminError

logger = logging.getLogger(__name__)

VLLM_HOST: Final = "127.0.0.1"
"""vLLM's admin routes are unauthenticated: they are reached on the loopback interface only."""

SLEEP_PATH: Final = "/sleep"
WAKE_PATH: Final = "/wake_up"
IS_SLEEPING_PATH: Final = "/is_sleeping"
METRICS_PATH: Final = "/metrics"
CHAT_PATH: Final = "/v1/chat/completions"

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


def _parse_labels_end(line: str, start: int) -> int:
    """Index just past the ``}`` closing the label set that opens at ``start``."""
    in_quotes = False
    escaped = False
    for index in range(start + 1, len(line)):
        char = line[index]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            in_quotes = not in_quotes
        elif char == "}" and not in_quotes:
            return index + 1
    return -1


def sum_metrics(text: str, names: frozenset[str]) -> dict[str, float]:
    """Sum every sample of each metric in ``names`` in a Prometheus text exposition.

    Several engines (data parallel) or label sets each contribute a sample; the sum is what
    the server as a whole holds. A metric with no parseable sample is absent from the result.
    """
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            end = _parse_labels_end(line, brace)
            if end == -1:
                continue
            rest = line[end:]
        else:
            if space == -1:
                continue
            name, rest = line[:space], line[space:]
        if name not in names:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


class VllmAdminClient:
    """Calls the local vLLM servers (admin routes, metrics, the probe's chat completion).

    One instance per supervisor, sharing one :class:`aiohttp.ClientSession`.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        timeouts: VllmTimeouts | None = None,
        clock: Clock = time.monotonic,
        on_drain: Callable[[float], None] | None = None,
    ) -> None:
        """Create a client.

        Args:
            session: The supervisor's HTTP session (it must not use proxies: the targets
                are on the loopback interface).
            timeouts: Bounds on each call; defaults to :class:`VllmTimeouts`.
            clock: Monotonic seconds, for the drain budget and probe latency.
            on_drain: Told how long each drain before a sleep took (metrics).
        """
        self._on_drain = on_drain
        self._session = session
        self._timeouts = timeouts if timeouts is not None else VllmTimeouts()
        self._clock = clock

    @property
    def timeouts(self) -> VllmTimeouts:
        """The bounds in effect."""
        return self._timeouts

    @staticmethod
    def url(model: SupervisorModel, path: str) -> str:
        """The URL of ``path`` on ``model``'s server (always on the loopback interface)."""
        return join_url(f"http://{VLLM_HOST}:{model.port}", path)

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
            raise VllmAdminError(
                model.name, f"{path}: {_describe(exc, port=model.port, timeout_s=timeout_s)}"
            ) from exc
        if not 200 <= status < 300:
            detail = _excerpt(body)
            raise VllmAdminError(
                model.name, f"{path}: HTTP {status}" + (f": {detail}" if detail else "")
            )
        # Releases up to 0.24 answer an empty 200; newer ones a JSON object.
        return _json_object(body) if body.strip() else None

    async def sleep(
        self,
        model: SupervisorModel,
        *,
        level: int = SLEEP_LEVEL,
        drain_timeout_s: float | None = None,
    ) -> None:
        """Put ``model``'s server to sleep; returns once the engine is asleep.

        Args:
            model: The server.
            level: The sleep level (``/sleep?level=``).
            drain_timeout_s: When given, first wait up to this long for the requests in flight
                to finish (``/metrics`` running + waiting at 0), then sleep regardless.

        Raises:
            VllmAdminError: The server refused, failed or did not answer in time.
        """
        query = {"level": str(level)}
        if drain_timeout_s is not None and await self._timed_drain(model, drain_timeout_s):
            # Drained: a request that still slips in finishes instead of being aborted (vLLM
            # >= 0.17; older releases ignore the unknown query parameter). A drain that ran out
            # of budget keeps vLLM's default (abort): the step cannot wait any longer.
            query["mode"] = "wait"
        body = await self._admin_post(model, SLEEP_PATH, query)
        status = None if body is None else body.get("status")
        if status is not None and status != "sleeping":
            raise VllmAdminError(
                model.name, f"{SLEEP_PATH}: unexpected status {_excerpt(str(status).encode())!r}"
            )

    async def wake(self, model: SupervisorModel) -> None:
        """Wake everything on ``model``'s server (no tags); returns once it is awake.

        Raises:
            VllmAdminError: The server refused, failed, did not answer in time, or reports a
                partial wake (``"status": "sleeping"``).
        """
        body = await self._admin_post(model, WAKE_PATH, {})
        status = None if body is None else body.get("status")
        if status == "sleeping":
            raise VllmAdminError(model.name, f"{WAKE_PATH}: partial wake, the server still sleeps")
        if status is not None and status != "awake":
            raise VllmAdminError(
                model.name, f"{WAKE_PATH}: unexpected status {_excerpt(str(status).encode())!r}"
            )

    async def is_sleeping(self, model: SupervisorModel) -> bool | None:
        """``GET /is_sleeping``: True or False, or None when the answer proves nothing.

        Anything but a JSON object with a boolean ``is_sleeping`` (an error, a timeout, another
        body) proves nothing. Note that True also covers a paused or partly awake engine.
        """
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
                    return None
                body = await _read_capped(response, _BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            logger.debug(
                "%s: %s failed: %s",
                model.name,
                IS_SLEEPING_PATH,
                _describe(exc, port=model.port, timeout_s=timeout_s),
            )
            return None
        data = _json_object(body)
        value = None if data is None else data.get("is_sleeping")
        if not isinstance(value, bool):
            logger.debug(
                "%s: %s body proves nothing: %s", model.name, IS_SLEEPING_PATH, _excerpt(body)
            )
            return None
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
            The sum, or None when ``/metrics`` failed or lacks either gauge.
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
        if RUNNING_METRIC not in totals or WAITING_METRIC not in totals:
            logger.warning(
                "%s: %s lacks %s or %s; cannot tell whether requests are in flight",
                model.name,
                METRICS_PATH,
                RUNNING_METRIC,
                WAITING_METRIC,
            )
            return None
        return max(0, math.ceil(totals[RUNNING_METRIC] + totals[WAITING_METRIC]))

    async def drain(self, model: SupervisorModel, *, timeout_s: float) -> bool:
        """Wait, up to ``timeout_s``, until ``model``'s server has no request in flight.

        Returns:
            True when it drained; False when the budget ran out or the metrics could not tell
            (the caller sleeps anyway: a switchover never waits past its budget).
        """
        deadline = self._clock() + timeout_s
        if await self.is_sleeping(model) is True:
            # Requests parked on a sleeping engine cannot finish before a wake.
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
                    "%s: %d request(s) still in flight after draining %.1f s; sleeping anyway",
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
        """One non-streaming chat completion; ok only with a non-empty message content.

        Never raises for a failed completion: the failure is the result's ``error``.
        """
        payload = {
            "model": model.name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": False,
        }
        started = self._clock()
        error: str | None = None
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(self.url(model, CHAT_PATH), json=payload) as response:
                    body = await _read_capped(response, _BODY_LIMIT)
                    status = response.status
            if not 200 <= status < 300:
                detail = _excerpt(body)
                error = f"HTTP {status}" + (f": {detail}" if detail else "")
            elif not _has_content(body):
                error = "the completion has no message content"
        except (aiohttp.ClientError, TimeoutError, _BodyTooLargeError) as exc:
            error = _describe(exc, port=model.port, timeout_s=timeout_s)
        latency_ms = round((self._clock() - started) * 1000, 3)
        return ProbeResult(model=model.name, ok=error is None, latency_ms=latency_ms, error=error)


def _has_content(body: bytes) -> bool:
    data = _json_object(body)
    choices = None if data is None else data.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and content:
            return True
    return False
