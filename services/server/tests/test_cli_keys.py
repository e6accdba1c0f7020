"""``haru keys create|list|revoke`` as real processes against a real ``haru serve``."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

Haru = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def served(serve_example: Callable[..., dict[str, str]]) -> dict[str, str]:
    """The bundled example fleet seeded, a ``haru serve`` on it; the CLI's env.

    No ``DATABASE_URL``: the keys commands must work over the API alone.
    """
    env = serve_example(HARU_DEFAULT_FLEET="example")
    del env["DATABASE_URL"]
    return env


async def chat(base: str, key: str, model: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            base + "/v1/chat/completions",
            json={"model": model, "messages": []},
            headers={"Authorization": f"Bearer {key}"},
        ) as answer,
    ):
        return answer.status, await answer.json()


async def test_keys_are_created_listed_and_revoked_from_the_command_line(
    haru: Haru,
    served: dict[str, str],
) -> None:
    made = haru("keys", "create", "billing", "--models", "m1,m2", "--rpm", "5", env=served)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip().splitlines()[-1]
    assert secret.startswith("hk_")
    key_id = made.stdout.split()[1]

    listed = haru("keys", "list", "--json", env=served)
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)["keys"]
    assert entry["id"] == key_id
    assert entry["models"] == ["m1", "m2"]
    assert entry["rpm"] == 5
    assert secret not in listed.stdout
    table = haru("keys", "list", env=served)
    assert key_id in table.stdout
    assert "billing" in table.stdout

    # The key passes the proxy's check and meets its model limit.
    status, body = await chat(served["HARU_URL"], secret, "other-model")
    assert status == 403, body
    assert "may not use model" in str(body)

    revoked = haru("keys", "revoke", key_id, env=served)
    assert revoked.returncode == 0, revoked.stderr
    assert f"key {key_id} (billing) revoked" in revoked.stdout
    # The server's lease is 300 ms; the timeout only bounds a hang.
    async with asyncio.timeout(30):
        while (await chat(served["HARU_URL"], secret, "other-model"))[0] != 401:
            await asyncio.sleep(0.05)

    bad = haru("keys", "revoke", "not-an-id", env=served)
    assert bad.returncode != 0
    assert "not a key id" in bad.stderr
    unknown = haru("keys", "revoke", "00000000-0000-4000-8000-000000000000", env=served)
    assert unknown.returncode != 0
    assert "not found" in unknown.stderr
