"""``HARU_WORKERS``: real ``haru serve`` processes sharing one port, stopped as one."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

_LISTENING = re.compile(r"haru-server worker (\d+) serves (http://\S+)")

pytestmark = pytest.mark.skipif(
    not hasattr(os, "setpgrp") or not Path("/proc").is_dir(), reason="Linux processes"
)


@dataclass
class Workers:
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    listening: dict[int, str] = field(default_factory=dict)
    """Worker pid -> the URL it listens on."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


async def _drain(workers: Workers) -> None:
    assert workers.process.stderr is not None
    async for raw in workers.process.stderr:
        line = raw.decode(errors="replace").rstrip()
        workers.lines.append(line)
        match = _LISTENING.search(line)
        if match:
            workers.listening[int(match.group(1))] = match.group(2)
        workers.changed.set()


@asynccontextmanager
async def haru_workers(count: int, tmp_path: Path, **extra: str) -> AsyncIterator[Workers]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HARU_") and k not in ("DATABASE_URL", "PORT")
    }
    env.update(
        HARU_WORKERS=str(count),
        PORT="0",
        DATABASE_URL=f"sqlite:///{tmp_path / 'haru.db'}",
        HARU_CREATE_DATABASE="1",  # a new store, created by the parent's migration
        HARU_RECONCILE_INTERVAL_MS="1000",
    )
    env.update(extra)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_server",
        "serve",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    workers = Workers(process)
    reader = asyncio.create_task(_drain(workers))
    try:
        async with asyncio.timeout(60):
            while len(workers.listening) < count:
                assert process.returncode is None, workers.log
                workers.changed.clear()
                await workers.changed.wait()
        yield workers
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        await reader


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening_inodes(port: int) -> set[str]:
    """Inodes of the IPv4 sockets listening on ``port`` (``/proc/net/tcp``, state 0A)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
            inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:[") : -1])
    return found


async def gone(pids: set[int]) -> bool:
    async with asyncio.timeout(30):
        while any(alive(pid) for pid in pids):
            await asyncio.sleep(0.05)
    return True


async def test_workers_share_one_port_and_stop_together(tmp_path: Path) -> None:
    async with haru_workers(2, tmp_path) as workers:
        pids = set(workers.listening)
        assert len(pids) == 2
        assert workers.process.pid not in pids
        urls = set(workers.listening.values())
        assert len(urls) == 1, urls  # PORT=0 resolved once, for both
        (url,) = urls
        # Each worker holds its own listening socket on the port; the parent holds none.
        listeners = listening_inodes(int(url.rsplit(":", 1)[1]))
        assert len(listeners) == 2
        assert all(socket_inodes(pid) & listeners for pid in pids)
        assert not socket_inodes(workers.process.pid) & listeners
        async with aiohttp.ClientSession() as http:
            for _ in range(20):
                # A new connection each time: the kernel spreads them over the workers.
                async with http.get(f"{url}/healthz", headers={"Connection": "close"}) as resp:
                    assert resp.status == 200
        workers.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await workers.process.wait()
    assert code == 0, workers.log
    assert await gone(pids)
    assert "2 workers on" in workers.log
    assert "Traceback" not in workers.log


async def test_a_dead_worker_stops_the_others_and_fails_the_parent(tmp_path: Path) -> None:
    async with haru_workers(2, tmp_path) as workers:
        pids = set(workers.listening)
        victim, survivor = sorted(pids)
        os.kill(victim, signal.SIGKILL)
        async with asyncio.timeout(30):
            code = await workers.process.wait()
    assert code == 1, workers.log
    assert await gone({survivor})
    assert f"(pid {victim}) exited with code -9; stopping the others" in workers.log


async def test_workers_must_be_a_positive_number(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    env.update(
        HARU_WORKERS="0",
        PORT="0",
        DATABASE_URL=f"sqlite:///{tmp_path / 'haru.db'}",
        HARU_CREATE_DATABASE="1",  # only HARU_WORKERS is wrong
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_server",
        "serve",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, stderr = await process.communicate()
    assert process.returncode == 2
    assert b"HARU_WORKERS" in stderr


# ---- one /metrics for every worker ---------------------------------------------------------


async def seed_example(tmp_path: Path) -> None:
    """The bundled example fleet in the workers' store, its supervisors never answering."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'haru.db'}"
    printed = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_server",
        "seed",
        "--print-example",
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    layout, _ = await printed.communicate()
    path = tmp_path / "layout.json"
    path.write_bytes(re.sub(rb"127\.0\.0\.1:870\d", b"127.0.0.1:9", layout))
    seeding = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_server",
        "seed",
        str(path),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await seeding.communicate()
    assert seeding.returncode == 0, stderr


