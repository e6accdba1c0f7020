"""Listening with the hardened handler, and stopping on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

from haru_web._errors import ListenError
from haru_web._handler import ConnectionRegistry, harden
from haru_web._limits import RateLimitedLog, ServerLimits, connection_cap
from haru_web._logs import AccessLogger
from haru_web._tls import ReloadingServerContext, TlsFiles

logger = logging.getLogger("haru_web")


class HardenedAppRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose connections honour :class:`ServerLimits`."""

    def __init__(self, app: web.Application, *, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        cap = connection_cap(limits.max_connections)
        if cap < limits.max_connections:
            logger.warning(
                "connection cap lowered from %d to %d to stay under the open-file limit",
                limits.max_connections,
                cap,
            )
            limits = dataclasses.replace(limits, max_connections=cap)
        self.registry = ConnectionRegistry(
            limits, RateLimitedLog(logging.getLogger("haru_web.protocol"))
        )

    async def _make_server(self) -> web.Server:
        return harden(await super()._make_server(), self.registry)


@dataclass(frozen=True, slots=True)
class Listening:
    """Where a service listens.

    Attributes:
        host: The bound address (``0.0.0.0`` or ``127.0.0.1``).
        port: The bound port (the real one when 0 was asked).
        url: A base URL a local client can use (loopback for ``0.0.0.0``); ``https`` when
            the listener serves TLS.
    """

    host: str
    port: int
    url: str


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    *,
    host: str,
    port: int,
    limits: ServerLimits,
    shutdown_timeout: float,
    reuse_port: bool = False,
    tls: TlsFiles | None = None,
) -> AsyncIterator[Listening]:
    """Start ``app`` on ``host:port`` with the hardened handler; clean up on exit.

    ``reuse_port`` binds with ``SO_REUSEPORT``, so several processes can share one port.
    ``tls`` serves HTTPS only (never plain HTTP beside it), re-reading the files when they
    change.

    Raises:
        ListenError: The address could not be bound.
        TlsConfigError: The TLS files do not load.
    """
    ssl_context = None if tls is None else ReloadingServerContext(tls).context
    runner = HardenedAppRunner(
        app,
        limits=limits,
        handle_signals=False,
        shutdown_timeout=shutdown_timeout,
        access_log_class=AccessLogger,
    )
    await runner.setup()
    try:
        site = web.TCPSite(
            runner, host, port, reuse_port=reuse_port or None, ssl_context=ssl_context
        )
        try:
            await site.start()
        except OSError as exc:
            raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        bound = runner.addresses[0][1]
        # A URL this machine can call: the wildcard addresses are reached over loopback.
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        if ":" in local:
            local = f"[{local}]"
        scheme = "http" if ssl_context is None else "https"
        yield Listening(host=host, port=bound, url=f"{scheme}://{local}:{bound}")
    finally:
        await runner.cleanup()


class StopSignals:
    """SIGINT/SIGTERM handlers for the duration of a ``with`` block.

    The first signal sets :attr:`stop`; a second one sets :attr:`force` (for a service that
    stops gracefully and lets an impatient operator cut it short).

    Args:
        stop: The event the first signal sets (a caller may set it too); a new one if None.
    """

    def __init__(self, stop: asyncio.Event | None = None) -> None:
        self.stop = stop if stop is not None else asyncio.Event()
        self.force = asyncio.Event()
        self._installed: list[signal.Signals] = []

    def _on_signal(self, signum: signal.Signals) -> None:
        if self.stop.is_set():
            logger.warning("%s again: stopping now", signum.name)
            self.force.set()
        else:
            logger.info("%s: shutting down", signum.name)
            self.stop.set()

    def __enter__(self) -> StopSignals:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            # Not the main thread (an embedding test harness): the caller's stop event rules.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signum, self._on_signal, signum)
                self._installed.append(signum)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        for signum in self._installed:
            loop.remove_signal_handler(signum)
        self._installed.clear()
