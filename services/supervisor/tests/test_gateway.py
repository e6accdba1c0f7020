"""``haru-gateway`` as a real process in front of the vLLM emulator: real sockets throughout.

The shapes the server's proxy is checked with (tests/e2e/test_service_hardening.py,
services/server/tests/test_proxy.py): request smuggling, chunked uploads, slow and idle
clients, oversized bodies, unauthenticated callers, 1,000 concurrent streams, and model names
with a slash, a space and non-ASCII letters.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import ssl
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import openai
import pytest
from haru_sim import VllmSim, VllmSimConfig
from yarl import URL

TOKEN = "serving-credential-5b1e9c7d"
SLASHED = "qwen/qwen3-8b"
SPACED = "café au lait 7b"
MAX_BODY = 4096
_LISTENING = re.compile(r"listening on (https?://[0-9.]+:[0-9]+)")


@dataclass
class Gateway:
    url: str
    process: asyncio.subprocess.Process
    lines: list[str]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def base(self, model: str) -> str:
        return f"{self.url}/m/{quote(model, safe='')}"


def _raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@asynccontextmanager
async def _gateway(
    routes: dict[str, int],
    *extra: str,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] = _raise_file_limit,
) -> AsyncIterator[Gateway]:
    argv = [sys.executable, "-m", "haru_supervisor._gateway", "--host", "127.0.0.1"]
    argv += ["--listen", "0", "--max-body-bytes", str(MAX_BODY), *extra]
    for name, port in routes.items():
        argv += ["--route", f"{name}={port}"]
    environment = {"HARU_SERVING_TOKEN": TOKEN, "PATH": "/usr/bin:/bin", **(env or {})}
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
        preexec_fn=preexec,
    )
    assert process.stderr is not None
    lines: list[str] = []
    url = ""
    async with asyncio.timeout(60):
        while not url:
            raw = await process.stderr.readline()
            if not raw:
                raise AssertionError("the gateway exited:\n" + "\n".join(lines))
            lines.append(raw.decode(errors="replace").rstrip())
            match = _LISTENING.search(lines[-1])
            url = match.group(1) if match else ""

    async def drain() -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            lines.append(raw.decode(errors="replace").rstrip())

    drainer = asyncio.create_task(drain())
    try:
        yield Gateway(url, process, lines)
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()
        await drainer


@pytest.fixture
async def sims() -> AsyncIterator[dict[str, VllmSim]]:
    configs = {
        SLASHED: VllmSimConfig(served_model_names=(SLASHED,), max_num_seqs=1024),
        SPACED: VllmSimConfig(served_model_names=(SPACED,)),
    }
    started: dict[str, VllmSim] = {}
    try:
        for name, config in configs.items():
            sim = VllmSim(config)
            await sim.start()
            started[name] = sim
        yield started
    finally:
        for sim in started.values():
            await sim.stop()


@pytest.fixture
async def gateway(sims: dict[str, VllmSim]) -> AsyncIterator[Gateway]:
    routes = {name: sim.port for name, sim in sims.items()}
    limits = ["--header-timeout-s", "1", "--body-idle-timeout-s", "1"]
    async with _gateway(routes, *limits) as running:
        yield running


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def _raw(port: int, payload: bytes, *, timeout: float = 30) -> bytes:
    """Send ``payload`` and read until the gateway closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        chunks = []
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _chat(model: str, text: str = "hi") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def _post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: gpu", f"Authorization: Bearer {TOKEN}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


# ---- the credential ---------------------------------------------------------------------------


