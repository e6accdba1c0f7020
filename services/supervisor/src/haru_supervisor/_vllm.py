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

The wire format (routes, versions, bounded reads) is in :mod:`haru_supervisor._vllm_wire`, the
connection and what it remembers in :mod:`haru_supervisor._vllm_connection`.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from haru_protocol import ModelAction, ModelStatus, ProbeResult, SupervisorModel

from haru_supervisor._errors import VllmAdminError
from haru_supervisor._vllm_connection import Clock, VllmConnection, VllmTimeouts
from haru_supervisor._vllm_wire import (
    BODY_LIMIT,
    CHAT_PATH,
    IS_SLEEPING_PATH,
    MIN_VLLM_VERSION,
    SLEEP_LEVEL,
    SLEEP_MODE,
    SLEEP_PATH,
    WAKE_PATH,
    BodyTooLargeError,
    describe,
    excerpt,
    has_answer,
    is_refused,
    json_object,
    parse_vllm_version,
    read_capped,
    sum_metrics,
    version_refusal,
)

logger = logging.getLogger(__name__)

__all__ = (
    "MIN_VLLM_VERSION",
    "SLEEP_LEVEL",
    "SLEEP_MODE",
    "Clock",
    "VllmAdminClient",
    "VllmTimeouts",
    "parse_vllm_version",
    "sum_metrics",
    "version_refusal",
)


class VllmAdminClient(VllmConnection):
    """Calls the local vLLM servers (admin routes, metrics, version, the probe's completion).

    One instance per supervisor, sharing one :class:`aiohttp.ClientSession`. It remembers,
    per served model name, what it learnt of each server (see the module docstring).
    """

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
                model.name, f"{SLEEP_PATH}: unexpected status {excerpt(str(status).encode())!r}"
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
                model.name, f"{WAKE_PATH}: unexpected status {excerpt(str(status).encode())!r}"
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
                body = await read_capped(response, BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, BodyTooLargeError) as exc:
            self._lost(model, exc)
            logger.debug(
                "%s: %s failed: %s",
                model.name,
                IS_SLEEPING_PATH,
                describe(exc, port=model.port, timeout_s=timeout_s),
            )
            dropped = isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            dropped = dropped and not isinstance(exc, aiohttp.ClientConnectorError)
            return None, isinstance(exc, TimeoutError), is_refused(exc), dropped
        data = json_object(body)
        value = None if data is None else data.get("is_sleeping")
        if not isinstance(value, bool):
            logger.debug(
                "%s: %s body proves nothing: %s", model.name, IS_SLEEPING_PATH, excerpt(body)
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
                    body = await read_capped(response, BODY_LIMIT)
                    status = response.status
            if status == 401:
                error = "HTTP 401: the server wants an API key" + (
                    " (the configured key was refused)"
                    if key is not None
                    else " (set apiKeyEnv or apiKeyFile for this model)"
                )
            elif not 200 <= status < 300:
                detail = excerpt(body)
                error = f"HTTP {status}" + (f": {detail}" if detail else "")
            elif not has_answer(body):
                error = "the completion has no content, no reasoning, and did not stop at length"
        except (aiohttp.ClientError, TimeoutError, BodyTooLargeError) as exc:
            self._lost(model, exc)
            error = describe(exc, port=model.port, timeout_s=timeout_s)
        latency_ms = round((self._clock() - started) * 1000, 3)
        return ProbeResult(model=model.name, ok=error is None, latency_ms=latency_ms, error=error)
