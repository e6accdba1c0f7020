"""Real ``haru serve`` processes: boot behaviour, signals, and two servers sharing PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import aiohttp
import pytest
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import EventType, OperationState, PolicyPatch
from haru_server._clock import ManualClock

MakeFleet = Callable[..., Awaitable[LocalFleet]]
UrlFactory = Callable[[], Awaitable[str]]

TOKEN = "process-test-token"
_LISTENING = re.compile(r"haru-server listening on \S+ \((http://\S+)\)")


@dataclass
class ServerProcess:
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    url: str = ""

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


async def _drain(server: ServerProcess, listening: asyncio.Future[str]) -> None:
    assert server.process.stderr is not None
    async for raw in server.process.stderr:
        line = raw.decode(errors="replace").rstrip()
        server.lines.append(line)
        match = _LISTENING.search(line)
        if match and not listening.done():
            listening.set_result(match.group(1))
    if not listening.done():
        listening.set_exception(RuntimeError("server exited before listening"))


def server_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HARU_") and k not in ("DATABASE_URL", "PORT")
    }
    env.update(extra)
    return env


@asynccontextmanager
async def haru_serve(
    env: Mapping[str, str], *, expect_listening: bool = True, cwd: Path | None = None
) -> AsyncIterator[ServerProcess]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_server",
        "serve",
        env=server_env(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
    )
    server = ServerProcess(process)
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    reader = asyncio.create_task(_drain(server, listening))
    try:
        if expect_listening:
            async with asyncio.timeout(30):
                server.url = await listening
        yield server
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(15):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        await reader
        if not listening.done():
            listening.cancel()


async def test_boot_rejects_bad_numbers_clearly() -> None:
    async with haru_serve({"PORT": "eighty"}, expect_listening=False) as server:
        async with asyncio.timeout(30):
            code = await server.process.wait()
    assert code == 2
    assert "invalid environment" in server.log
    assert "PORT" in server.log
    assert "Traceback" not in server.log


async def test_boot_refuses_a_schema_newer_than_the_code(tmp_path: Path) -> None:
    database = tmp_path / "newer.db"
    url = f"sqlite:///{database}"
    from haru_db import upgrade
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    await upgrade(url)
    engine = create_async_engine(f"sqlite+aiosqlite:///{database}")
    try:
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = 'ffffffffffff'"))
    finally:
        await engine.dispose()
    async with haru_serve({"DATABASE_URL": url, "PORT": "0"}, expect_listening=False) as server:
        async with asyncio.timeout(30):
            code = await server.process.wait()
    assert code == 1
    assert "newer" in server.log
    assert "Traceback" not in server.log


async def test_embedded_default_is_announced_and_sigterm_stops_cleanly(tmp_path: Path) -> None:
    async with haru_serve({"PORT": "0"}, cwd=tmp_path) as server:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/healthz") as response:
                assert response.status == 200
            async with http.get(f"{server.url}/v1/fleets") as response:
                # No token: open, on 127.0.0.1 only.
                assert response.status == 200
        server.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            code = await server.process.wait()
    assert code == 0
    assert "embedded SQLite default" in server.log
    assert "DATABASE_URL unset" in server.log
    assert "HARU_API_TOKEN is unset" in server.log
    assert "127.0.0.1" in server.url
    assert (tmp_path / "haru.db").exists()


async def test_the_reconcile_loop_runs_by_default_and_off_turns_it_off(
    tmp_path: Path, make_fleet: MakeFleet
) -> None:
    """No loop setting at all: heartbeats confirm the domains and a promote runs to the end."""
    from datetime import UTC, datetime

    from haru_db import upgrade

    url = f"sqlite:///{tmp_path / 'default.db'}"
    await upgrade(url)
    fleet = await make_fleet()
    store = StateStore.open(url)
    try:
        layout = fleet.layout().model_copy(update={"policy": PolicyPatch(auto_failover=True)})
        await store.apply_fleet_layout(layout, at=datetime.now(UTC))
        seeded = await store.get_fleet_snapshot("local")
    finally:
        await store.close()
    assert seeded is not None
    beta = next(d.id for d in seeded.domains if d.slug == "beta")
    async with (
        haru_serve({"DATABASE_URL": url, "PORT": "0"}) as server,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{server.url}/readyz") as response:
            assert (await response.json())["checks"][-1] == "reconcile loop"
        async with asyncio.timeout(30):
            while True:  # only the loop's heartbeats confirm the new domains
                async with http.get(f"{server.url}/v1/fleets/local") as response:
                    body = await response.json()
                if all(d["state"] == "ready" for d in body["domains"]):
                    break
                await asyncio.sleep(0.05)
        assert body["reconciled"] is True
        assert body["warnings"] == []
        async with http.post(
            f"{server.url}/v1/fleets/local/promote", json={"targetDomainId": str(beta)}
        ) as response:
            assert response.status == 202
            operation_id = (await response.json())["operation"]["id"]
        async with asyncio.timeout(60):
            while True:
                async with http.get(
                    f"{server.url}/v1/fleets/local/operations/{operation_id}"
                ) as response:
                    operation = await response.json()
                if operation["state"] not in ("pending", "running"):
                    break
                await asyncio.sleep(0.05)
        assert operation["state"] == OperationState.SUCCEEDED.value, operation
    assert "reconcile loop every 500 ms" in server.log
    assert "autoFailover is ON" not in server.log
    off = {"DATABASE_URL": url, "PORT": "0", "HARU_RECONCILE_INTERVAL_MS": "off"}
    async with haru_serve(off) as server, aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/readyz") as response:
            assert (await response.json())["checks"] == ["state store", "schema at head"]
        async with http.get(f"{server.url}/v1/fleets/local") as response:
            body = await response.json()
        assert body["reconciled"] is None
        assert "HARU_RECONCILE_INTERVAL_MS is off" in body["warnings"][0]
    assert "HARU_RECONCILE_INTERVAL_MS is off" in server.log


@pytest.mark.postgres
async def test_two_server_processes_drive_one_promotion(
    postgres_url_factory: UrlFactory, make_fleet: MakeFleet, clock: ManualClock, helpers: Any
) -> None:
    url = await postgres_url_factory()
    store = StateStore.open(url)
    try:
        fleet = await make_fleet()
        # The servers use the real clock: seed with it too.
        from datetime import UTC, datetime

        await store.apply_fleet_layout(fleet.layout(), at=datetime.now(UTC))
        seeded = await store.get_fleet_snapshot("local")
        assert seeded is not None
        beta = next(d.id for d in seeded.domains if d.slug == "beta")
        env = {
            "DATABASE_URL": url,
            "PORT": "0",
            "HARU_API_TOKEN": TOKEN,
            "HARU_RECONCILE_INTERVAL_MS": "200",
        }
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with contextlib.AsyncExitStack() as stack:
            # Both boot at once (their migration check races on the same database too).
            first, second = await asyncio.gather(
                stack.enter_async_context(haru_serve(env)),
                stack.enter_async_context(haru_serve(env)),
            )
            http = await stack.enter_async_context(aiohttp.ClientSession(headers=headers))

            async def promote(server: ServerProcess) -> tuple[int, dict[str, Any]]:
                async with http.post(
                    f"{server.url}/v1/fleets/local/promote",
                    json={"targetDomainId": str(beta)},
                ) as response:
                    return response.status, await response.json()

            # New domains are promotable only once a heartbeat confirmed them.
            async def confirmed() -> bool:
                async with http.get(f"{first.url}/v1/fleets/local") as response:
                    body = await response.json()
                return all(d["state"] == "ready" for d in body["domains"])

            for _ in range(200):
                if await confirmed():
                    break
                await asyncio.sleep(0.05)
            answers = await asyncio.gather(promote(first), promote(second))
            assert [status for status, _ in answers] == [202, 202]
            ids = {body["operation"]["id"] for _, body in answers}
            assert len(ids) == 1
            operation_id = UUID(ids.pop())

            async with asyncio.timeout(60):
                while True:
                    async with http.get(
                        f"{second.url}/v1/fleets/local/operations/{operation_id}"
                    ) as response:
                        operation = await response.json()
                    if operation["state"] not in ("pending", "running"):
                        break
                    await asyncio.sleep(0.05)
            assert operation["state"] == OperationState.SUCCEEDED.value, operation
            async with http.get(f"{first.url}/v1/fleets/local") as response:
                snapshot = await response.json()
            assert snapshot["activeDomainId"] == str(beta)
            assert snapshot["routeRevision"] == seeded.route_revision + 1
        events = await store.list_events(seeded.id, limit=1000)
        types = Counter(e.type for e in events)
        assert types[EventType.ROUTING_SWITCHED] == 1
        assert types[EventType.OPERATION_REQUESTED_PROMOTE] == 1
        assert types[EventType.OPERATION_SUCCEEDED] == 1
        assert "Traceback" not in first.log + second.log
    finally:
        await store.close()


async def test_boot_refuses_a_read_only_sqlite_file(tmp_path: Path) -> None:
    """A server that could not write would boot and then fail every write: refuse at start."""
    import shutil

    from haru_db import upgrade

    directory = tmp_path / "state"
    directory.mkdir()
    database = directory / "haru.db"
    await upgrade(f"sqlite:///{database}")
    database.chmod(0o444)
    command = [sys.executable, "-m", "haru_server", "serve"]
    if os.geteuid() == 0:
        # Root ignores file modes; drop that override so the permissions bind the server.
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file permissions cannot bind")
        command = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--", *command]
    process = await asyncio.create_subprocess_exec(
        *command,
        env=server_env({"DATABASE_URL": f"sqlite:///{database}", "PORT": "0"}),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        _, stderr = await process.communicate()
    log = stderr.decode(errors="replace")
    assert process.returncode not in (0, None), log
    assert "listening on" not in log
    assert "read-only" in log.lower() or "not writable" in log.lower(), log
    assert "Traceback" not in log