async def test_unauthenticated_requests_are_401_and_never_name_a_model(
    gateway: Gateway, sims: dict[str, VllmSim]
) -> None:
    chat = f"/m/{quote(SLASHED, safe='')}/v1/chat/completions"
    models = f"/m/{quote(SPACED, safe='')}/v1/models"
    async with aiohttp.ClientSession() as http:
        for method, path, headers in (
            ("POST", chat, {}),
            ("POST", chat, {"Authorization": "Bearer wrong"}),
            ("POST", chat, {"Authorization": f"Basic {TOKEN}"}),
            ("GET", models, {}),
            ("POST", "/m/anything/sleep", {}),
            ("GET", "/v1/models", {}),
        ):
            async with http.request(method, gateway.url + path, headers=headers) as resp:
                text = await resp.text()
                assert resp.status == 401, (method, path, text)
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                assert json.loads(text)["error"]["code"] == "unauthorized"
                assert "qwen" not in text
                assert "café" not in text
        # The readiness probe sends no credential: a bare verdict, no names.
        async with http.get(gateway.url + "/health") as resp:
            assert resp.status == 200
            assert await resp.json() == {"ok": True}
        await sims[SPACED].set_faults(refuse=True)
        async with http.get(gateway.url + "/health") as resp:
            assert resp.status == 503
            assert await resp.json() == {"ok": False}
        async with http.get(
            gateway.url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            assert resp.status == 503
            assert await resp.json() == {"ok": False, "notHealthy": [SPACED]}
    assert all(not sim.recorded_requests for sim in sims.values())


async def test_the_gateway_refuses_to_start_without_a_credential(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_supervisor._gateway",
        "--listen",
        "0",
        "--route",
        "m=8100",
        env={"PATH": "/usr/bin:/bin", "HARU_SERVING_TOKEN": "  "},
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    assert process.returncode == 2
    assert b"HARU_SERVING_TOKEN" in err


# ---- routing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [SLASHED, SPACED])
async def test_every_model_name_is_served_through_the_sdk(
    gateway: Gateway, sims: dict[str, VllmSim], model: str
) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.base(model) + "/v1", api_key=TOKEN)
    async with client:
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello there"}]
        )
        assert answer.choices[0].message.content == "hello there"
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "one two three"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "one two three"
        completion = await client.completions.create(model=model, prompt="abc", max_tokens=3)
        assert completion.choices[0].text
        embedding = await client.embeddings.create(model=model, input="abc")
        assert embedding.data[0].embedding
        listed = await client.models.list()
        assert [m.id for m in listed.data] == [model]
    recorded = sims[model].recorded_requests
    assert recorded
    # The serving credential stops at the gateway: vLLM never sees an Authorization header.
    for request in recorded:
        assert all(key.lower() != "authorization" for key, _ in request.headers)


async def test_a_slash_routes_encoded_or_not(
    gateway: Gateway, sims: dict[str, VllmSim], auth: dict[str, str]
) -> None:
    async with aiohttp.ClientSession() as http:
        for path in (
            "/m/qwen/qwen3-8b/v1/chat/completions",
            "/m/qwen%2Fqwen3-8b/v1/chat/completions",
            "/m/qwen%2fqwen3-8b/v1/chat/completions?ignored=1",
        ):
            url = URL(gateway.url + path, encoded=True)
            async with http.post(url, data=_chat(SLASHED, "routed"), headers=auth) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["message"]["content"] == "routed"
    assert len(sims[SLASHED].recorded_requests) == 3


async def test_only_the_inference_routes_are_reachable(
    gateway: Gateway, sims: dict[str, VllmSim], auth: dict[str, str]
) -> None:
    slashed = quote(SLASHED, safe="")
    async with aiohttp.ClientSession() as http:
        for method, path, status in (
            ("POST", f"/m/{slashed}/sleep", 404),
            ("POST", f"/m/{slashed}/wake_up", 404),
            ("GET", f"/m/{slashed}/metrics", 404),
            ("GET", f"/m/{slashed}/v1/chat/completions", 405),
            ("POST", f"/m/{slashed}/v1/models", 405),
            ("POST", "/m/other-model/v1/chat/completions", 404),
            ("POST", "/m/%ff/v1/chat/completions", 404),
            ("POST", "/v1/chat/completions", 404),
        ):
            url = URL(gateway.url + path, encoded=True)
            async with http.request(method, url, data=b"{}", headers=auth) as resp:
                assert resp.status == status, (method, path)
                assert "error" in await resp.json()
    assert not sims[SLASHED].recorded_requests


