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


async def test_serve_takes_the_vllm_command_line(
    processes: list[SimProcess], http: aiohttp.ClientSession
) -> None:
    argv = [
        "serve",
        "example-org/chat-small",
        "--served-model-name",
        "chat-small",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--enable-sleep-mode",
        "--gpu-memory-utilization",
        "0.45",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "64",
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    proc = await asyncio.create_subprocess_exec(
        str(CONSOLE_SCRIPT),
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    sim = SimProcess(proc)
    processes.append(sim)
    host, port = await sim.read_until_listening()
    url = f"http://{host}:{port}"
    async with http.get(f"{url}/v1/models") as resp:
        [card] = (await resp.json())["data"]
    assert (card["id"], card["root"], card["max_model_len"]) == (
        "chat-small",
        "example-org/chat-small",
        64,
    )
    async with http.post(f"{url}/sleep?level=1") as resp:
        assert await resp.json() == {"status": "sleeping", "level": 1}

    # Without VLLM_SERVER_DEV_MODE the admin routes are not mounted, as in vLLM.
    env.pop("VLLM_SERVER_DEV_MODE")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_sim.vllm",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    plain = SimProcess(proc)
    processes.append(plain)
    host, port = await plain.read_until_listening()
    async with http.post(f"http://{host}:{port}/sleep") as resp:
        assert resp.status == 404


@pytest.mark.parametrize(
    ("argv", "env", "code", "message"),
    [
        (["m", "--no-such-flag"], {}, 2, "unrecognized arguments: --no-such-flag"),
        (["m", "--swap-spaces", "4"], {}, 2, "unrecognized arguments"),
        (["m", "--model", "n"], {}, 2, "positional argument"),
        (["m", "--gpu-memory-utilization", "1.5"], {}, 1, "gpu_memory_utilization"),
        (["m", "--gpu-memory-utilization", "0"], {}, 1, "gpu_memory_utilization"),
        (["m"], {"VLLM_SERVER_DEV_MODE": "true"}, 1, "invalid literal for int()"),
        (["m", "--served-model-name", "a", "a"], {}, 2, "unique"),
    ],
)
def test_serve_refuses_what_vllm_refuses(
    argv: list[str],
    env: dict[str, str],
    code: int,
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from haru_sim._vllm_cli import main

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", *argv]) == code
    assert message in capsys.readouterr().err


def test_serve_defaults_follow_vllm() -> None:
    from haru_sim._vllm_serve import DEFAULT_MODEL, serve_config

    config, host, port = serve_config([], environ={})
    assert (config.served_model_names, config.model, host, port) == (
        (DEFAULT_MODEL,),
        DEFAULT_MODEL,
        "0.0.0.0",
        8000,
    )
    assert config.dev_mode is False
    config, _, _ = serve_config(
        ["m", "--reasoning-parser", "qwen3"], environ={"VLLM_SERVER_DEV_MODE": "1"}
    )
    assert (config.dev_mode, config.reasoning_field) == (True, "reasoning")
