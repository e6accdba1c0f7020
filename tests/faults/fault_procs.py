"""Fault switches of the harness: a PostgreSQL forwarder, replicas, supervisors, slow clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
from haru_db import upgrade
from haru_demo import DemoTopology
from haru_demo._procs import ChildProcess, spawn
from haru_demo._topology import _base_env
from sqlalchemy.engine import make_url

SERVER_LISTENING = re.compile(r"haru-server listening on [^\s:]+:(\d+)")
SUPERVISOR_LISTENING = re.compile(r"haru-supervisor listening on http://[^\s:]+:(\d+)")


class PgForwarder:
    """127.0.0.1 forwarder in front of PostgreSQL: ``cut`` drops and refuses, ``stall`` holds."""

    def __init__(self, host: str, port: int, note: Callable[[str], None] | None = None) -> None:
        self.target = (host, port)
        self._note = note or (lambda _text: None)
        self.refused = 0
        """Connections refused while cut."""
        self.port = 0
        self.cut_off = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        self.cut_off = True
        for writer in list(self._writers):
            writer.transport.abort()

    def stall(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        self.cut_off = False
        self._flowing.set()

    async def close(self) -> None:
        self.cut()
        self._flowing.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            # Not a fault the schedule asked for: in the history, so a verdict can be read.
            self._note(f"PostgreSQL refused the forwarder's connection ({exc!r}); dropped")
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        self._writers.discard(writer)
        writer.transport.abort()


def create_database(admin_url: str, name: str, *, template: str | None = None) -> str:
    """Create database ``name`` on the server of ``admin_url`` (a copy of ``template`` when
    given); returns its SQLAlchemy URL."""
    url = make_url(admin_url)
    libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
    copy = f' TEMPLATE "{template}"' if template is not None else ""
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    return url.set(database=name).render_as_string(hide_password=False)


class MigratedTemplate:
    """One migrated PostgreSQL database per harness process, copied for every schedule
    (``CREATE DATABASE ... TEMPLATE``: a file copy instead of a migration per schedule)."""

    def __init__(self) -> None:
        self.name = f"haru_faults_template_{os.getpid()}"
        self._lock = asyncio.Lock()
        self._admin_url: str | None = None

    async def copy(self, admin_url: str, name: str) -> str:
        async with self._lock:  # PostgreSQL refuses two copies of one template at once
            if self._admin_url is None:
                url = await asyncio.to_thread(create_database, admin_url, self.name)
                await upgrade(url)
                self._admin_url = admin_url
            return await asyncio.to_thread(create_database, admin_url, name, template=self.name)

    def drop(self) -> None:
        if self._admin_url is not None:
            with contextlib.suppress(Exception):
                drop_database(self._admin_url, self.name)
            self._admin_url = None


TEMPLATE = MigratedTemplate()


def drop_database(admin_url: str, name: str) -> None:
    url = make_url(admin_url)
    libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def clock_offset_file(workdir: Path, index: int) -> Path:
    """Where replica ``index`` reads its clock offset (``HARU_CLOCK_OFFSET_FILE``)."""
    return workdir / f"clock-offset-{index}"


def set_clock_offset(path: Path, offset_ms: float) -> None:
    """Make the server process reading ``path`` jump to the real time plus ``offset_ms``."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{offset_ms:.0f}\n", encoding="utf-8")
    os.replace(tmp, path)


class FaultTopology(DemoTopology):
    """The demo fleet, its server (replica 0) reading its clock offset from a file."""

    def server_env(self) -> dict[str, str]:
        env = super().server_env()
        env["HARU_CLOCK_OFFSET_FILE"] = str(clock_offset_file(self.workdir, 0))
        return env


