"""``HARU_WORKERS``: real ``haru serve`` processes sharing one port, stopped as one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import ProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

_LISTENING = re.compile(r"haru-server worker (\d+) serves (http://\S+)")

pytestmark = pytest.mark.skipif(
    not hasattr(os, "setpgrp") or not Path("/proc").is_dir(), reason="Linux processes"
)

HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""
HaruWorkers = Callable[..., AbstractAsyncContextManager[Any]]


def listening(log: list[str]) -> dict[int, str]:
    """Worker pid -> the URL it listens on, as the set's log says so far."""
    return {
        int(match.group(1)): match.group(2)
        for match in map(_LISTENING.search, log)
        if match is not None
    }


@pytest.fixture
def haru_workers(haru_serve: HaruServe, tmp_path: Path) -> HaruWorkers:
    """``async with haru_workers(count, **env) as workers``: once ``count`` workers listen."""

    @asynccontextmanager
    async def start(count: int, **extra: str) -> AsyncIterator[Any]:
        env = {
            "HARU_WORKERS": str(count),
            "PORT": "0",
            "DATABASE_URL": f"sqlite:///{tmp_path / 'haru.db'}",
            "HARU_CREATE_DATABASE": "1",  # a new store, created by the parent's migration
            "HARU_RECONCILE_INTERVAL_MS": "1000",
            **extra,
        }
        async with haru_serve(env, listening=False) as workers:
            await workers.until(
                lambda lines: len(listening(lines)) >= count or None,
                what=f"{count} workers listening",
                timeout_s=60,
            )
            yield workers

    return start


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


async def test_workers_share_one_port_and_stop_together(haru_workers: HaruWorkers) -> None:
    async with haru_workers(2) as workers:
        pids = set(listening(workers.lines))
        assert len(pids) == 2
        assert workers.process.pid not in pids
        urls = set(listening(workers.lines).values())
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
        code = await workers.exited(timeout_s=30)
    assert code == 0, workers.log
    assert await gone(pids)
    assert "2 workers on" in workers.log
    assert "Traceback" not in workers.log


async def test_a_dead_worker_stops_the_others_and_fails_the_parent(
    haru_workers: HaruWorkers,
) -> None:
    async with haru_workers(2) as workers:
        pids = set(listening(workers.lines))
        victim, survivor = sorted(pids)
        os.kill(victim, signal.SIGKILL)
        code = await workers.exited(timeout_s=30)
    assert code == 1, workers.log
    assert await gone({survivor})
    assert f"(pid {victim}) exited with code -9; stopping the others" in workers.log


async def test_workers_must_be_a_positive_number(haru_serve: HaruServe, tmp_path: Path) -> None:
    env = {
        "HARU_WORKERS": "0",
        "PORT": "0",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'haru.db'}",
        "HARU_CREATE_DATABASE": "1",  # only HARU_WORKERS is wrong
    }
    async with haru_serve(env, listening=False) as server:
        code = await server.exited()
    assert code == 2, server.log
    assert "HARU_WORKERS" in server.log


# ---- one /metrics for every worker ---------------------------------------------------------


async def seed_example(tmp_path: Path, serving_port: int | None = None) -> None:
    """The bundled example fleet in the workers' store, its supervisors never answering.

    ``serving_port``: where every model's server is said to listen (else the example's ports).
    """
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
    layout = re.sub(rb"127\.0\.0\.1:870\d", b"127.0.0.1:9", layout)
    if serving_port is not None:
        layout = re.sub(rb"127\.0\.0\.1:8\d\d\d", b"127.0.0.1:%d" % serving_port, layout)
    path.write_bytes(layout)
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


async def scrape_families(http: aiohttp.ClientSession, url: str) -> list[Metric]:
    # A new connection: whichever worker the kernel picks answers for all of them.
    async with http.get(f"{url}/metrics", headers={"Connection": "close"}) as resp:
        assert resp.status == 200
        return list(text_string_to_metric_families(await resp.text()))


