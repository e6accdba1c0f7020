"""Fault switches of the harness: a PostgreSQL forwarder, replicas, supervisors, slow clients,
hostile clients and a redirecting upstream."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
from haru_db import upgrade
from haru_demo import DemoTopology, TopologyOptions
from haru_demo._options import DemoDomain
from haru_demo._procs import ChildProcess, spawn
from haru_demo._topology_files import _base_env
from haru_protocol import DomainLayout, InferenceSlotSpec
from sqlalchemy.engine import make_url

SERVER_LISTENING = re.compile(r"haru-server listening on [^\s:]+:(\d+)")
SUPERVISOR_LISTENING = re.compile(r"haru-supervisor listening on http://[^\s:]+:(\d+)")
WORKER_PIDS = re.compile(r"haru-server: \d+ workers on \S+ \(pids ([\d, ]+)\)")
HOSTILE_PEER = "127.0.0.2"
"""Source address of the hostile clients: another peer than the good ones (127.0.0.1), as an
attacker on another host would be (Linux routes all of 127.0.0.0/8 to the loopback)."""


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
    """The demo fleet, its server (replica 0) reading its clock offset from a file.

    ``workers``: replica index -> ``HARU_WORKERS`` for the replicas that run several worker
    processes. ``trap``: when given, every model's ``servingUrl`` in the layout is a
    :class:`RedirectTrap` in front of its emulated vLLM server (schedules with hostile clients).
    """

    def __init__(
        self,
        options: TopologyOptions,
        *,
        workers: dict[int, int] | None = None,
        trap: RedirectTrap | None = None,
    ) -> None:
        super().__init__(options)
        self.workers = dict(workers or {})
        self.trap = trap
        self._trapped: dict[int, str] = {}

    def server_env(self) -> dict[str, str]:
        env = super().server_env()
        env["HARU_CLOCK_OFFSET_FILE"] = str(clock_offset_file(self.workdir, 0))
        if self.workers.get(0, 1) > 1:
            env["HARU_WORKERS"] = str(self.workers[0])
        return env

    async def _start_vllm(self, domain: DemoDomain, *, asleep: bool) -> None:
        await super()._start_vllm(domain, asleep=asleep)
        if self.trap is not None:
            for server in domain.vllm.values():
                self._trapped[server.port] = await self.trap.front(server.port)

    def _domain_layout(self, domain: DemoDomain) -> DomainLayout:
        shape = super()._domain_layout(domain)
        if not self._trapped:
            return shape
        slots = tuple(
            slot.model_copy(
                update={
                    "models": tuple(
                        m.model_copy(
                            update={
                                "serving_url": self._trapped.get(
                                    domain.vllm[m.name].port, m.serving_url
                                )
                            }
                        )
                        for m in slot.models
                    )
                }
            )
            if isinstance(slot, InferenceSlotSpec)
            else slot
            for slot in shape.slots
        )
        return shape.model_copy(update={"slots": slots})


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

    def __init__(self, topology: FaultTopology, index: int, database_url: str | None) -> None:
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
        workers = self.topology.workers.get(self.index, 1)
        env.pop("HARU_WORKERS", None)
        if workers > 1:
            env["HARU_WORKERS"] = str(workers)
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

    async def worker_pids(self) -> list[int]:
        """The pids of its worker processes (``HARU_WORKERS`` > 1; its log says), or []."""
        if self.process is None or self.topology.workers.get(self.index, 1) < 2:
            return []
        match = await self.process.wait_for_line(WORKER_PIDS, timeout_s=10)
        return [int(p) for p in match.group(1).split(",")]

    def signal_all(self, signum: signal.Signals, workers: list[int]) -> None:
        """``signum`` to the replica's process group and to each worker (each worker runs in
        a process group of its own)."""
        if self.process is None:
            return
        self.process.signal_group(signum)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    async def kill(self) -> None:
        if self.process is not None:
            workers: list[int] = []
            with contextlib.suppress(Exception):
                workers = await self.worker_pids()
            await self.process.kill()
            # Workers leave the parent's process group; left alone, an orphan serves on the
            # shared port for up to a second beside a restarted replica.
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


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


# ---- hostile clients --------------------------------------------------------------------------

REDIRECT_MARKER = re.compile(rb'haru-fault-redirect-(\d+)"')
"""A hostile client's chat body carries ``"user": "haru-fault-redirect-N"``: the trap answers it
with a redirect to location N instead of forwarding it (the proxy passes the body verbatim)."""


class RedirectTrap:
    """An upstream that answers redirects: a TCP forwarder in front of each emulated vLLM server.

    Every byte passes through untouched, except a request whose body carries
    :data:`REDIRECT_MARKER` (only hostile clients send it): that one is answered
    ``307 Temporary Redirect`` to ``locations[N]`` (a :class:`Recorder`, a sleeping server's
    chat route) and the connection is closed, as a compromised or misconfigured serving
    endpoint would. A proxy that follows it re-sends the client's request there.
    """

    def __init__(self) -> None:
        self.locations: dict[int, str] = {}
        self.redirects = 0
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def front(self, upstream_port: int) -> str:
        """Start a trap in front of ``127.0.0.1:upstream_port``; returns its base URL."""

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._accept(upstream_port, reader, writer)

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        self._servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(
        self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.transport.abort()  # the server is down: the proxy sees the connection fail
            return
        for coro in (self._upstream(reader, up_writer, writer), _pipe(up_reader, writer)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _upstream(
        self,
        reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        writer: asyncio.StreamWriter,
    ) -> None:
        tail = b""
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            while data := await reader.read(65536):
                window = tail + data
                match = REDIRECT_MARKER.search(window)
                if match is not None and int(match.group(1)) in self.locations:
                    self.redirects += 1
                    location = self.locations[int(match.group(1))]
                    up_writer.transport.abort()
                    writer.write(
                        b"HTTP/1.1 307 Temporary Redirect\r\nLocation: "
                        + location.encode()
                        + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    await writer.drain()
                    writer.close()
                    return
                tail = window[-64:]
                up_writer.write(data)
                await up_writer.drain()
        up_writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


class Recorder:
    """Where the trap's redirects point: every connection is recorded (first line), answered
    200 and closed. Nothing a hostile client sent may ever arrive here."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = b""
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            line = await asyncio.wait_for(reader.readline(), 2.0)
        self.hits.append(line.decode("latin-1").strip()[:120] or "(connection, nothing sent)")
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        writer.close()