# ---- framing ------------------------------------------------------------------------------------


async def test_a_chunked_upload_reaches_vllm_intact(
    gateway: Gateway, sims: dict[str, VllmSim]
) -> None:
    body = _chat(SLASHED, "chunked upload")
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:30], body[30:]))
    path = f"/m/{quote(SLASHED, safe='')}/v1/chat/completions"
    request = _post(
        path,
        framed + b"0\r\n\r\n",
        "Content-Type: application/json",
        "Transfer-Encoding: chunked",
        "Connection: close",
    )
    answer = await _raw(gateway.port, request)
    assert _status(answer) == 200, answer
    assert b"chunked upload" in answer
    (recorded,) = sims[SLASHED].recorded_requests
    assert recorded.body == body


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        pytest.param(
            ("Content-Length: 5", "Transfer-Encoding: chunked"), b"0\r\n\r\n", id="cl-and-te"
        ),
        pytest.param(
            ("Transfer-Encoding: chunked", "Content-Length: 5"), b"0\r\n\r\n", id="te-and-cl"
        ),
        pytest.param(("Content-Length: 2", "Content-Length: 40"), b"{}", id="duplicate-cl"),
        pytest.param(("Transfer-Encoding: chunked",), b"zz\r\n{}\r\n0\r\n\r\n", id="bad-chunk"),
        pytest.param(("Transfer-Encoding: gzip, chunked, identity",), b"0\r\n\r\n", id="bad-te"),
        pytest.param(("Content-Length: -1",), b"", id="negative-cl"),
    ],
)
async def test_smuggling_shapes_are_refused_with_400(
    gateway: Gateway, sims: dict[str, VllmSim], headers: tuple[str, ...], body: bytes
) -> None:
    path = f"/m/{quote(SLASHED, safe='')}/v1/chat/completions"
    smuggled = b"POST /m/x/sleep HTTP/1.1\r\nHost: gpu\r\nContent-Length: 0\r\n\r\n"
    answer = await _raw(gateway.port, _post(path, body + smuggled, *headers))
    assert _status(answer) == 400, answer
    _, _, rest = answer.partition(b"\r\n\r\n")
    assert json.loads(rest)["error"]["code"] == "invalid_request"
    assert answer.count(b"HTTP/1.") == 1  # the connection is closed: nothing read as a request
    assert not sims[SLASHED].recorded_requests


async def test_oversized_bodies_are_413_and_the_cap_itself_passes(
    gateway: Gateway, sims: dict[str, VllmSim]
) -> None:
    path = f"/m/{quote(SLASHED, safe='')}/v1/chat/completions"
    declared = _post(path, b"", f"Content-Length: {MAX_BODY + 1}", "Connection: close")
    answer = await _raw(gateway.port, declared)
    assert _status(answer) == 413, answer
    assert b"payload_too_large" in answer
    assert not sims[SLASHED].recorded_requests
    # Chunked: cut one byte past the cap, whatever the framing claimed.
    piece = b"x" * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(5)) + b"0\r\n\r\n"
    chunked = _post(path, chunks, "Transfer-Encoding: chunked", "Connection: close")
    answer = await _raw(gateway.port, chunked)
    assert _status(answer) == 413, answer
    assert b"payload_too_large" in answer
    # Exactly at the cap: forwarded.
    body = _chat(SLASHED, "y" * 10)
    body = body[:-1] + b" " * (MAX_BODY - len(body)) + b"}"
    assert len(body) == MAX_BODY
    exact = _post(path, body, f"Content-Length: {len(body)}", "Connection: close")
    answer = await _raw(gateway.port, exact)
    assert _status(answer) == 200, answer
    assert sims[SLASHED].recorded_requests[-1].body == body


