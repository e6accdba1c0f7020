"""Tokens rotated under running processes: a real server and real supervisors, no restart.

Each process reads its token from its own file (``HARU_API_TOKEN_FILE``,
``HARU_SUPERVISOR_TOKEN_FILE``), as each host does in production. The supervisor token is
rotated in the documented order (every supervisor first, then the server, within the
supervisors' overlap) and no heartbeat is refused; the admin token is rotated and the old one
gets 401 at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from haru_demo import DemoTopology, fetch_events
from haru_protocol import EventType, FleetSnapshot

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = pytest.mark.slow

OLD_SUPERVISOR = "supervisor-token-old-0123456789"
NEW_SUPERVISOR = "supervisor-token-new-0123456789"
OLD_ADMIN = "admin-token-old-0123456789abcdef"
NEW_ADMIN = "admin-token-new-0123456789abcdef"
OVERLAP_MS = 10_000
"""The supervisors' overlap in this test: the server's file is rewritten well within it."""

_SERVER_ROTATED = re.compile(r"HARU_SUPERVISOR_TOKEN_FILE changed: the new token is in use")


def rotate(path: Path, token: str) -> None:
    """Write a new file and rename it over the old one (an atomic rotation)."""
    staged = path.with_suffix(".new")
    staged.write_text(token + "\n", encoding="utf-8")
    os.replace(staged, path)


async def status_with(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status


async def test_supervisor_token_rotated_on_both_sides_keeps_heartbeats_answered(
    launch: Launch, eventually: Eventually
) -> None:
    topology = await launch(
        supervisor_token=OLD_SUPERVISOR,
        api_token=OLD_ADMIN,
        standby_posture=False,
        supervisor_env={"HARU_SUPERVISOR_TOKEN_OVERLAP_MS": str(OVERLAP_MS)},
    )
    slugs = list(topology.domains)
    async with topology.control() as client:
        before = await fetch_events(client, topology.fleet_slug)
    last_event = before[-1].id if before else 0
    statuses = {slug: f"{topology.domains[slug].supervisor_url}/v1/status" for slug in slugs}
    async with aiohttp.ClientSession() as http:
        for slug in slugs:
            assert await status_with(http, statuses[slug], OLD_SUPERVISOR) == 200
            assert await status_with(http, statuses[slug], NEW_SUPERVISOR) == 401

        # 1. Every supervisor's file: each takes the new token and keeps the old one a while.
        for slug in slugs:
            rotate(topology.supervisor_token_file(slug), NEW_SUPERVISOR)
        for slug in slugs:

            async def takes_new(slug: str = slug) -> bool:
                return await status_with(http, statuses[slug], NEW_SUPERVISOR) == 200

            await eventually(takes_new, what=f"supervisor {slug} to accept the new token")

        # 2. The server's file: it presents the new token from its next look on.
        rotate(topology.supervisor_token_file("server"), NEW_SUPERVISOR)
        assert topology.server is not None
        await topology.server.wait_for_line(_SERVER_ROTATED, timeout_s=30)

        # 3. The overlap ends: the old token is refused everywhere.
        for slug in slugs:

            async def refuses_old(slug: str = slug) -> bool:
                return await status_with(http, statuses[slug], OLD_SUPERVISOR) == 401

            await eventually(
                refuses_old,
                what=f"supervisor {slug} to refuse the old token",
                timeout_s=OVERLAP_MS / 1000 + 30,
            )

    # Heartbeats made after that carry the new token: every domain is seen again, cleanly.
    seen = {d.slug: d.last_seen_at for d in (await topology.fleet()).domains}

    def answered_since(fleet: FleetSnapshot) -> bool:
        def fresh(slug: str, at: datetime | None) -> bool:
            before = seen[slug]
            return at is not None and (before is None or at > before)

        return all(
            fresh(d.slug, d.last_seen_at) and d.last_supervisor_error is None and not d.auth_failing
            for d in fleet.domains
        )

    await topology.wait_for_fleet(answered_since, what="heartbeats after the overlap ended")
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug, after=last_event)
    refused = [e for e in events if e.type == EventType.DOMAIN_SUPERVISOR_UNAUTHORIZED.value]
    assert refused == [], refused


async def test_admin_token_rotated_without_restart(launch: Launch, eventually: Eventually) -> None:
    topology = await launch(api_token=OLD_ADMIN, standby_posture=False)
    fleets = f"{topology.server_url}/v1/fleets"
    chat = f"{topology.server_url}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:

        async def chat_status(token: str) -> int:
            headers = {"Authorization": f"Bearer {token}"}
            async with http.post(chat, json=body, headers=headers) as response:
                return response.status

        assert await status_with(http, fleets, OLD_ADMIN) == 200
        assert await status_with(http, fleets, NEW_ADMIN) == 401
        # The proxy knows the admin token (and refuses it: client keys only).
        assert await chat_status(OLD_ADMIN) == 403

        rotate(topology.api_token_file(), NEW_ADMIN)

        async def takes_new() -> bool:
            return await status_with(http, fleets, NEW_ADMIN) == 200

        await eventually(takes_new, what="the server to accept the new admin token")
        assert await status_with(http, fleets, OLD_ADMIN) == 401
        assert await chat_status(NEW_ADMIN) == 403
        assert await chat_status(OLD_ADMIN) == 401  # now just an unknown client key
    log = (topology.workdir / "logs" / "server.log").read_text(encoding="utf-8")
    assert "HARU_API_TOKEN_FILE changed: the new token is in use" in log
    assert OLD_ADMIN not in log
    assert NEW_ADMIN not in log