class SqliteWriteLock:
    """Another process's long write transaction on the SQLite store (a backup or maintenance
    tool, an operator's ``sqlite3`` shell): ``BEGIN IMMEDIATE`` held. Under WAL (Haru's
    journal mode) readers keep reading; every writer waits its busy timeout, then fails."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    async def acquire(self) -> None:
        def begin() -> sqlite3.Connection:
            conn = sqlite3.connect(
                self.path, timeout=10.0, isolation_level=None, check_same_thread=False
            )
            conn.execute("BEGIN IMMEDIATE")
            return conn

        self._conn = await asyncio.to_thread(begin)

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.to_thread(_rollback_and_close, conn)


def _rollback_and_close(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")
    conn.close()


class Replica:
    """One ``haru serve`` process of the replicated control plane, restartable on its port."""

    def __init__(self, topology: DemoTopology, index: int, database_url: str | None) -> None:
        self.topology = topology
        self.index = index
        self.database_url = database_url
        self.port = 0
        self.process: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.running

    async def start(self) -> None:
        env = self.topology.server_env()
        env["PORT"] = str(self.port)
        env["HARU_CLOCK_OFFSET_FILE"] = str(clock_offset_file(self.topology.workdir, self.index))
        if self.database_url is not None:
            env["DATABASE_URL"] = self.database_url
        self.process = await spawn(
            f"server-{self.index}",
            [sys.executable, "-m", "haru_server", "serve"],
            env=env,
            cwd=self.topology.workdir,
            log_path=self.topology.workdir / "logs" / f"server-{self.index}.log",
        )
        match = await self.process.wait_for_line(SERVER_LISTENING, timeout_s=60)
        self.port = int(match.group(1))

    async def kill(self) -> None:
        if self.process is not None:
            await self.process.kill()


def supervisor_env(
    topology: DemoTopology, slug: str, *, port: int, token: str | None
) -> dict[str, str]:
    """The environment ``DemoTopology`` gives domain ``slug``'s supervisor, on a fixed port."""
    folder = topology.workdir / slug
    env = _base_env()
    env.update(
        PORT=str(port),
        HARU_SUPERVISOR_CONFIG=str(folder / "supervisor.json"),
        HARU_SUPERVISOR_GPU_SOURCE="nvidia-smi",
        HARU_SUPERVISOR_SHUTDOWN_GRACE_MS=str(topology.timings.supervisor_shutdown_grace_ms),
        PATH=os.pathsep.join([str(folder / "bin"), env.get("PATH", os.defpath)]),
    )
    if token is not None:
        env["HARU_SUPERVISOR_TOKEN"] = token
    return env


async def restart_supervisor(
    topology: DemoTopology, slug: str, *, token: str | None, kill: bool = False
) -> None:
    """Stop domain ``slug``'s supervisor (SIGTERM, or SIGKILL with ``kill``) and start it again
    on the same port, with ``token``."""
    domain = topology.domains[slug]
    port = int(domain.supervisor_url.rsplit(":", 1)[1])
    if domain.supervisor is not None:
        if kill:
            await domain.supervisor.kill()
        else:
            await domain.supervisor.stop(grace_s=topology.timings.stop_grace_s + 2)
    folder = topology.workdir / slug
    process = await spawn(
        f"supervisor-{slug}",
        [sys.executable, "-m", "haru_supervisor"],
        env=supervisor_env(topology, slug, port=port, token=token),
        cwd=folder,
        log_path=topology.workdir / "logs" / f"supervisor-{slug}.log",
    )
    domain.supervisor = process
    await process.wait_for_line(SUPERVISOR_LISTENING, timeout_s=60)


async def hold_slow_clients(port: int, count: int, hold_s: float) -> int:
    """Open ``count`` connections sending half a request each, hold them, close them.

    Returns how many connections were accepted.
    """
    socks: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 1.0)
                await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            except (OSError, TimeoutError):
                sock.close()
                continue
            socks.append(sock)
        await asyncio.sleep(hold_s)
        return len(socks)
    finally:
        for sock in socks:
            sock.close()


def checkpoint_dirs_of(topology: DemoTopology, slug: str) -> set[str]:
    return {os.path.realpath(p) for p in topology.domains[slug].checkpoint_dirs.values()}


def trainers_in(trainers: dict[int, str], directories: set[str]) -> list[int]:
    """Pids of ``trainers`` (pid -> checkpoint directory) whose directory is one of these."""
    return sorted(pid for pid, d in trainers.items() if os.path.realpath(d) in directories)