# ---- slow and idle clients ----------------------------------------------------------------------


async def test_slow_and_idle_clients_are_cut(gateway: Gateway, sims: dict[str, VllmSim]) -> None:
    path = f"/m/{quote(SLASHED, safe='')}/v1/chat/completions"
    # Nothing sent at all, half a request head, a body that stops: each is closed by the
    # gateway (read() returns at EOF; the bound is the gateway's, 1 s here).
    idle = await _raw(gateway.port, b"")
    assert idle == b"" or _status(idle) == 408
    half_head = await _raw(gateway.port, f"POST {path} HTTP/1.1\r\nHost: gpu\r\n".encode())
    assert _status(half_head) == 408
    half_body = await _raw(gateway.port, _post(path, b'{"model": ', "Content-Length: 100"))
    assert not half_body.startswith(b"HTTP/1.1 200")
    assert not sims[SLASHED].recorded_requests


# ---- load ---------------------------------------------------------------------------------------


@pytest.fixture
def many_files() -> Iterator[None]:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    _raise_file_limit()
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 4096:
        pytest.skip("the hard open-file limit is below 4096: 1,000 streams need ~3,000 files")
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


async def test_a_thousand_concurrent_streams(many_files: None, sims: dict[str, VllmSim]) -> None:
    async with _gateway({SLASHED: sims[SLASHED].port}) as running:  # default bounds
        texts = await _streams(running, 1000)
    assert texts == [f"stream {i} of many" for i in range(1000)]


def _few_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))


async def test_the_connection_cap_leaves_two_files_per_stream(sims: dict[str, VllmSim]) -> None:
    # 300 files: 64 kept back, two per stream (the client's and vLLM's connection).
    async with _gateway({SLASHED: sims[SLASHED].port}, preexec=_few_files) as running:
        texts = await _streams(running, 100)
    assert texts == [f"stream {i} of many" for i in range(100)]
    assert any("--max-connections lowered from 4096 to 118" in line for line in running.lines)


async def _streams(gateway: Gateway, count: int) -> list[str]:
    url = gateway.base(SLASHED) + "/v1/chat/completions"
    started = asyncio.Event()
    open_streams = 0
    connector = aiohttp.TCPConnector(limit=0)

    async def one(i: int, http: aiohttp.ClientSession) -> str:
        nonlocal open_streams
        body = json.loads(_chat(SLASHED, f"stream {i} of many"))
        body["stream"] = True
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200
            open_streams += 1
            if open_streams == count:
                started.set()
            # Every stream stays open until all 1,000 are open at once.
            await started.wait()
            text = []
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text.append(delta.get("content") or "")
            return "".join(text)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        async with asyncio.timeout(300):
            return await asyncio.gather(*(one(i, http) for i in range(count)))


# ---- TLS ----------------------------------------------------------------------------------------


async def test_tls_with_the_certificate_files(pki: Any, sims: dict[str, VllmSim]) -> None:
    cert_file, key_file = pki.leaf("gateway")
    env = {"HARU_TLS_CERT_FILE": str(cert_file), "HARU_TLS_KEY_FILE": str(key_file)}
    async with _gateway({SLASHED: sims[SLASHED].port}, env=env) as running:
        assert running.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(pki.ca_file))
        async with aiohttp.ClientSession() as http:
            url = running.base(SLASHED) + "/v1/chat/completions"
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with http.post(url, data=_chat(SLASHED), headers=headers, ssl=context) as resp:
                assert resp.status == 200
        # Plain HTTP on the TLS port gets nothing served.
        plain = running.base(SLASHED).replace("https://", "http://") + "/v1/chat/completions"
        assert await _plain_status(plain) is None


async def _plain_status(url: str) -> int | None:
    """The status a plain-HTTP request gets, or None when the connection is cut."""
    try:
        async with aiohttp.ClientSession() as http, http.post(url, data=b"{}") as resp:
            return resp.status
    except (aiohttp.ClientError, ConnectionError):
        return None
