"""The ``haru-sim-vllm`` process: port line, serving, control listener, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from haru_sim import parse_listen_line

CONSOLE_SCRIPT = Path(sys.executable).parent / "haru-sim-vllm"


class SimProcess:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def read_until_listening(self) -> tuple[str, int]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(20):
            while True:
                raw = await self.proc.stdout.readline()
                assert raw, f"exited before listening; stdout so far: {self.lines}"
                line = raw.decode()
                self.lines.append(line)
                parsed = parse_listen_line(line)
                if parsed is not None:
                    return parsed


async def spawn(*argv: str) -> SimProcess:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    return SimProcess(proc)


@pytest.fixture
async def processes() -> AsyncIterator[list[SimProcess]]:
    spawned: list[SimProcess] = []
    yield spawned
    for sim in spawned:
        if sim.proc.returncode is None:
            os.killpg(sim.proc.pid, signal.SIGKILL)
        await sim.proc.communicate()


async def test_module_prints_its_port_serves_and_exits_on_sigterm(
    processes: list[SimProcess], http: aiohttp.ClientSession
) -> None:
    sim = await spawn(
        sys.executable,
        "-m",
        "haru_sim.vllm",
        "--port",
        "0",
        "--served-model-name",
        "chat-a",
        "chat-b",
        "--token-latency-ms",
        "0",
        "--sleep-latency-ms",
        "1",
    )
    processes.append(sim)
    host, port = await sim.read_until_listening()
    assert host == "127.0.0.1"
    assert port > 0
    assert sim.lines[-1] == f"haru-sim-vllm listening on 127.0.0.1:{port}\n"
    url = f"http://{host}:{port}"

    async with http.get(f"{url}/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["chat-a", "chat-b"]
    body = {"model": "chat-b", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
    assert data["model"] == "chat-a"
    assert data["choices"][0]["message"]["content"] == "ping"
    async with http.post(f"{url}/sleep?level=1") as resp:
        assert await resp.json() == {"status": "sleeping", "level": 1}
    async with http.get(f"{url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}

    sim.proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(20):
        _, stderr = await sim.proc.communicate()
    assert sim.proc.returncode == 0, stderr.decode()


async def test_console_script_with_control_port_and_flags(
    processes: list[SimProcess], http: aiohttp.ClientSession
) -> None:
    sim = await spawn(
        str(CONSOLE_SCRIPT),
        "--port",
        "0",
        "--control-port",
        "0",
        "--start-asleep",
        "--legacy-empty-bodies",
    )
    processes.append(sim)
    host, port = await sim.read_until_listening()
    [control_line] = [line for line in sim.lines if " control on " in line]
    control_url = "http://" + control_line.strip().rsplit(" ", 1)[1]
    url = f"http://{host}:{port}"

    async with http.get(f"{url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}
    async with http.post(f"{url}/wake_up") as resp:
        assert resp.status == 200
        assert await resp.read() == b""

    # Another process drives faults; refuse is cleared through the control listener.
    async with http.post(f"{control_url}/_sim/faults", json={"refuse": True}) as resp:
        assert resp.status == 200
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh.get(f"{url}/health")
        async with http.post(f"{control_url}/_sim/faults", json={"refuse": False}) as resp:
            assert resp.status == 200
        async with fresh.get(f"{url}/health") as resp:
            assert resp.status == 200

    sim.proc.send_signal(signal.SIGINT)
    async with asyncio.timeout(20):
        await sim.proc.communicate()
    assert sim.proc.returncode == 0


async def test_fidelity_flags(processes: list[SimProcess], http: aiohttp.ClientSession) -> None:
    sim = await spawn(
        str(CONSOLE_SCRIPT),
        "--port",
        "0",
        "--vllm-version",
        "0.31.0",
        "--api-key",
        "k1",
        "--disable-log-stats",
        "--max-num-seqs",
        "3",
        "--reasoning-field",
        "reasoning_content",
        "--reasoning-tokens",
        "5",
    )
    processes.append(sim)
    host, port = await sim.read_until_listening()
    url = f"http://{host}:{port}"
    async with http.get(f"{url}/version") as resp:
        assert await resp.json() == {"version": "0.31.0"}
    async with http.get(f"{url}/v1/models") as resp:
        assert resp.status == 401
    async with http.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2},
        headers={"Authorization": "Bearer k1"},
    ) as resp:
        message = (await resp.json())["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == (None, "a b")
    async with http.get(f"{url}/metrics") as resp:
        assert "vllm:" not in await resp.text()
    async with http.get(f"{url}/_sim/state") as resp:
        assert (await resp.json())["max_num_seqs"] == 3
    async with http.post(f"{url}/sleep?level=1&mode=wait") as resp:
        assert (resp.status, await resp.read()) == (200, b"")
    sim.proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(20):
        await sim.proc.communicate()
    assert sim.proc.returncode == 0


async def test_dev_mode_off_and_bad_arguments(
    processes: list[SimProcess], http: aiohttp.ClientSession
) -> None:
    sim = await spawn(sys.executable, "-m", "haru_sim.vllm", "--port", "0", "--no-dev-mode")
    processes.append(sim)
    host, port = await sim.read_until_listening()
    async with http.post(f"http://{host}:{port}/sleep") as resp:
        assert resp.status == 404

    bad = await spawn(sys.executable, "-m", "haru_sim.vllm", "--served-model-name", "a", "a")
    processes.append(bad)
    async with asyncio.timeout(20):
        _, stderr = await bad.proc.communicate()
    assert bad.proc.returncode == 2
    assert b"unique" in stderr


async def test_a_taken_port_is_a_clean_error(processes: list[SimProcess]) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        sim = await spawn(sys.executable, "-m", "haru_sim.vllm", "--port", str(port))
        processes.append(sim)
        async with asyncio.timeout(20):
            _, stderr = await sim.proc.communicate()
    finally:
        server.close()
        await server.wait_closed()
    assert sim.proc.returncode == 1
    assert b"cannot listen" in stderr


def test_parse_listen_line() -> None:
    assert parse_listen_line("haru-sim-vllm listening on 127.0.0.1:8000\n") == ("127.0.0.1", 8000)
    assert parse_listen_line("haru-sim-vllm listening on [::1]:9\n") == ("::1", 9)
    assert parse_listen_line("haru-sim-vllm control on 127.0.0.1:8000") is None
    assert parse_listen_line("something else") is None