async def hold_heads(port: int, count: int, hold_s: float) -> int:
    """Open ``count`` connections from :data:`HOSTILE_PEER`, each sending half a request head,
    hold them ``hold_s``, close them. Returns how many connected."""
    loop = asyncio.get_running_loop()

    async def one() -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((HOSTILE_PEER, 0))
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 2.0)
            await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        except (OSError, TimeoutError):
            sock.close()
            return None
        return sock

    socks: list[socket.socket] = []
    try:
        for start in range(0, count, 100):  # in batches: a full backlog makes connects wait
            batch = await asyncio.gather(*(one() for _ in range(min(100, count - start))))
            socks += [s for s in batch if s is not None]
        await asyncio.sleep(hold_s)
        return len(socks)
    finally:
        for sock in socks:
            sock.close()


async def raw_request(port: int, request: bytes, *, timeout_s: float = 3.0) -> int | None:
    """Send ``request`` (raw bytes: what no well-behaved client library sends) from
    :data:`HOSTILE_PEER`; returns the answer's status code, or None without one."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(HOSTILE_PEER, 0)
            )
            try:
                writer.write(request)
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.transport.abort()
    except (OSError, TimeoutError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def hostile_requests(port: int, forged: str, redirect_ids: list[int]) -> list[tuple[str, bytes]]:
    """The complete hostile requests to ``127.0.0.1:port``: a bearer token that is not UTF-8, a
    path with encoded CR/LF that would forge a log line starting with ``forged``, and chats the
    trap redirects. Their ``Host`` is the loopback one, or the browser guard answers 403 before
    anything else is read."""
    host = f"Host: 127.0.0.1:{port}\r\n".encode()
    bad_token = b"Authorization: Bearer \xff\xfe\xfd\r\n"
    requests = [
        (
            "non-utf8-bearer GET /v1/status",
            b"GET /v1/status HTTP/1.1\r\n" + host + bad_token + b"\r\n",
        ),
        (
            "non-utf8-bearer GET /v1/fleets",
            b"GET /v1/fleets HTTP/1.1\r\n" + host + bad_token + b"\r\n",
        ),
        (
            "crlf path",
            f"GET /v1/fleets/x%0d%0a{forged}%20level=ERROR%20msg=forged%0d%0a HTTP/1.1\r\n".encode()
            + host
            + b"\r\n",
        ),
    ]
    for n in redirect_ids:
        body = (
            '{"model": "fault-chat", "messages": [{"role": "user", "content": "hi"}], '
            f'"max_tokens": 4, "user": "haru-fault-redirect-{n}"}}'
        ).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        requests.append((f"redirect {n}", head + body))
    return requests


def forged_lines(logs: Path, forged: str) -> list[str]:
    """Lines of the fleet's logs that begin with ``forged`` (a client-made log line)."""
    found: list[str] = []
    for path in sorted(logs.glob("*.log")):
        with contextlib.suppress(OSError):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.lstrip().startswith(forged):
                    found.append(f"{path.name}: {line[:160]}")
    return found
