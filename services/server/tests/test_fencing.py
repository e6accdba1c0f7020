"""A replica paused between its step and its supervisor call: its call is refused once another
replica took the operation further (real ``haru serve`` processes, SIGSTOP, real HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import aiohttp
from haru_db import StateStore
from haru_db.testing import DatabaseUrlFactory
from haru_demo.localfleet import LocalFleet
from haru_protocol import OperationState, PolicyPatch

MakeFleet = Callable[..., Awaitable[LocalFleet]]
HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""

TOKEN = "fencing-test-token"
_HEADERS = {"Authorization": f"Bearer {TOKEN}"}


class HoldingRelay:
    """A TCP relay in front of a supervisor that, once armed, holds the first sleep request.

    The held request's bytes wait in the relay until :meth:`release`, which forwards them and
    returns the supervisor's answer: the call its sender made before it was paused, delivered
    after another replica moved the operation on.
    """

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._armed = False
        self.held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._release = asyncio.Event()
        self._answer = bytearray()
        self._answered = asyncio.Event()
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        self._release.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def arm(self) -> None:
        self._armed = True

    async def release(self) -> tuple[int, bytes]:
        self._release.set()
        async with asyncio.timeout(30):
            await self._answered.wait()
        head, _, body = bytes(self._answer).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        holding = False

        async def to_upstream() -> None:
            nonlocal holding
            while chunk := await reader.read(65536):
                if self._armed and not self.held.done() and b"POST /v1/vllm/sleep" in chunk:
                    holding = True
                    self.held.set_result(None)
                    await self._release.wait()
                up_writer.write(chunk)
                await up_writer.drain()
            up_writer.close()

        async def to_client() -> None:
            while chunk := await up_reader.read(65536):
                if holding:
                    self._answer.extend(chunk)
                    if _complete(bytes(self._answer)):
                        self._answered.set()
                writer.write(chunk)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
            writer.close()

        with contextlib.suppress(ConnectionError):
            await asyncio.gather(to_upstream(), to_client())


def _complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


async def _until(check: Callable[[], Awaitable[bool]], *, what: str, limit_s: float = 60) -> None:
    try:
        async with asyncio.timeout(limit_s):
            while not await check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _promote(
    http: aiohttp.ClientSession, replica: Any, store: StateStore, target: UUID
) -> UUID:
    """Request a promote of ``target`` (retrying while another operation is in flight)."""
    accepted: list[UUID] = []

    async def request() -> bool:
        async with http.post(
            f"{replica.url}/v1/fleets/local/promote", json={"targetDomainId": str(target)}
        ) as response:
            body = await response.json()
            if response.status == 202 and body["operation"]["targetDomainId"] == str(target):
                accepted.append(UUID(body["operation"]["id"]))
                return True
            return False

    await _until(request, what=f"a promote of {target} to be accepted")
    return accepted[0]


async def _succeeded(store: StateStore, operation_id: UUID) -> None:
    async def done() -> bool:
        operation = await store.get_operation(operation_id)
        assert operation is not None
        assert operation.state is not OperationState.FAILED, operation.error
        return operation.state is OperationState.SUCCEEDED

    await _until(done, what=f"operation {operation_id} to succeed")


async def test_a_paused_replica_cannot_sleep_the_active_after_another_replica_took_over(
    haru_serve: HaruServe, database_url_factory: DatabaseUrlFactory, make_fleet: MakeFleet
) -> None:
    url = await database_url_factory()
    fleet = await make_fleet()
    alpha = fleet.domain("alpha")
    relay = HoldingRelay(int(alpha.supervisor_url.rsplit(":", 1)[1]))
    await relay.start()
    alpha.supervisor_url = relay.url
    store = StateStore.open(url)
    try:
        # The paused replica's step budget outlasts the pause, so it reads the refusal.
        policy = PolicyPatch(sleep_timeout_ms=300_000)
        await store.apply_fleet_layout(fleet.layout(policy=policy), at=datetime.now(UTC))
        seeded = await store.get_fleet_snapshot("local")
        assert seeded is not None
        ids = {d.slug: d.id for d in seeded.domains}
        env = {
            "DATABASE_URL": url,
            "PORT": "0",
            "HARU_API_TOKEN": TOKEN,
            "HARU_RECONCILE_INTERVAL_MS": "100",
        }
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(relay.close)
            http = await stack.enter_async_context(aiohttp.ClientSession(headers=_HEADERS))
            stalled = await stack.enter_async_context(haru_serve(env))

            async def settled() -> bool:
                snapshot = await store.get_fleet_snapshot("local")
                assert snapshot is not None
                ready = all(d.state.value == "ready" for d in snapshot.domains)
                return ready and await store.get_in_flight_operation(seeded.id) is None

            await _until(settled, what="both domains ready, nothing in flight")
            relay.arm()
            away = await _promote(http, stalled, store, ids["beta"])
            # The stalled replica drives the promote up to demote_old_sleep and sends alpha's
            # sleep; the relay holds it and the replica is paused right there.
            async with asyncio.timeout(60):
                await relay.held
            stalled.process.send_signal(signal.SIGSTOP)
            try:
                # Another replica finishes that promote (sleeping alpha and restarting its
                # training itself), then promotes alpha back: alpha is the awake active again.
                taker = await stack.enter_async_context(haru_serve(env))
                await _succeeded(store, away)
                back = await _promote(http, taker, store, ids["alpha"])
                await _succeeded(store, back)
                pointer = await store.get_fleet_route_pointer("local")
                assert pointer is not None
                assert pointer.active_domain_id == ids["alpha"]
                assert not any(sim.sleeping for sim in alpha.sims.values())
                # The stalled replica's sleep finally reaches alpha's supervisor.
                status, body = await relay.release()
            finally:
                stalled.process.send_signal(signal.SIGCONT)
            assert status == 409, body
            assert b'"stale_fence"' in body
            # Refused before acting: the active is still awake.
            assert not any(sim.sleeping for sim in alpha.sims.values())

            async def lost() -> bool:
                return "lost the claim" in stalled.log

            await _until(lost, what="the resumed replica to see it lost the claim")
            assert "Traceback" not in stalled.log + taker.log
    finally:
        await store.close()
