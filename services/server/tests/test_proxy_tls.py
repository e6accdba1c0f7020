"""The proxy's link to serving endpoints: verified TLS, plain HTTP refused beyond loopback.

Real sockets: the proxy app on 127.0.0.1, an emulated vLLM behind a TLS terminator whose
certificate comes from a trustme CA, a real SQLite store, and the official ``openai`` SDK as
the client; the boot warnings from a whole ``run_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from haru_db import StateStore, upgrade
from haru_db.testing import confirm_domains
from haru_protocol import FleetLayout
from haru_server._settings import Settings
from haru_sim import VllmSim, VllmSimConfig

PLACEMENT = {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"}
PROMPT = "tls-upstream-prompt-5d1a"

ServeProxy = Callable[..., Awaitable[str]]
RunningServer = Callable[[Settings], AbstractAsyncContextManager[str]]
HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""


async def _fleet(store: StateStore, serving_url: str) -> None:
    layout = FleetLayout.model_validate(
        {
            "slug": "prod",
            "activeDomainSlug": "alpha",
            "domains": [
                {
                    "slug": "alpha",
                    "placement": PLACEMENT,
                    "slots": [
                        {
                            "kind": "inference",
                            "gpuIndex": 0,
                            "models": [{"name": "chat", "servingUrl": serving_url}],
                        }
                    ],
                }
            ],
        }
    )
    result = await store.apply_fleet_layout(layout, at=datetime.now(UTC))
    await confirm_domains(store, str(result.fleet_id), at=datetime.now(UTC))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def _tls_front(
    stack: contextlib.AsyncExitStack, cert: Path, key: Path, upstream_port: int
) -> int:
    """A TLS terminator on 127.0.0.1 in front of ``upstream_port`` (as nginx would be)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tasks: set[asyncio.Future[Any]] = set()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        task = asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        tasks.add(task)
        await task

    server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context)

    async def close() -> None:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    stack.push_async_callback(close)
    return int(server.sockets[0].getsockname()[1])


async def _sim(stack: contextlib.AsyncExitStack, host: str = "127.0.0.1") -> VllmSim:
    sim = VllmSim(VllmSimConfig(served_model_names=("chat",)))
    await sim.start(host, 0)
    stack.push_async_callback(sim.stop)
    return sim


async def _chat(base_url: str) -> str | None:
    async with openai.AsyncOpenAI(
        base_url=base_url,
        api_key="sk-client",
        default_headers={"X-Haru-Fleet": "prod"},
        max_retries=0,
    ) as client:
        answer = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": PROMPT}]
        )
        return answer.choices[0].message.content


async def test_an_https_upstream_is_verified_against_the_serving_ca_file(
    sqlite_store: StateStore, stack: contextlib.AsyncExitStack, serve_proxy: ServeProxy, pki: Any
) -> None:
    sim = await _sim(stack)
    cert, key = pki.leaf("upstream")
    port = await _tls_front(stack, cert, key, sim.port)
    await _fleet(sqlite_store, f"https://127.0.0.1:{port}")
    settings = Settings(route_lease_ms=0, chat_header_timeout_ms=5_000, serving_ca_file=pki.ca_file)
    base = await serve_proxy(sqlite_store, settings)
    assert await _chat(base) == PROMPT
    assert [r.path for r in sim.recorded_requests] == ["/v1/chat/completions"]


async def test_an_upstream_of_a_foreign_ca_is_refused_with_a_clear_error(
    sqlite_store: StateStore, stack: contextlib.AsyncExitStack, serve_proxy: ServeProxy, pki: Any
) -> None:
    sim = await _sim(stack)
    cert, key = pki.leaf("foreign", ca=pki.other)
    port = await _tls_front(stack, cert, key, sim.port)
    await _fleet(sqlite_store, f"https://127.0.0.1:{port}")
    settings = Settings(route_lease_ms=0, chat_header_timeout_ms=5_000, serving_ca_file=pki.ca_file)
    base = await serve_proxy(sqlite_store, settings)
    with pytest.raises(openai.APIStatusError) as caught:
        await _chat(base)
    assert caught.value.status_code == 502
    error = caught.value.response.json()["error"]
    assert error["code"] == "upstream_unreachable"
    assert "failed TLS verification: certificate verification failed" in error["message"]
    # Refused before anything was sent: no fallback, no retry in clear text.
    assert sim.recorded_requests == ()


async def test_an_expired_upstream_certificate_is_refused(
    sqlite_store: StateStore, stack: contextlib.AsyncExitStack, serve_proxy: ServeProxy, pki: Any
) -> None:
    sim = await _sim(stack)
    cert, key = pki.leaf("expired", expired=True)
    port = await _tls_front(stack, cert, key, sim.port)
    await _fleet(sqlite_store, f"https://127.0.0.1:{port}")
    settings = Settings(route_lease_ms=0, chat_header_timeout_ms=5_000, serving_ca_file=pki.ca_file)
    base = await serve_proxy(sqlite_store, settings)
    with pytest.raises(openai.APIStatusError) as caught:
        await _chat(base)
    assert caught.value.status_code == 502
    assert "expired" in caught.value.response.json()["error"]["message"]
    assert sim.recorded_requests == ()


@pytest.mark.parametrize("allowed", [False, True])
async def test_a_plain_http_upstream_on_another_host_is_refused_unless_allowed(
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    serve_proxy: ServeProxy,
    outside_address: str,
    allowed: bool,
) -> None:
    address = outside_address
    sim = await _sim(stack, host="0.0.0.0")  # reached at the host's address
    await _fleet(sqlite_store, f"http://{address}:{sim.port}")
    settings = Settings(route_lease_ms=0, chat_header_timeout_ms=5_000, allow_plaintext=allowed)
    base = await serve_proxy(sqlite_store, settings)
    if allowed:
        assert await _chat(base) == PROMPT
        return
    with pytest.raises(openai.APIStatusError) as caught:
        await _chat(base)
    assert caught.value.status_code == 502
    error = caught.value.response.json()["error"]
    assert error["code"] == "upstream_unreachable"
    assert "plain HTTP on another host" in error["message"]
    assert "HARU_ALLOW_PLAINTEXT=1" in error["message"]
    assert sim.recorded_requests == ()


@pytest.mark.parametrize("allowed", [False, True])
async def test_the_server_names_each_domain_served_in_clear_text_at_boot(
    running_server: RunningServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, allowed: bool
) -> None:
    db = f"sqlite:///{tmp_path / 'boot.db'}"
    await upgrade(db)
    store = StateStore.open(db)
    try:
        await _fleet(store, "http://192.0.2.7:8000/serving?key=x")
    finally:
        await store.close()
    caplog.set_level(logging.WARNING)
    async with running_server(Settings(database_url=db, port=0, allow_plaintext=allowed)):
        pass
    log = caplog.text
    endpoint = "domain alpha of fleet prod: serving endpoint http://192.0.2.7:8000"
    if allowed:
        assert f"{endpoint} is reached in CLEAR TEXT" in log
    else:
        assert f"{endpoint} is plain HTTP on another host" in log
    assert "key=x" not in log  # the origin only: a query may carry a credential


async def test_haru_serve_refuses_a_serving_ca_file_that_does_not_load(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    env = {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'boot.db'}",
        "HARU_CREATE_DATABASE": "1",  # only the CA file is wrong
        "PORT": "0",
        "HARU_SERVING_CA_FILE": str(tmp_path / "missing.pem"),
    }
    async with haru_serve(env, listening=False) as server:
        code = await server.exited()
    assert code == 2, server.log
    assert "cannot load HARU_SERVING_CA_FILE" in server.log
