"""A full state-store outage under traffic: chat keeps being served from the routing cache.

SQLite lane: the server runs on the embedded default and this test, another process, holds
every WAL-index lock of the database, so each of the server's statements fails while its
pooled connections stay open. PostgreSQL lane: the server reaches a throwaway database through
a TCP forwarder that the test cuts (open connections dropped, new ones closed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from haru_demo import ChatTraffic, DemoTimings, DemoTopology, active_slug
from haru_server.control_client import ControlApiError
from sqlalchemy.engine import make_url

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = pytest.mark.slow

OUTAGE_REQUESTS = 40
OUTAGE_S = 3.0


# ---- the outage switches ---------------------------------------------------------------------

# SQLite's WAL-index locks live on bytes 120..127 of the "-shm" file (write, checkpoint,
# recover, and the five read marks: https://www.sqlite.org/walformat.html, 2.3.1). Holding all
# of them exclusively from another process makes every transaction of the server fail (after
# its retries) while its own pooled connections stay open, which renaming or chmod-ing the
# database file cannot do: an open connection keeps reading the renamed inode.
_WAL_LOCKS_OFFSET = 120
_WAL_LOCKS_COUNT = 8


class SqliteLockout:
    """Makes a SQLite database in WAL mode unavailable to other processes until released."""

    def __init__(self, database: Path) -> None:
        self.shm = database.with_name(database.name + "-shm")
        self._fd: int | None = None

    def cut(self) -> None:
        """Take every WAL-index lock (fails if another process holds one right now)."""
        fd = os.open(self.shm, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _WAL_LOCKS_COUNT, _WAL_LOCKS_OFFSET)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def restore(self) -> None:
        """Release the locks."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    async def cut_when_idle(self, *, timeout_s: float = 10.0) -> None:
        """:meth:`cut`, retrying while the server holds one of the locks for a moment."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                self.cut()
            except OSError:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.005)
            else:
                return


class TcpForwarder:
    """A TCP forwarder on 127.0.0.1 that can drop every connection and refuse new ones."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Start listening; returns the port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def cut(self) -> None:
        """Drop every open connection; new ones are closed as soon as they are accepted."""
        self.cut_off = True
        for writer in list(self._writers):
            writer.transport.abort()

    def restore(self) -> None:
        """Forward new connections again."""
        self.cut_off = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


@dataclass
class StoreOutage:
    """A running topology and the switch that cuts its state store from the server."""

    lane: str
    topology: DemoTopology
    cut: Callable[[], Awaitable[None]]
    restore: Callable[[], None]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store_outage(
    request: pytest.FixtureRequest,
    launch_context: Callable[[], contextlib.AbstractAsyncContextManager[Launch]],
    e2e_timings: Callable[..., DemoTimings],
) -> AsyncIterator[StoreOutage]:
    """A topology on each engine, with a switch that takes its database away.

    The PostgreSQL database is requested before the topology starts, so the topology (and its
    server's connections) is gone before the database is handed back.
    """
    # No heartbeat can be stored during the outage, so the active's lastSeenAt ages by the
    # outage's length; a single missed poll right after it would then count as stale and fail
    # over. This test is about stale serving, so the staleness window outlasts the outage.
    base = e2e_timings()
    timings = e2e_timings(policy=base.policy.model_copy(update={"heartbeat_stale_ms": 30_000}))
    if request.param == "sqlite":
        async with launch_context() as launch:
            topology = await launch(timings=timings)
            assert topology.database_path is not None
            lockout = SqliteLockout(topology.database_path)
            try:
                yield StoreOutage("sqlite", topology, lockout.cut_when_idle, lockout.restore)
            finally:
                lockout.restore()
        return
    factory = request.getfixturevalue("postgres_url_factory")
    url = make_url(await factory())
    forwarder = TcpForwarder(url.host or "127.0.0.1", url.port or 5432)
    port = await forwarder.start()
    try:
        async with launch_context() as launch:
            topology = await launch(
                timings=timings,
                database_url=url.set(host="127.0.0.1", port=port).render_as_string(
                    hide_password=False
                ),
            )

            async def cut() -> None:
                forwarder.cut()

            yield StoreOutage("postgres", topology, cut, forwarder.restore)
    finally:
        await forwarder.close()


# ---- the test ----------------------------------------------------------------------------------


async def test_database_outage_serves_stale_without_failing_then_recovers(
    store_outage: StoreOutage, eventually: Eventually
) -> None:
    topology = store_outage.topology
    assert active_slug(await topology.fleet()) == "alpha"
    models = topology.domains["alpha"].models
    async with ChatTraffic(
        topology.server_url, fleet=topology.fleet_slug, models=models, clients=3, pause_s=0.02
    ) as traffic:
        await eventually(lambda: sum(r.ok for r in traffic.records) >= 10, what="traffic")
        await store_outage.cut()
        cut_at = time.time()
        # The outage is real for the server: its control API cannot read the fleet.
        with pytest.raises(ControlApiError) as refused:
            async with topology.control(timeout_s=2.0) as client:
                await client.fleet(topology.fleet_slug)
        assert refused.value.status in (None, 503)
        # Long enough for the snapshot cache's TTL and the outage memo to lapse several times.
        await eventually(
            lambda: (
                sum(r.started_at > cut_at for r in traffic.records) >= OUTAGE_REQUESTS
                and time.time() - cut_at >= OUTAGE_S
            ),
            what="traffic during the outage",
        )
        store_outage.restore()
        restored_at = time.time()
        await eventually(
            lambda: any(r.started_at > restored_at and not r.stale for r in traffic.records),
            what="fresh routing after the outage",
        )

    during = [r for r in traffic.records if cut_at < r.started_at < restored_at]
    assert len(during) >= OUTAGE_REQUESTS
    failures = [r for r in traffic.records if not r.ok]
    assert not failures, failures
    # Every answer during the outage came from the routing cache; once the route lease
    # (HARU_ROUTE_LEASE_MS, 300 ms) plus the pointer read's bound (250 ms) has run out without
    # a confirming read, the answers say so (X-Haru-Routing: stale).
    assert all(r.stale for r in during if r.started_at > cut_at + 1.0)
    assert not any(r.stale for r in traffic.records if r.ended_at < cut_at)
    # The control plane works again: heartbeats land in the store after the outage.
    fleet = await topology.wait_for_fleet(
        lambda f: all(
            d.last_seen_at is not None and d.last_seen_at.timestamp() > restored_at
            for d in f.domains
        ),
        what="heartbeats after the outage",
        timeout_s=30,
    )
    assert active_slug(fleet) == "alpha"
