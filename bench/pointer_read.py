"""State store pointer read: the per-request ``get_fleet_route_pointer`` call, alone.

Seeds one fleet into a throwaway SQLite file (and, with ``--postgres-url``, a throwaway
PostgreSQL database created on that server and dropped afterwards), then times ``--n``
sequential reads and ``--n`` reads issued ``--concurrency`` at a time through one
``StateStore``. Each lane is warmed up first (pool filled, statement compiled). Prints p50/p99
in microseconds, the throughput and the process CPU per read (aiosqlite's worker threads
included; the PostgreSQL server's CPU is not); nothing is asserted.

    uv run python bench/pointer_read.py
    uv run python bench/pointer_read.py --postgres-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

FLEET = "bench"
WARMUP = 200


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _seed(url: str) -> None:
    from haru_db import StateStore, upgrade
    from haru_protocol import FleetLayout

    await upgrade(url)
    store = StateStore.open(url)
    try:
        layout = FleetLayout.model_validate(
            {
                "slug": FLEET,
                "activeDomainSlug": "alpha",
                "domains": [
                    {
                        "slug": "alpha",
                        "placement": {
                            "cloud": "aws",
                            "region": "us-east-1",
                            "accelerator": "EXAMPLE-GPU",
                        },
                        "slots": [
                            {
                                "kind": "inference",
                                "gpuIndex": 0,
                                "models": [
                                    {"name": "m", "servingUrl": "http://127.0.0.1:9/v1"},
                                ],
                            }
                        ],
                    }
                ],
            }
        )
        await store.apply_fleet_layout(layout, at=datetime.now(UTC))
    finally:
        await store.close()


Row = tuple[float, float, float, float]
"""p50 us, p99 us, reads per second, process CPU us per read (all threads)."""


async def _measure(url: str, *, n: int, concurrency: int) -> dict[str, Row]:
    from haru_db import StateStore

    store = StateStore.open(url)
    try:
        for _ in range(WARMUP):
            assert await store.get_fleet_route_pointer(FLEET) is not None
        sequential: list[float] = []
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            start = time.perf_counter()
            await store.get_fleet_route_pointer(FLEET)
            sequential.append((time.perf_counter() - start) * 1e6)
        seq_wall, seq_cpu = time.perf_counter() - wall, time.process_time() - cpu

        concurrent: list[float] = []
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                start = time.perf_counter()
                await store.get_fleet_route_pointer(FLEET)
                concurrent.append((time.perf_counter() - start) * 1e6)

        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one() for _ in range(n)))
        con_wall, con_cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await store.close()
    return {
        "sequential": (
            _percentile(sequential, 0.5),
            _percentile(sequential, 0.99),
            n / seq_wall,
            seq_cpu / n * 1e6,
        ),
        f"concurrency {concurrency}": (
            _percentile(concurrent, 0.5),
            _percentile(concurrent, 0.99),
            n / con_wall,
            con_cpu / n * 1e6,
        ),
    }


@asynccontextmanager
async def _throwaway_postgres(admin_url: str) -> AsyncIterator[str]:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(admin_url).set(drivername="postgresql")
    name = f"haru_bench_{secrets.token_hex(4)}"
    libpq = admin.render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="reads per measurement")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--postgres-url", help="server to create a throwaway database on")
    args = parser.parse_args()

    print(
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU(s), "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}; "
        f"{args.n} reads per row after {WARMUP} warm-up reads"
    )
    print()
    print("| engine | mode | p50 us | p99 us | reads/s | CPU us/read |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")

    def report(engine: str, results: dict[str, Row]) -> None:
        for mode, (p50, p99, rate, cpu) in results.items():
            print(
                f"| {engine} | {mode} | {p50:.0f} | {p99:.0f} | {rate:.0f} | {cpu:.0f} |",
                flush=True,
            )

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        await _seed(url)
        report("SQLite", await _measure(url, n=args.n, concurrency=args.concurrency))
    if args.postgres_url:
        async with _throwaway_postgres(args.postgres_url) as url:
            await _seed(url)
            report("PostgreSQL", await _measure(url, n=args.n, concurrency=args.concurrency))


if __name__ == "__main__":
    asyncio.run(main())
