"""The proxy presents each upstream's own serving credential, never the client's.

Real sockets: the proxy app on 127.0.0.1, emulated vLLM upstreams started with ``--api-key``
(they answer 401 without it, as vLLM does) that record every header they receive, a real
SQLite store, and the official ``openai`` SDK as the client (it always sends its own
``Authorization``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from haru_db import StateStore
from haru_db.testing import confirm_domains
from haru_protocol import FleetLayout
from haru_server._settings import Settings
from haru_sim import VllmSim, VllmSimConfig

CLIENT_KEY = "sk-client-secret-4471"
UPSTREAM_KEY = "vllm-api-key-9c2e1f"
PLACEMENT = {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"}
SETTINGS = Settings(route_lease_ms=0, chat_header_timeout_ms=5_000)

ServeProxy = Callable[..., Awaitable[str]]


async def _fleet(store: StateStore, models: list[dict[str, Any]]) -> None:
    layout = FleetLayout.model_validate(
        {
            "slug": "prod",
            "activeDomainSlug": "alpha",
            "domains": [
                {
                    "slug": "alpha",
                    "placement": PLACEMENT,
                    "slots": [{"kind": "inference", "gpuIndex": 0, "models": models}],
                }
            ],
        }
    )
    result = await store.apply_fleet_layout(layout, at=datetime.now(UTC))
    await confirm_domains(store, str(result.fleet_id), at=datetime.now(UTC))


async def _sim(stack: contextlib.AsyncExitStack, name: str, api_key: str | None) -> VllmSim:
    sim = VllmSim(VllmSimConfig(served_model_names=(name,), api_key=api_key))
    await stack.enter_async_context(sim)
    return sim


def _authorizations(sim: VllmSim) -> list[str]:
    return [v for r in sim.recorded_requests for k, v in r.headers if k.lower() == "authorization"]


async def _chat(base_url: str, model: str) -> str | None:
    async with openai.AsyncOpenAI(
        base_url=base_url,
        api_key=CLIENT_KEY,
        default_headers={"X-Haru-Fleet": "prod"},
        max_retries=0,
    ) as client:
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "keyed upstream"}]
        )
        return answer.choices[0].message.content


async def test_each_upstream_gets_its_own_credential_never_the_clients(
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    serve_proxy: ServeProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    by_env = await _sim(stack, "by-env", UPSTREAM_KEY)
    by_file = await _sim(stack, "by-file", "file-key-77d0")
    open_one = await _sim(stack, "open", None)
    monkeypatch.setenv("HARU_TEST_VLLM_KEY", f"  {UPSTREAM_KEY}\n")
    key_file = tmp_path / "vllm.key"
    key_file.write_text("file-key-77d0\n")
    await _fleet(
        sqlite_store,
        [
            {"name": "by-env", "servingUrl": by_env.url, "apiKeyEnv": "HARU_TEST_VLLM_KEY"},
            {"name": "by-file", "servingUrl": by_file.url, "apiKeyFile": str(key_file)},
            {"name": "open", "servingUrl": open_one.url},
        ],
    )
    proxy = await serve_proxy(sqlite_store, SETTINGS)
    for model in ("by-env", "by-file", "open"):
        assert await _chat(proxy, model) == "keyed upstream"
    assert _authorizations(by_env) == [f"Bearer {UPSTREAM_KEY}"]
    assert _authorizations(by_file) == ["Bearer file-key-77d0"]
    # No credential configured: nothing, and above all not the client's key.
    assert open_one.recorded_requests
    assert _authorizations(open_one) == []


async def test_a_credential_that_cannot_be_read_leaves_the_model_unavailable(
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    serve_proxy: ServeProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = await _sim(stack, "keyed", UPSTREAM_KEY)
    monkeypatch.delenv("HARU_TEST_UNSET_KEY", raising=False)
    await _fleet(
        sqlite_store,
        [
            {"name": "keyed", "servingUrl": sim.url, "apiKeyEnv": "HARU_TEST_UNSET_KEY"},
            {"name": "filed", "servingUrl": sim.url, "apiKeyFile": str(tmp_path / "missing")},
        ],
    )
    proxy = await serve_proxy(sqlite_store, SETTINGS)
    with caplog.at_level(logging.ERROR, logger="haru_server._proxy_routes"):
        for model in ("keyed", "filed"):
            with pytest.raises(openai.APIStatusError) as raised:
                await _chat(proxy, model)
            assert raised.value.status_code == 503
    # Never sent without its credential.
    assert not sim.recorded_requests
    text = caplog.text
    assert "apiKeyEnv 'HARU_TEST_UNSET_KEY' is unset or blank" in text
    assert "cannot be read (FileNotFoundError)" in text
