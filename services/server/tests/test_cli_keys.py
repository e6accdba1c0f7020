"""``haru keys create|list|revoke`` as real processes against a real ``haru serve``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

TOKEN = "cli-keys-token-0123456789"
_LISTENING = re.compile(r"listening on \S+ \((http://\S+)\)")


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HARU_") and k not in ("DATABASE_URL", "PORT")
    }
    env.update(COLUMNS="200", **extra)
    return env


def haru(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "haru_server", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The bundled example fleet seeded, a ``haru serve`` on it; the CLI's env."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    seeded = haru("seed", env=_env(DATABASE_URL=url))
    assert seeded.returncode == 0, seeded.stderr
    server_env = _env(
        DATABASE_URL=url,
        PORT="0",
        HARU_API_TOKEN=TOKEN,
        HARU_RECONCILE_INTERVAL_MS="off",
        HARU_DEFAULT_FLEET="example",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "haru_server", "serve"],
        env=server_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    base = ""
    lines: list[str] = []
    for line in process.stderr:
        lines.append(line)
        match = _LISTENING.search(line)
        if match:
            base = match.group(1)
            break
    assert base, "".join(lines)
    try:
        yield _env(HARU_URL=base, HARU_API_TOKEN=TOKEN)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=20)


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