async def scrape(http: aiohttp.ClientSession, url: str) -> Samples:
    return [
        (s.name, s.labels, s.value)
        for family in await scrape_families(http, url)
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


async def test_one_scrape_counts_the_requests_of_every_worker(
    haru_workers: HaruWorkers, tmp_path: Path
) -> None:
    await seed_example(tmp_path)
    # TMPDIR: where the parent creates the workers' metrics folder (fresh per start).
    options = {"TMPDIR": str(tmp_path)}
    async with haru_workers(2, **options) as workers, aiohttp.ClientSession() as http:
        (url,) = set(listening(workers.lines).values())
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
            for pid in listening(workers.lines)
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
        # prometheus_client's runtime collectors read one process: not exported.
        assert not [s for s in samples if s[0].startswith("python_")]
        workers.process.send_signal(signal.SIGTERM)
        assert await workers.exited(timeout_s=30) == 0, workers.log
    assert not metrics_folders(tmp_path)  # removed with the set
    # A new start counts from zero: nothing of the previous set is merged in.
    async with haru_workers(2, **options) as workers, aiohttp.ClientSession() as http:
        (url,) = set(listening(workers.lines).values())
        assert answered(await scrape(http, url)) == 0
        await list_models(http, url, 3)
        assert answered(await scrape(http, url)) == 3
    assert "Traceback" not in workers.log


def own_process(pid: int) -> dict[str, float]:
    """What prometheus_client's process collector reads of ``pid`` alone."""
    reader = ProcessCollector(pid=lambda: pid, registry=None)
    return {family.name: family.samples[0].value for family in reader.collect()}


async def held_now(http: aiohttp.ClientSession, url: str) -> float:
    (held,) = picked(await scrape(http, url), "haru_proxy_held_requests_in_flight")
    return held[2]


async def test_one_scrape_has_every_workers_process_and_held_requests(
    haru_workers: HaruWorkers, tmp_path: Path
) -> None:
    # Every model's server "listens" on a port bound but never listening: it refuses.
    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))
        await seed_example(tmp_path, serving_port=refusing.getsockname()[1])
        options = {"HARU_FAILOVER_HOLD_MS": "60000"}
        async with (
            haru_workers(2, **options) as workers,
            aiohttp.ClientSession() as http,
        ):
            (url,) = set(listening(workers.lines).values())
            alone = {pid: own_process(pid) for pid in listening(workers.lines)}
            families = {f.name: f for f in await scrape_families(http, url)}
            merged = {
                n: f.samples[0].value for n, f in families.items() if n.startswith("process_")
            }
            # Memory, CPU and open files summed over both workers, the start the earliest.
            rss = [own["process_resident_memory_bytes"] for own in alone.values()]
            assert merged["process_resident_memory_bytes"] > max(rss)
            assert merged["process_open_fds"] > max(o["process_open_fds"] for o in alone.values())
            cpu = [own["process_cpu_seconds"] for own in alone.values()]
            assert families["process_cpu_seconds"].type == "counter"
            assert merged["process_cpu_seconds"] >= sum(cpu)
            start = min(own["process_start_time_seconds"] for own in alone.values())
            assert merged["process_start_time_seconds"] == start
            assert "process_max_fds" not in merged  # a per-process limit: not merged
            # A chat to the fleet's refusing active is held for a failover (autoFailover is
            # on); whichever worker holds it, every scrape counts it.
            chat = asyncio.create_task(
                http.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "model": "example-chat-small",
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                    headers={"X-Haru-Fleet": "example"},
                )
            )
            try:
                async with asyncio.timeout(30):
                    while await held_now(http, url) != 1:
                        assert not chat.done(), chat.result()
                        await asyncio.sleep(0.1)
                assert [await held_now(http, url) for _ in range(4)] == [1] * 4
            finally:
                chat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await chat
            # The client left: its worker lets the request go, and the scrapes see none.
            async with asyncio.timeout(30):
                while await held_now(http, url) != 0:
                    await asyncio.sleep(0.1)
    assert "Traceback" not in workers.log