Samples = list[tuple[str, dict[str, str], float]]


def metrics_folders(tmp_path: Path) -> list[Path]:
    return list(tmp_path.glob("haru-metrics-*"))


async def scrape(http: aiohttp.ClientSession, url: str) -> Samples:
    # A new connection: whichever worker the kernel picks answers for all of them.
    async with http.get(f"{url}/metrics", headers={"Connection": "close"}) as resp:
        assert resp.status == 200
        text = await resp.text()
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def picked(samples: Samples, name: str, **labels: str) -> Samples:
    return [s for s in samples if s[0] == name and labels.items() <= s[1].items()]


def answered(samples: Samples) -> float:
    return sum(v for _, _, v in picked(samples, "haru_proxy_requests_total"))


async def list_models(http: aiohttp.ClientSession, url: str, count: int) -> None:
    for _ in range(count):
        async with http.get(
            f"{url}/v1/models", headers={"X-Haru-Fleet": "example", "Connection": "close"}
        ) as resp:
            await resp.read()


async def test_one_scrape_counts_the_requests_of_every_worker(tmp_path: Path) -> None:
    await seed_example(tmp_path)
    # TMPDIR: where the parent creates the workers' metrics folder (fresh per start).
    options = {"TMPDIR": str(tmp_path)}
    async with haru_workers(2, tmp_path, **options) as workers, aiohttp.ClientSession() as http:
        (url,) = set(workers.listening.values())
        (folder,) = metrics_folders(tmp_path)
        await list_models(http, url, 40)
        # Each worker's reconcile loop ticks the fleet (its supervisors never answer).
        async with asyncio.timeout(60):
            while not picked(await scrape(http, url), "haru_reconcile_partitioned"):
                await asyncio.sleep(0.1)
        # Each worker answered some of them (its own counter file says how many) ...
        own = {
            pid: sum(
                s.value
                for m in MultiProcessCollector.merge(  # type: ignore[no-untyped-call]
                    [str(folder / f"counter_{pid}.db")]
                )
                if m.name == "haru_proxy_requests"
                for s in m.samples
            )
            for pid in workers.listening
        }
        assert sum(own.values()) == 40, own
        assert all(own.values()), own
        # ... and every scrape, whichever worker answers it, reports them all.
        scrapes = [await scrape(http, url) for _ in range(6)]
        assert [answered(samples) for samples in scrapes] == [40] * 6
        samples = scrapes[-1]
        # The gauges merge as documented: one series each, whatever the worker count.
        assert [v for *_, v in picked(samples, "haru_build_info")] == [1]
        assert [v for *_, v in picked(samples, "haru_proxy_held_requests_in_flight")] == [0]
        active = picked(samples, "haru_fleet_active_domain", fleet="example")
        assert [(labels["domain"], v) for _, labels, v in active] == [("alpha", 1)]
        assert len(picked(samples, "haru_fleet_route_revision", fleet="example")) == 1
        assert [v for *_, v in picked(samples, "haru_reconcile_partitioned")] == [1]
        alpha = picked(samples, "haru_domain_state", fleet="example", domain="alpha")
        assert len(alpha) == len({labels["state"] for _, labels, _ in alpha}) > 1
        (lease,) = picked(samples, "haru_route_lease_age_seconds", fleet="example")
        assert 0 <= lease[2] < 60
        (frozen,) = picked(samples, "haru_gc_frozen_objects")
        assert frozen[2] > 0
        # prometheus_client's process and runtime collectors read one process: not exported.
        assert not [s for s in samples if s[0].startswith(("process_", "python_"))]
        workers.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await workers.process.wait() == 0, workers.log
    assert not metrics_folders(tmp_path)  # removed with the set
    # A new start counts from zero: nothing of the previous set is merged in.
    async with haru_workers(2, tmp_path, **options) as workers, aiohttp.ClientSession() as http:
        (url,) = set(workers.listening.values())
        assert answered(await scrape(http, url)) == 0
        await list_models(http, url, 3)
        assert answered(await scrape(http, url)) == 3
    assert "Traceback" not in workers.log
