"""Cost of one reconcile tick of an idle fleet: what the default loop interval is chosen from.

What it measures: ``Reconciler.tick`` of a settled two-domain fleet (alpha active and serving,
beta standby with its vLLM asleep and its trainer running), back to back: the wall time of each
tick and the CPU time the reconciler's process spent on it. Each tick polls both supervisors
(the heartbeat round), records the answers and reads the fleet from the store; nothing changes,
so this is the steady cost the loop pays every interval.

Everything is real except the GPUs: emulated vLLM servers and real supervisors on 127.0.0.1
sockets in a child process (as in production, the supervisors run elsewhere), real
``haru-sim-trainer`` processes, a SQLite state store (or PostgreSQL with ``--database-url``: a
server URL whose user may create databases; the bench uses a fresh database, dropped after).

Run:  uv run python bench/idle_tick.py [--ticks 200]
      [--database-url postgresql://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from haru_db import StateStore, upgrade
from haru_demo.localfleet import LocalFleetOptions
from haru_server._reconciler import Reconciler
from haru_supervisor_client import SupervisorClient
from promotion_overhead import _fresh_postgres_database, _trainers_warm, local_fleet, serve_fleet


async def measure(ticks: int, database_url: str | None, root: Path) -> tuple[list[float], ...]:
    if database_url is None:
        url = f"sqlite:///{root / 'bench.db'}"
        dropped = None
    else:
        url, dropped = await asyncio.to_thread(_fresh_postgres_database, database_url)
    await upgrade(url)
    store = StateStore.open(url)
    slug = "idle"
    try:
        async with (
            local_fleet(root / "fleet", LocalFleetOptions(slug=slug), in_process=False) as fleet,
            aiohttp.ClientSession() as http,
        ):
            await store.apply_fleet_layout(fleet.layout(), at=datetime.now(UTC))
            client = SupervisorClient(http, token=None)
            await client.start_training(fleet.domain("beta").supervisor_url, timeout_s=5)
            await _trainers_warm(fleet, "beta")
            reconciler = Reconciler(store, client, clock=lambda: datetime.now(UTC))
            # Until both domains are ready (their first heartbeats), then warm the connections.
            for _ in range(50):
                await reconciler.tick(slug)
            walls: list[float] = []
            cpus: list[float] = []
            for _ in range(ticks):
                wall, cpu = time.perf_counter(), time.process_time()
                await reconciler.tick(slug)
                walls.append((time.perf_counter() - wall) * 1000)
                cpus.append((time.process_time() - cpu) * 1000)
            return walls, cpus
    finally:
        await store.close()
        if dropped is not None:
            await asyncio.to_thread(dropped)


def _row(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[int(len(ordered) * 0.95) - 1]
    return f"| {name} | {statistics.median(values):.2f} | {p95:.2f} | {max(values):.2f} |"


async def main() -> None:
    if sys.argv[1:2] == ["--serve-fleet"]:
        workdir, slug, *domains = sys.argv[2:]
        await serve_fleet(Path(workdir), slug, tuple(domains))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--database-url", default=None, help="PostgreSQL URL (default: SQLite)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="haru-bench-") as tmp:
        walls, cpus = await measure(args.ticks, args.database_url, Path(tmp))
    store = "PostgreSQL" if args.database_url else "SQLite"
    print(f"{args.ticks} ticks of an idle two-domain fleet ({store})")
    print("| per tick | median ms | p95 ms | max ms |")
    print("|---|---:|---:|---:|")
    print(_row("wall time", walls))
    print(_row("reconciler CPU", cpus))


if __name__ == "__main__":
    asyncio.run(main())
