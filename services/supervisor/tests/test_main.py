"""``haru-supervisor`` as a real process: binding, auth, a shutdown that leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

Command = Callable[..., tuple[str, ...]]

_LISTENING = re.compile(r"listening on https?://([0-9.]+):([0-9]+)")


def _executable() -> str:
    found = shutil.which("haru-supervisor", path=str(Path(sys.executable).parent))
    assert found is not None, "the haru-supervisor console script is not installed"
    return found


@dataclass
class Supervisor:
    process: asyncio.subprocess.Process
    host: str = ""
    port: int = 0
    lines: list[str] = field(default_factory=list)
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    listening: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    async def collect(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match:
                self.host, self.port = match.group(1), int(match.group(2))
                self.listening.set()


@pytest.fixture
async def launch() -> AsyncIterator[Callable[..., Any]]:
    """Start ``haru-supervisor`` with an environment; killed (group and all) if a test fails."""
    started: list[Supervisor] = []

    async def start(env: dict[str, str], *, wait: bool = True) -> Supervisor:
        process = await asyncio.create_subprocess_exec(
            _executable(),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        supervisor = Supervisor(process)
        assert process.stdout is not None
        assert process.stderr is not None
        supervisor.readers = [
            asyncio.create_task(supervisor.collect(process.stdout)),
            asyncio.create_task(supervisor.collect(process.stderr)),
        ]
        started.append(supervisor)
        if wait:
            try:
                await asyncio.wait_for(supervisor.listening.wait(), 15)
            except TimeoutError:
                raise AssertionError("no listening line:\n" + supervisor.log) from None
        return supervisor

    yield start
    for supervisor in started:
        if supervisor.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                supervisor.process.kill()
            await supervisor.process.wait()
        await asyncio.gather(*supervisor.readers)


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    env.update({"PORT": "0", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


async def test_shutdown_stops_every_trainer_before_exiting(
    launch: Any,
    tmp_path: Path,
    sim_trainer: Command,
    fake_trainer: Command,
    wait_for: Any,
    alive: Callable[[int], bool],
) -> None:
    config = {
        "slots": [
            {
                "kind": "training",
                "gpuIndex": 0,
                "command": list(sim_trainer("--checkpoint-every", "1000")),
                "checkpointDir": str(tmp_path / "polite"),
            },
            {
                "kind": "training",
                "gpuIndex": 1,
                "command": list(fake_trainer("--ignore-term", "--grandchild")),
                "checkpointDir": str(tmp_path / "stubborn"),
            },
        ]
    }
    config_path = tmp_path / "supervisor.json"
    config_path.write_text(json.dumps(config))
    supervisor = await launch(
        _base_env(
            HARU_SUPERVISOR_CONFIG=str(config_path),
            HARU_SUPERVISOR_SHUTDOWN_GRACE_MS="1500",
        )
    )
    assert supervisor.host == "127.0.0.1"
    assert "HARU_SUPERVISOR_TOKEN is not set" in supervisor.log

    async with aiohttp.ClientSession(supervisor.url) as http:
        async with http.post("/v1/training/start") as response:
            assert response.status == 200

        async def training() -> list[dict[str, Any]]:
            async with http.get("/v1/training/status") as response:
                slots: list[dict[str, Any]] = (await response.json())["slots"]
                return slots

        async def all_running() -> bool:
            slots = await training()
            return [len(s["pids"]) for s in slots] == [1, 2] and (
                tmp_path / "stubborn" / "ready.json"
            ).exists()

        await wait_for(all_running, timeout=10)
        pids = [pid for slot in await training() for pid in slot["pids"]]

        supervisor.process.send_signal(signal.SIGTERM)

        # During the grace the API still answers: starts are refused, the stubborn run stops.
        async def stopping() -> bool:
            slots = await training()
            return bool(slots[1]["state"] == "stopping")

        await wait_for(stopping, timeout=5)
        async with http.post("/v1/training/start") as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "shutting_down"

    assert await asyncio.wait_for(supervisor.process.wait(), 20) == 0
    assert not [pid for pid in pids if alive(pid)], supervisor.log
    assert "SIGKILL to group" in supervisor.log
    assert "haru-supervisor stopped" in supervisor.log
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as http, http.get(supervisor.url + "/healthz"):
            pass


async def test_a_second_signal_kills_the_trainers_at_once(
    launch: Any, tmp_path: Path, fake_trainer: Command, wait_for: Any, alive: Callable[[int], bool]
) -> None:
    config = {
        "slots": [
            {
                "kind": "training",
                "gpuIndex": 0,
                "command": list(fake_trainer("--ignore-term")),
                "checkpointDir": str(tmp_path),
            }
        ]
    }
    supervisor = await launch(
        _base_env(
            HARU_SUPERVISOR_CONFIG=json.dumps(config),
            HARU_SUPERVISOR_SHUTDOWN_GRACE_MS="600000",
        )
    )
    async with aiohttp.ClientSession(supervisor.url) as http:
        async with http.post("/v1/training/start") as response:
            assert response.status == 200
        await wait_for(lambda: (tmp_path / "ready.json").exists(), timeout=10)
    (pid,) = json.loads((tmp_path / "ready.json").read_text())
    supervisor.process.send_signal(signal.SIGINT)
    await wait_for(lambda: "SIGTERM to group" in supervisor.log)
    assert alive(pid)  # the ten-minute grace is running
    supervisor.process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 0
    assert not alive(pid)
    assert "killing the trainers now" in supervisor.log


async def test_with_a_token_it_listens_everywhere_and_checks_it(
    launch: Any, unused_port: Callable[[], int]
) -> None:
    token = "proc-test-token-19ab"
    port = unused_port()
    config = {
        "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": port}]}]
    }
    supervisor = await launch(
        _base_env(HARU_SUPERVISOR_CONFIG=json.dumps(config), HARU_SUPERVISOR_TOKEN=f" {token} ")
    )
    assert supervisor.host == "0.0.0.0"
    async with aiohttp.ClientSession(supervisor.url) as http:
        async with http.get("/healthz") as response:
            assert response.status == 200
        async with http.get("/v1/status") as response:
            assert response.status == 401
        async with http.get("/v1/status", headers={"Authorization": f"Bearer {token}"}) as response:
            assert response.status == 200
            body = await response.json()
    # Nothing listens on the model's port: its sleep state proves nothing, and the refused
    # connection says the server is down.
    model = {"name": "m", "port": port, "sleeping": None, "vllmVersion": None, "down": True}
    assert body == {
        "slots": [{"gpuIndex": 0, "kind": "inference", "models": [model]}],
        "ready": False,
    }
    supervisor.process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 0
    assert token not in supervisor.log


async def test_it_serves_tls_requiring_client_certificates(launch: Any, pki: Any) -> None:
    token = "proc-test-token-tls-7"
    cert, key = pki.leaf("supervisor")
    client = pki.leaf("server-client")
    config = (
        '{"slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": 9}]}]}'
    )
    env = _base_env(
        HARU_SUPERVISOR_CONFIG=config,
        HARU_SUPERVISOR_TOKEN=token,
        HARU_TLS_CERT_FILE=str(cert),
        HARU_TLS_KEY_FILE=str(key),
        HARU_TLS_CLIENT_CA_FILE=str(pki.ca_file),
    )
    supervisor = await launch(env)
    assert "listening on https://0.0.0.0:" in supervisor.log
    assert "client certificates required" in supervisor.log
    assert "plain HTTP" not in supervisor.log
    url = f"https://127.0.0.1:{supervisor.port}/v1/status"
    headers = {"Authorization": f"Bearer {token}"}
    trusted = ssl.create_default_context(cafile=pki.ca_file)
    trusted.load_cert_chain(*client)
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers, ssl=trusted) as response:
            assert response.status == 200
        no_cert = ssl.create_default_context(cafile=pki.ca_file)
        with pytest.raises(aiohttp.ClientError):
            async with http.get(url, headers=headers, ssl=no_cert) as response:
                await response.read()
        with pytest.raises(aiohttp.ClientError):
            async with http.get(url.replace("https:", "http:"), headers=headers) as response:
                await response.read()
    supervisor.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 0


async def test_an_invalid_config_exits_with_a_usage_error(launch: Any) -> None:
    supervisor = await launch(_base_env(HARU_SUPERVISOR_CONFIG='{"slots": []}'), wait=False)
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 2
    await asyncio.gather(*supervisor.readers)
    assert "HARU_SUPERVISOR_CONFIG: inline JSON is invalid" in supervisor.log


async def test_an_invalid_environment_is_one_json_line_in_json_mode(launch: Any) -> None:
    supervisor = await launch(
        _base_env(HARU_SUPERVISOR_CONFIG='{"slots": []}', HARU_LOG_FORMAT="json"), wait=False
    )
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 2
    await asyncio.gather(*supervisor.readers)
    assert len(supervisor.lines) == 1, supervisor.log
    record = json.loads(supervisor.lines[0])
    assert record["level"] == "CRITICAL"
    assert record["logger"] == "haru_supervisor"
    assert "HARU_SUPERVISOR_CONFIG: inline JSON is invalid" in record["message"]


async def test_an_open_network_bind_without_the_opt_in_is_refused_at_boot(launch: Any) -> None:
    config = (
        '{"slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": 9}]}]}'
    )
    supervisor = await launch(
        _base_env(HARU_SUPERVISOR_CONFIG=config, HARU_HOST="0.0.0.0"), wait=False
    )
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 2
    await asyncio.gather(*supervisor.readers)
    assert "HARU_HOST=0.0.0.0 is not a loopback address" in supervisor.log
    assert "HARU_ALLOW_OPEN_BIND=1" in supervisor.log


async def test_an_opted_in_open_bind_listens_everywhere_and_warns(launch: Any) -> None:
    config = (
        '{"slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": 9}]}]}'
    )
    env = _base_env(HARU_SUPERVISOR_CONFIG=config, HARU_HOST="0.0.0.0", HARU_ALLOW_OPEN_BIND="1")
    supervisor = await launch(env)
    assert supervisor.host == "0.0.0.0"
    assert "API is OPEN to anyone on the network" in supervisor.log
    headers = {"Host": "alpha:8701"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(supervisor.url + "/healthz", headers=headers) as r,
    ):
        assert r.status == 200
    supervisor.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 0


async def test_version_and_help_answer_without_any_configuration() -> None:
    from importlib import metadata

    async def run(*args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            _executable(),
            *args,
            env={"PATH": "/usr/bin:/bin"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    code, out, _ = await run("--version")
    assert (code, out) == (0, f"haru-supervisor {metadata.version('haru-supervisor')}\n")
    code, out, _ = await run("--help")
    assert code == 0
    assert "--version" in out
    code, _, err = await run("--bogus")
    assert code == 2
    assert "usage: haru-supervisor" in err


HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
FORGED = "2026-01-01 00:00:00,000 WARNING haru_supervisor: forged"


async def _raw_http(port: int, data: bytes, *, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


def _get(path: bytes, *headers: bytes) -> bytes:
    lines = [b"GET " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _closed_by_server(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(10):
            await reader.read()


async def test_hostile_clients_at_the_supervisor_edge(
    launch: Any, unused_port: Callable[[], int]
) -> None:
    token = "edge-supervisor-token-0123"
    config = {
        "slots": [
            {"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": unused_port()}]}
        ]
    }
    supervisor = await launch(
        _base_env(
            HARU_SUPERVISOR_CONFIG=json.dumps(config),
            HARU_SUPERVISOR_TOKEN=token,
            # The per-peer bound above the cap: the cap's own eviction keeps room for others.
            HARU_HTTP_MAX_CONNECTIONS="32",
            HARU_HTTP_MAX_CONNECTIONS_PER_PEER="1000",
            HARU_HTTP_HEADER_TIMEOUT_MS="60000",
        )
    )
    port = supervisor.port
    for bad in (b"\xff\xfe" + token.encode(), b"\x80" * 20):
        answer = await _raw_http(port, _get(b"/v1/status", b"Authorization: Bearer " + bad))
        assert answer.startswith(b"HTTP/1.1 401 "), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "unauthorized"

    path = b"/nowhere%0d%0a" + FORGED.replace(" ", "%20").encode() + b"%1b[31m"
    assert (await _raw_http(port, _get(path))).startswith(b"HTTP/1.1 404 ")

    flood = []
    for _ in range(300):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)
        )
        writer.write(HALF_HEAD)
        flood.append((reader, writer))
    await asyncio.gather(*(_closed_by_server(reader) for reader, _ in flood[:-32]))
    for probe in (b"/healthz", b"/readyz"):
        answer = await _raw_http(port, _get(probe), source="127.0.0.1")
        # /readyz may say "not ready" (no vLLM here): it answers, in the envelope or not.
        assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")), answer
        assert probe != b"/healthz" or answer.startswith(b"HTTP/1.1 200 ")
    for _, writer in flood:
        writer.close()

    supervisor.process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(supervisor.process.wait(), 15) == 0
    await asyncio.gather(*supervisor.readers)
    lines = supervisor.lines
    assert "Traceback" not in supervisor.log
    assert not [line for line in lines if line.startswith(FORGED)]
    assert [line for line in lines if "/nowhere\\r\\n" + FORGED + "\\x1b[31m 404" in line]
    assert len([line for line in lines if "/v1/status 401" in line]) == 2
    assert "closing an idle or half-sent connection of 127.0.0.2" in supervisor.log
