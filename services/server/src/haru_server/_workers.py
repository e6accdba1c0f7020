"""``HARU_WORKERS=N``: N server processes sharing one port (SO_REUSEPORT).

The parent migrates the state store once, reserves the port (a bound, never listening socket
with SO_REUSEPORT, so ``PORT=0`` resolves to one port for every worker), then starts N worker
processes (``multiprocessing`` spawn) that each run the whole server on that port: the
kernel spreads incoming connections over their listening sockets. Each worker has its own
inference proxy, route lease, route listener and reconcile loop (every worker reconciles,
relying on compare-and-swap; see the README). The parent only supervises: SIGTERM or SIGINT
stops every worker (SIGTERM, then SIGKILL after the shutdown grace), and a worker that exits
on its own stops the others and the parent exits 1, for the service manager to restart the
whole set. A worker whose parent disappeared stops itself.

Metrics: the parent creates a fresh, empty folder per start and names it in
``PROMETHEUS_MULTIPROC_DIR`` for the workers (prometheus_client's multiprocess mode, chosen
when a worker imports it): each worker writes its metric values to its own files there and any
worker's ``/metrics`` merges every worker's. A worker that exits has its live gauges' files
removed; the parent removes the folder when the set stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Final

from haru_web import configure_logging
from prometheus_client.multiprocess import mark_process_dead

from haru_server._eventloop import run
from haru_server._metrics_workers import MULTIPROC_DIR_ENV
from haru_server._serve import SHUTDOWN_TIMEOUT_S, check_tls, migrate, run_server
from haru_server._settings import Settings

logger = logging.getLogger(__name__)

_STOP_GRACE_S: Final = SHUTDOWN_TIMEOUT_S + 5.0
_PARENT_POLL_S: Final = 1.0


def serve_workers(settings: Settings) -> int:
    """Run ``settings.workers`` server processes on one port until stopped; the exit code.

    Raises:
        haru_db.HaruDbError: The migration failed (before any worker started).
        OSError: The port could not be reserved.
        SettingsError: A TLS file does not load (before any worker started).
    """
    check_tls(settings)
    run(migrate(settings))
    with _reserve(settings.host, settings.port) as port, _metrics_dir() as metrics_dir:
        worker_settings = settings.model_copy(update={"port": port, "workers": 1})
        context = multiprocessing.get_context("spawn")
        workers = [
            context.Process(target=_worker, args=(worker_settings,), name=f"haru-worker-{i}")
            for i in range(settings.workers)
        ]
        stopping = threading.Event()
        previous = {
            signum: signal.signal(signum, lambda *_: stopping.set())
            for signum in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            for worker in workers:
                worker.start()  # spawn: the worker inherits the environment as it is now
            logger.info(
                "haru-server: %d workers on %s:%d (pids %s)",
                len(workers),
                settings.host,
                port,
                ", ".join(str(w.pid) for w in workers),
            )
            return _supervise(workers, stopping, metrics_dir)
        finally:
            _stop(workers, metrics_dir)
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@contextlib.contextmanager
def _metrics_dir() -> Iterator[str]:
    """A new empty folder named by ``PROMETHEUS_MULTIPROC_DIR`` while the block runs.

    Fresh per start: files left by a previous set would be merged into this one's counters.
    An inherited value is replaced for the workers and restored after.
    """
    inherited = os.environ.get(MULTIPROC_DIR_ENV)
    path = tempfile.mkdtemp(prefix="haru-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = path
    try:
        yield path
    finally:
        if inherited is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = inherited
        shutil.rmtree(path, ignore_errors=True)


def _exited(worker: BaseProcess, metrics_dir: str) -> None:
    if worker.pid is not None:
        # Its live gauges stop counting.
        mark_process_dead(worker.pid, metrics_dir)  # type: ignore[no-untyped-call]


def _supervise(workers: Sequence[BaseProcess], stopping: threading.Event, metrics_dir: str) -> int:
    sentinels = [w.sentinel for w in workers]
    while not stopping.is_set():
        ready = wait(sentinels, timeout=0.2)
        if ready:
            if stopping.is_set():
                break
            for worker in (w for w in workers if w.sentinel in ready):
                worker.join(1.0)  # the sentinel fires at exit, a moment before it is reaped
                _exited(worker, metrics_dir)
                logger.error(
                    "worker %s (pid %s) exited with code %s; stopping the others",
                    worker.name,
                    worker.pid,
                    worker.exitcode,
                )
            return 1
    logger.info("stopping %d workers", len(workers))
    return 0


def _stop(workers: Sequence[BaseProcess], metrics_dir: str) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.terminate()  # SIGTERM: the worker's own graceful stop
    for worker in workers:
        worker.join(_STOP_GRACE_S)
        if worker.is_alive():
            logger.warning("worker %s did not stop in time; killing it", worker.name)
            worker.kill()
            worker.join()
        _exited(worker, metrics_dir)


@contextlib.contextmanager
def _reserve(host: str, port: int) -> Iterator[int]:
    """Bind (never listen) a SO_REUSEPORT socket on ``host:port``; yields the bound port.

    It keeps a port picked by ``PORT=0`` for the workers, and refuses at once a port that
    another program holds without SO_REUSEPORT.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as reserved:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind(address)
        yield int(reserved.getsockname()[1])


def _worker(settings: Settings) -> None:
    """One worker process: the whole server on the shared port, until SIGTERM."""
    # Out of the terminal's process group: Ctrl-C reaches the parent only, which stops the
    # workers with SIGTERM (a worker exiting on its own would look like a crash).
    os.setpgrp()
    configure_logging(log_format=settings.log_format, level=settings.log_level, stream=sys.stderr)
    try:
        run(_serve_until_orphaned(settings))
    except Exception:
        logger.exception("worker failed")
        sys.exit(1)


async def _serve_until_orphaned(settings: Settings) -> None:
    parent = os.getppid()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    timer: list[asyncio.TimerHandle] = []

    def check_parent() -> None:
        if os.getppid() != parent:
            logger.warning("the parent process is gone; stopping")
            stop.set()
        else:
            timer[:] = [loop.call_later(_PARENT_POLL_S, check_parent)]

    check_parent()
    try:
        await run_server(
            settings,
            stop=stop,
            reuse_port=True,
            on_listening=lambda url: logger.info(
                "haru-server worker %d serves %s", os.getpid(), url
            ),
        )
    finally:
        for handle in timer:
            handle.cancel()
