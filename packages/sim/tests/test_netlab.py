"""The network lab: namespaces on a bridge, partitions, random loss, the delay relay, clean-up.

Every test uses the root conftest's ``netlab`` fixture (skipped where namespaces cannot be
made, a failure under CI).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from haru_sim import netlab

ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
"""


def start_echo(host: netlab.Host, port: int = 7000) -> subprocess.Popen[str]:
    process = host.popen(
        [sys.executable, "-c", ECHO, host.address, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


async def echo(address: tuple[str, int], payload: bytes, *, timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout_s)
    try:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def dropped(host: netlab.Host) -> int:
    return host.dropped()


def test_unavailable_reason_is_none_where_the_fixture_ran(netlab: netlab.Lab) -> None:
    assert netlab.hosts == {}
    from haru_sim.netlab import unavailable_reason

    assert unavailable_reason() is None


async def test_hosts_reach_each_other_and_the_test_process(netlab: netlab.Lab) -> None:
    a, b = netlab.host("a"), netlab.host("b")
    assert a.address != b.address != netlab.gateway
    start_echo(a)
    assert await echo((a.address, 7000), b"from the test") == b"from the test"
    other = b.run(
        [
            sys.executable,
            "-c",
            f"""
import shutil
import socket
s = socket.create_connection(("{a.address}", 7000), timeout=5)
s.sendall(b"from b"); s.shutdown(socket.SHUT_WR); print(s.recv(100).decode())
""",
        ]
    )
    assert other.stdout.strip() == "from b"


async def test_a_partition_drops_packets_until_healed(netlab: netlab.Lab) -> None:
    a = netlab.host("a")
    start_echo(a)
    a.partition()
    with pytest.raises(TimeoutError):
        await echo((a.address, 7000), b"lost", timeout_s=0.5)
    assert dropped(a) > 0
    a.heal()
    assert dropped(a) == 0
    assert await echo((a.address, 7000), b"back") == b"back"


async def test_a_partition_from_one_peer_leaves_the_others(netlab: netlab.Lab) -> None:
    a, b = netlab.host("a"), netlab.host("b")
    start_echo(a)
    with a.partitioned(peer=b):
        assert await echo((a.address, 7000), b"still") == b"still"
        probe = b.run(
            [
                sys.executable,
                "-c",
                f"import socket; socket.create_connection(('{a.address}', 7000), timeout=0.5)",
            ],
            check=False,
        )
        assert probe.returncode != 0
        assert "timed out" in probe.stderr
    assert await echo((a.address, 7000), b"healed") == b"healed"


def test_random_loss_drops_some_packets_not_all(netlab: netlab.Lab) -> None:
    a = netlab.host("a")
    a.lose(0.5)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for _ in range(200):
            udp.sendto(b"x", (a.address, 9))
    deadline = time.monotonic() + 5
    while dropped(a) == 0 and time.monotonic() < deadline:
        pass
    assert 0 < dropped(a) < 200
    with pytest.raises(ValueError, match="between 0 and 1"):
        a.lose(1.5)


async def test_the_delay_relay_holds_each_direction_and_keeps_order(netlab: netlab.Lab) -> None:
    a = netlab.host("a")
    start_echo(a)
    payload = bytes(range(256)) * 1000
    async with netlab_relay(netlab, a, delay_s=0.1) as relay:
        started = time.monotonic()
        assert await echo(relay.address, payload) == payload
        assert time.monotonic() - started >= 0.2  # two one-way delays, a lower bound only
        relay.delay_s = 0.0
        assert await echo(relay.address, b"fast") == b"fast"
        assert relay.connections == 2


def ip(*args: str) -> str:
    command = shutil.which("ip")
    assert command is not None
    return subprocess.run([command, *args], capture_output=True, text=True, check=True).stdout


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def netlab_relay(lab: netlab.Lab, host: netlab.Host, *, delay_s: float) -> netlab.DelayRelay:
    return netlab.DelayRelay((lab.gateway, 0), (host.address, 7000), delay_s=delay_s)


def test_close_removes_namespaces_bridge_rules_and_processes() -> None:
    reason = netlab.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    lab = netlab.Lab()
    host = lab.host("a")
    host.partition()
    started = host.popen(["sleep", "600"])
    # A grandchild the lab never saw is still inside the namespace, so it is killed too.
    host.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 &"])
    orphans = host.pids()
    assert len(orphans) == 2
    lab.close()
    assert started.poll() is not None
    for pid in orphans:
        assert gone(pid)
    assert host.netns not in ip("netns", "list")
    assert lab.bridge not in ip("-o", "link")
    lab.close()
