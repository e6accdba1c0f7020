"""Real ``haru serve`` processes: boot behaviour, signals, and two servers sharing PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any
from uuid import UUID

import aiohttp
import pytest
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import EventType, OperationState, PolicyPatch
from haru_server._clock import ManualClock
from prometheus_client.parser import text_string_to_metric_families

MakeFleet = Callable[..., Awaitable[LocalFleet]]
UrlFactory = Callable[[], Awaitable[str]]

TOKEN = "process-test-token"

HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""


async def test_boot_rejects_bad_numbers_clearly(haru_serve: HaruServe) -> None:
    async with haru_serve({"PORT": "eighty"}, listening=False) as server:
        code = await server.exited()
    assert code == 2
    assert "invalid environment" in server.log
    assert "PORT" in server.log
    assert "Traceback" not in server.log


async def test_fatal_start_up_errors_are_one_json_line_in_json_mode(haru_serve: HaruServe) -> None:
    async with haru_serve({"PORT": "eighty", "HARU_LOG_FORMAT": "json"}, listening=False) as server:
        code = await server.exited()
    assert code == 2
    assert len(server.lines) == 1, server.log
    record = json.loads(server.lines[0])
    assert record["level"] == "CRITICAL"
    assert record["message"].startswith("invalid environment: ")
    assert "PORT" in record["message"]


async def test_a_port_in_use_is_one_json_line_in_json_mode(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"PORT": str(port), "HARU_HOST": "127.0.0.1", "HARU_LOG_FORMAT": "json"}
        async with haru_serve(env, listening=False, cwd=tmp_path) as server:
            code = await server.exited()
    assert code == 1
    records = [json.loads(line) for line in server.lines]  # every line is JSON
    fatal = [r for r in records if r["level"] == "CRITICAL"]
    assert len(fatal) == 1, server.log
    assert fatal[0]["message"].startswith("cannot start: ")
    assert str(port) in fatal[0]["message"]


async def test_alembic_logs_only_migrations_that_change_the_schema(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    env = {
        "PORT": "0",
        "HARU_LOG_FORMAT": "json",
        "DATABASE_URL": str(tmp_path / "haru.db"),
        "HARU_CREATE_DATABASE": "1",
    }

    def alembic_lines(server: Any) -> list[dict[str, Any]]:
        records = [json.loads(line) for line in server.lines]
        return [r for r in records if r["logger"].startswith("alembic")]

    async with haru_serve(env) as first:
        pass
    # The first boot migrates a new store: Alembic says so.
    assert any("Running upgrade" in r["message"] for r in alembic_lines(first)), first.log
    async with haru_serve(env) as server:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.get(f"{server.url}/readyz") as response:
                    assert response.status == 200
            # A line written after the probes': once it is read, theirs would have been too.
            async with http.get(f"{server.url}/no-such-route-marker") as response:
                assert response.status == 404
        async with asyncio.timeout(30):
            while "no-such-route-marker" not in server.log:
                await asyncio.sleep(0.05)
        # Neither the boot's no-op upgrade nor a readiness probe's schema check logs.
        assert alembic_lines(server) == [], server.log


async def test_boot_refuses_a_schema_newer_than_the_code(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
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
    async with haru_serve({"DATABASE_URL": url, "PORT": "0"}, listening=False) as server:
        code = await server.exited()
    assert code == 1
    assert "newer" in server.log
    assert "Traceback" not in server.log


async def test_embedded_default_is_announced_and_sigterm_stops_cleanly(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    async with haru_serve({"PORT": "0"}, cwd=tmp_path) as server:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/healthz") as response:
                assert response.status == 200
            async with http.get(f"{server.url}/v1/fleets") as response:
                # No token: open, on 127.0.0.1 only.
                assert response.status == 200
        server.process.send_signal(signal.SIGTERM)
        code = await server.exited(timeout_s=15)
    assert code == 0
    assert "embedded SQLite default" in server.log
    assert "DATABASE_URL unset" in server.log
    assert "HARU_API_TOKEN is unset" in server.log
    assert "127.0.0.1" in server.url
    assert (tmp_path / "haru.db").exists()


def store_files(directory: Path) -> list[str]:
    """Every file SQLite could have made there (the database, its WAL, journal, shm)."""
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize(
    ("form", "extra"),
    [
        ("path", {}),
        ("url", {}),
        ("url", {"HARU_WORKERS": "2"}),  # the parent migrates before any worker starts
    ],
)
async def test_a_missing_sqlite_file_named_by_database_url_is_refused_and_not_created(
    haru_serve: HaruServe, tmp_path: Path, form: str, extra: dict[str, str]
) -> None:
    """A typo in DATABASE_URL must not start a new, empty store beside the real one."""
    state = tmp_path / "state"
    state.mkdir()
    missing = state / "hrau.db"
    url = str(missing) if form == "path" else f"sqlite:///{missing}"
    env = {"DATABASE_URL": url, "PORT": "0", "HARU_LOG_FORMAT": "json", **extra}
    async with haru_serve(env, listening=False, cwd=state) as server:
        code = await server.exited()
    assert code == 2, server.log
    assert store_files(state) == []  # not even an empty file (nor ./haru.db in the cwd)
    fatal = [json.loads(line) for line in server.lines]
    assert [r["level"] for r in fatal] == ["CRITICAL"], server.log
    message = fatal[0]["message"]
    assert str(missing) in message
    assert "does not exist" in message
    assert "haru db upgrade" in message
    assert "HARU_CREATE_DATABASE=1" in message
    assert "--create-db" in message


@pytest.mark.parametrize(
    ("extra", "args"), [({"HARU_CREATE_DATABASE": "1"}, ()), ({}, ("--create-db",))]
)
async def test_the_create_database_opt_in_creates_the_missing_store(
    haru_serve: HaruServe, tmp_path: Path, extra: dict[str, str], args: tuple[str, ...]
) -> None:
    database = tmp_path / "new.db"
    env = {"DATABASE_URL": f"sqlite:///{database}", "PORT": "0", **extra}
    async with haru_serve(env, args=args) as server:
        assert await ready(server)
    assert database.is_file()
    # The store it created is a migrated one, and from now on a plain boot opens it.
    async with haru_serve({"DATABASE_URL": f"sqlite:///{database}", "PORT": "0"}) as server:
        assert await ready(server)


async def ready(server: Any) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{server.url}/readyz") as response:
        return response.status == 200


async def test_an_in_memory_database_url_is_refused_clearly(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    async with haru_serve(
        {"DATABASE_URL": ":memory:", "PORT": "0"}, listening=False, cwd=tmp_path
    ) as server:
        code = await server.exited()
    assert code == 2, server.log
    assert "in-memory" in server.log
    assert "Traceback" not in server.log
    assert store_files(tmp_path) == []


async def test_db_current_never_creates_the_missing_file_database_url_names(
    haru: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    missing = tmp_path / "missing.db"
    env = {"DATABASE_URL": f"sqlite:///{missing}", "NO_COLOR": "1"}
    done = await asyncio.to_thread(haru, "db", "current", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # behind head: never migrated
    assert json.loads(done.stdout)["revision"] is None
    assert store_files(tmp_path) == []


async def test_the_reconcile_loop_runs_by_default_and_off_turns_it_off(
    haru_serve: HaruServe, tmp_path: Path, make_fleet: MakeFleet
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
            assert (await response.json())["checks"] == ["state store", "schema at head", "clock"]
        async with http.get(f"{server.url}/v1/fleets/local") as response:
            body = await response.json()
        assert body["reconciled"] is None
        assert "HARU_RECONCILE_INTERVAL_MS is off" in body["warnings"][0]
    assert "HARU_RECONCILE_INTERVAL_MS is off" in server.log


@pytest.mark.postgres
async def test_two_server_processes_drive_one_promotion(
    haru_serve: HaruServe,
    postgres_url_factory: UrlFactory,
    make_fleet: MakeFleet,
    clock: ManualClock,
    helpers: Any,
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

            async def promote(server: Any) -> tuple[int, dict[str, Any]]:
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


async def test_repeated_demotes_of_a_standby_in_posture_hold_no_failover(
    haru_serve: HaruServe, sqlite_store: StateStore, make_fleet: MakeFleet
) -> None:
    """Twenty demotes of a standby already demoted create no operation; the failover follows.

    Each operation holds the fleet's one in-flight slot (failover detection waits for it), so
    the demote that left the standby in posture answers every repeat, and the failover after
    the active dies is the next operation.
    """
    from datetime import UTC, datetime

    store = sqlite_store
    fleet = await make_fleet()
    policy = PolicyPatch(auto_failover=True, heartbeat_stale_ms=2_000, degraded_grace_ms=60_000)
    # The server uses the real clock: seed with it too.
    await store.apply_fleet_layout(fleet.layout(policy=policy), at=datetime.now(UTC))
    seeded = await store.get_fleet_snapshot("local")
    assert seeded is not None
    beta = next(d.id for d in seeded.domains if d.slug == "beta")
    env = {
        "DATABASE_URL": store.url,
        "PORT": "0",
        "HARU_API_TOKEN": TOKEN,
        "HARU_RECONCILE_INTERVAL_MS": "200",
    }
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with haru_serve(env) as server, aiohttp.ClientSession(headers=headers) as http:

        async def get(path: str) -> dict[str, Any]:
            async with http.get(f"{server.url}/v1/fleets/local{path}") as response:
                assert response.status == 200
                body: dict[str, Any] = await response.json()
                return body

        async def demote() -> dict[str, Any]:
            async with http.post(
                f"{server.url}/v1/fleets/local/demote", json={"targetDomainId": str(beta)}
            ) as response:
                assert response.status == 202, await response.text()
                operation: dict[str, Any] = (await response.json())["operation"]
                return operation

        async with asyncio.timeout(60):  # failure detectors, not timing assertions
            while not all(d["state"] == "ready" for d in (await get(""))["domains"]):
                await asyncio.sleep(0.05)
            first = await demote()
            while (await get(f"/operations/{first['id']}"))["state"] != "succeeded":
                await asyncio.sleep(0.05)
            for _ in range(20):
                again = await demote()
                assert again["id"] == first["id"]
                assert again["state"] == "succeeded"
            await fleet.stop_supervisor("alpha")
            while not any(
                e.type == EventType.OPERATION_AUTO_FAILOVER
                for e in await store.list_events(seeded.id, limit=1000)
            ):
                await asyncio.sleep(0.05)
    operations = await store.list_recent_operations(seeded.id)
    assert [(op.kind.value, op.target_domain_id) for op in reversed(operations)] == [
        ("demote", beta),
        ("promote", beta),
    ]
    events = await store.list_events(seeded.id, limit=1000)
    requested = [e for e in events if e.type == EventType.OPERATION_REQUESTED_DEMOTE]
    assert len(requested) == 1
    assert "Traceback" not in server.log


async def test_boot_refuses_a_read_only_sqlite_file(haru_serve: HaruServe, tmp_path: Path) -> None:
    """A server that could not write would boot and then fail every write: refuse at start."""
    import shutil

    from haru_db import upgrade

    directory = tmp_path / "state"
    directory.mkdir()
    database = directory / "haru.db"
    await upgrade(f"sqlite:///{database}")
    database.chmod(0o444)
    wrapper: list[str] = []
    if os.geteuid() == 0:
        # Root ignores file modes; drop that override so the permissions bind the server.
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file permissions cannot bind")
        wrapper = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
    env = {"DATABASE_URL": f"sqlite:///{database}", "PORT": "0"}
    async with haru_serve(env, listening=False, wrapper=wrapper) as server:
        code = await server.exited()
    log = server.log
    assert code != 0, log
    assert "listening on" not in log
    assert "read-only" in log.lower() or "not writable" in log.lower(), log
    assert "Traceback" not in log


async def test_the_startup_heap_is_frozen_and_collector_pauses_are_measured(
    haru_serve: HaruServe,
    tmp_path: Path,
) -> None:
    async with haru_serve({"PORT": "0"}, cwd=tmp_path) as server, aiohttp.ClientSession() as http:
        # Enough requests that the young generation is collected a few times.
        for _ in range(200):
            async with http.get(f"{server.url}/v1/fleets") as response:
                assert response.status == 200
        async with http.get(f"{server.url}/metrics") as response:
            assert response.status == 200
            text = await response.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # Everything start-up made (modules, models, metadata, the app) sits in the permanent
    # generation, which collections never walk.
    assert samples[("haru_gc_frozen_objects", ())] > 10_000
    young = samples[("haru_gc_pause_seconds_count", (("generation", "0"),))]
    assert young > 0
    assert samples[("haru_gc_pause_seconds_sum", (("generation", "0"),))] > 0


async def test_sigterm_drains_with_readyz_failing_before_the_listener_closes(
    haru_serve: HaruServe,
    tmp_path: Path,
) -> None:
    env = {"PORT": "0", "HARU_SHUTDOWN_DRAIN_MS": "60000"}
    async with haru_serve(env, cwd=tmp_path) as server, aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/readyz") as response:
            assert response.status == 200
        server.process.send_signal(signal.SIGTERM)
        body: dict[str, Any] = {}
        async with asyncio.timeout(15):
            while not body:
                async with http.get(f"{server.url}/readyz") as response:
                    if response.status == 503:
                        body = await response.json()
                        continue
                await asyncio.sleep(0.05)
        assert body["error"]["code"] == "not_ready"
        assert "draining" in body["error"]["message"]
        # Still serving meanwhile: a new connection is accepted and answered.
        async with aiohttp.ClientSession() as fresh, fresh.get(f"{server.url}/healthz") as response:
            assert response.status == 200
        assert server.process.poll() is None
        # A second signal ends the drain at once (the 60 s window is not waited out).
        server.process.send_signal(signal.SIGTERM)
        code = await server.exited(timeout_s=15)
    assert code == 0
    assert "draining" in server.log


# ---- hostile clients at the HTTP edge ------------------------------------------------------

EDGE_TOKEN = "edge-process-token-0123456789"
FORGED = "2026-01-01 00:00:00,000 WARNING haru_server: forged"
FORGED_PATH = b"/nowhere%0d%0a" + FORGED.replace(" ", "%20").encode() + b"%1b[31m"
HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def raw_http(url: str, data: bytes, *, source: str = "127.0.0.1") -> bytes:
    """Send ``data`` from ``source`` on a fresh connection; everything up to the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url), local_addr=(source, 0))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


