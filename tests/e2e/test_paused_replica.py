"""A server process paused through a promotion never routes to the old active when it resumes.

Two ``haru serve`` processes on one SQLite database: the topology's server, and a replica that
routes chat. The replica keeps a route lease for the fleet (alpha active), is SIGSTOPped, and
beta is promoted through the other server until alpha's vLLM sleeps. Requests sent to the
replica while it is stopped wait in its listening socket; on SIGCONT its route lease has long
run out while the store answers, so every request must be routed after a pointer read: to
beta, never to the sleeping alpha (whose emulated vLLM counts requests that arrive asleep).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from haru_demo import DemoTopology, active_slug
from haru_demo._procs import ChildProcess, spawn
from haru_protocol import OperationKind, OperationState

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="POSIX job control signals"),
]

_LISTENING = re.compile(r"haru-server listening on [^\s:]+:(\d+)")
PAUSED_REQUESTS = 6


async def start_replica(topology: DemoTopology) -> tuple[ChildProcess, str]:
    env = topology.server_env()
    env.update(
        PORT="0",
        # A pure router: the loop reconciles no fleet of this database, so nothing the
        # promotion needs is ever claimed by the process this test stops.
        HARU_RECONCILE_FLEETS="not-a-fleet-of-this-test",
        # A request routed to the sleeping alpha hangs there (parked); fail it soon.
        HARU_CHAT_HEADER_TIMEOUT_MS="3000",
        HARU_FAILOVER_HOLD_MS="0",
    )
    process = await spawn(
        "replica",
        [sys.executable, "-m", "haru_server", "serve"],
        env=env,
        cwd=topology.workdir,
        log_path=topology.workdir / "logs" / "replica.log",
    )
    match = await process.wait_for_line(_LISTENING, timeout_s=60)
    return process, f"http://127.0.0.1:{match.group(1)}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # One connection per request: each may land on a fresh accept of the stopped replica.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as http:
        yield http


async def chat(http: aiohttp.ClientSession, url: str, model: str) -> tuple[int, dict[str, str]]:
    body = {"model": model, "messages": [{"role": "user", "content": "who serves?"}]}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


Sent = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def send_raw(url: str, model: str) -> Sent:
    """Connect and send one chat request; returns once the request sits in the kernel's buffers.

    The kernel completes the handshake and buffers the bytes for a stopped process, so this
    proves (without any sleep) that the request is waiting for the replica when it resumes.
    """
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "who?"}]})
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    await writer.drain()
    return reader, writer


async def answer_of(sent: Sent) -> tuple[int, dict[str, str]]:
    reader, writer = sent
    try:
        async with asyncio.timeout(30):
            raw = await reader.read()  # Connection: close: the answer ends at EOF
    finally:
        writer.close()
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:])
    return int(head[0].split()[1]), headers


async def arrived_asleep(topology: DemoTopology, slug: str) -> int:
    states = await topology.vllm_states(slug)
    total = 0
    for state in states.values():
        assert state is not None
        counters = state["counters"]
        assert isinstance(counters, dict)
        total += int(counters["arrived_while_sleeping"])
    return total


async def all_asleep(topology: DemoTopology, slug: str) -> bool:
    states = await topology.vllm_states(slug)
    return all(state is not None and state["sleeping"] is True for state in states.values())


async def test_a_resumed_replica_reads_the_pointer_before_routing_on_its_expired_lease(
    launch: Launch, eventually: Eventually, session: aiohttp.ClientSession
) -> None:
    topology = await launch()
    assert active_slug(await topology.fleet()) == "alpha"
    model = topology.domains["alpha"].models[0]
    replica, url = await start_replica(topology)
    try:
        # Routed requests make the replica record and then keep a lease (a few lease rounds).
        for _ in range(20):
            status, headers = await chat(session, url, model)
            assert status == 200
            assert "X-Haru-Routing" not in headers
            await asyncio.sleep(0.05)

        os.kill(replica.pid, signal.SIGSTOP)
        try:
            accepted = await topology.request(OperationKind.PROMOTE, "beta")
            assert accepted is not None
            final = await topology.wait_for_operation(accepted.id, timeout_s=60)
            assert final.state is OperationState.SUCCEEDED, final.error
            await eventually(lambda: all_asleep(topology, "alpha"), what="alpha asleep")
            before = await arrived_asleep(topology, "alpha")
            # Sent while the replica is stopped: they wait in its socket and are the first
            # thing it handles when it resumes.
            pending = [await send_raw(url, model) for _ in range(PAUSED_REQUESTS)]
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        answers = await asyncio.gather(*(answer_of(sent) for sent in pending))
        after_resume = [await chat(session, url, model) for _ in range(3)]
    finally:
        await replica.stop(grace_s=5)

    assert await arrived_asleep(topology, "alpha") == before, "a request reached sleeping alpha"
    for status, headers in [*answers, *after_resume]:
        assert status == 200
        # Routed on a pointer the store confirmed, not failed open on the expired lease.
        assert "X-Haru-Routing" not in headers