def get(path: bytes, *headers: bytes) -> bytes:
    lines = [b"GET " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def _closed_by_server(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(10):
            await reader.read()


async def flood_half_sent_heads(url: str, count: int, *, source: str) -> list[Any]:
    """``count`` connections from ``source``, each stopped half-way through its head."""
    flood = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", _port(url), local_addr=(source, 0)
        )
        writer.write(HALF_HEAD)
        flood.append((reader, writer))
    for _, writer in flood:
        await writer.drain()
    return flood


async def test_hostile_clients_get_401s_escaped_logs_and_cannot_lock_out_others(
    haru_serve: HaruServe,
    tmp_path: Path,
) -> None:
    env = {
        "PORT": "0",
        "HARU_API_TOKEN": EDGE_TOKEN,
        "HARU_HTTP_MAX_CONNECTIONS": "64",
        "HARU_HTTP_MAX_CONNECTIONS_PER_PEER": "8",
        "HARU_HTTP_HEADER_TIMEOUT_MS": "60000",
    }
    async with haru_serve(env, cwd=tmp_path) as server:
        # A token that is not UTF-8 is a wrong token like any other.
        for token in (b"\xff\xfe" + EDGE_TOKEN.encode(), b"\x80" * 20):
            answer = await raw_http(
                server.url, get(b"/v1/fleets", b"Authorization: Bearer " + token)
            )
            assert status_of(answer) == 401, answer
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "unauthorized"

        # An encoded CR/LF (and ESC) in the path cannot forge a line.
        answer = await raw_http(server.url, get(FORGED_PATH))
        assert status_of(answer) == 404
        line = (await server.line("/nowhere")).string
        assert "/nowhere\\r\\n" + FORGED + "\\x1b[31m 404" in line

        # No trusted proxy: X-Forwarded-For is the client's word, not its address.
        await raw_http(server.url, get(b"/xff-probe", b"X-Forwarded-For: 203.0.113.9"))
        line = (await server.line("/xff-probe")).string
        assert line.split(" 404 ")[1].split()[1] == "peer=127.0.0.1"

        # Hundreds of half-sent heads from 127.0.0.2: its own bound (8) evicts its own.
        flood = await flood_half_sent_heads(server.url, 300, source="127.0.0.2")
        await asyncio.gather(*(_closed_by_server(reader) for reader, _ in flood[:-8]))
        for path in (b"/healthz", b"/readyz"):
            answer = await raw_http(server.url, get(path), source="127.0.0.1")
            assert status_of(answer) == 200, answer
        for _, writer in flood:
            writer.close()
    lines = server.lines
    assert "Traceback" not in server.log
    assert not [line for line in lines if line.startswith(FORGED)]
    assert not [line for line in lines if "\x1b" in line or "\r" in line]
    assert "203.0.113.9" not in server.log
    # One access line per undecodable token, nothing else about it.
    assert len([line for line in lines if "/v1/fleets 401" in line]) == 2
    assert "per-peer connection bound (8) reached by 127.0.0.2" in server.log


async def test_forwarded_for_is_logged_from_a_trusted_proxy_in_json_lines(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    env = {
        "PORT": "0",
        "HARU_API_TOKEN": EDGE_TOKEN,
        "HARU_LOG_FORMAT": "json",
        "HARU_TRUSTED_PROXIES": "10.0.0.0/8, 127.0.0.0/8",
    }
    async with haru_serve(env, cwd=tmp_path) as server:
        await raw_http(
            server.url,
            get(b"/xff-probe", b"X-Forwarded-For: 198.51.100.1, 203.0.113.9, 10.1.2.3"),
        )
        await raw_http(server.url, get(FORGED_PATH))
        await server.line("/xff-probe")
        await server.line("/nowhere")
    records = [json.loads(line) for line in server.lines if line.strip()]
    [probe] = [r for r in records if r.get("path") == "/xff-probe"]
    # Right to left past the trusted proxies; what the client wrote further left is ignored.
    assert probe["peer"] == "203.0.113.9"
    assert probe["message"].endswith("peer=203.0.113.9")
    [forged] = [r for r in records if str(r.get("path", "")).startswith("/nowhere")]
    assert forged["path"] == "/nowhere\\r\\n" + FORGED + "\\x1b[31m"
    assert "\n" not in forged["message"]
    assert "\x1b" not in forged["message"]
