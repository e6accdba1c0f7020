"""Reconcile tick against the number of domains: 2, 8, 32, 64 and 256 domains of one fleet.

What it measures: ``Reconciler.tick`` of a settled fleet of N domains (the first active and
serving, the others standby), back to back: the wall time of each tick and the CPU time the
reconciler's process spent on it. A tick polls every domain's supervisor (the heartbeat
round), records the answers and reads the fleet from the store.

Everything is real except the GPUs: each domain is a real supervisor
(``haru_supervisor.api.create_app``) with one emulated vLLM server (``haru_sim.VllmSim``) and
its emulated ``nvidia-smi``, from ``haru_demo.LocalFleet``, in its OWN child process
(``--domains-per-process`` packs several domains into one process where memory or start-up
time is short), so the supervisors' work does not run on the reconciler's event loop, as in
production where they run on the GPU hosts. No trainers (they would be hundreds of extra
processes and the heartbeat cost does not depend on them). The store is SQLite (or
PostgreSQL with ``--database-url``: a server URL whose user may create databases; a fresh
database, dropped after). Each N is its own fleet over the first N domains.

Run:  uv run python bench/tick_scale.py [--domains 2,8,32,64,256] [--ticks 50]
      [--database-url postgresql://postgres@127.0.0.1:5432/postgres] [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from haru_db import StateStore, upgrade
from haru_protocol import FleetLayout
from haru_server._reconciler import Reconciler
from haru_supervisor_client import SupervisorClient
from promotion_overhead import _fresh_postgres_database

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "BENCHMARKS.md"
SECTION = "## Reconcile tick against the number of domains"
MODEL = "scale-model"


async def serve_domains(workdir: Path, slugs: list[str]) -> None:
    """Child process: one LocalFleet per domain slug; print their layouts; run until EOF."""
    from haru_demo.localfleet import LocalFleet, LocalFleetOptions

    fleets = []
    try:
        for slug in slugs:
            options = LocalFleetOptions(
                slug=f"f-{slug}", domains=(slug,), models={0: (MODEL,)}, training_gpus=()
            )
            fleet = LocalFleet(workdir / slug, options)
            await fleet.__aenter__()
            fleets.append(fleet)
        domains = [f.layout().domains[0].model_dump(mode="json", by_alias=True) for f in fleets]
        print(json.dumps(domains), flush=True)
        await asyncio.to_thread(sys.stdin.read)
    finally:
        for fleet in reversed(fleets):
            await fleet.__aexit__(None, None, None)


async def start_domains(
    root: Path, count: int, per_process: int
) -> tuple[list[asyncio.subprocess.Process], list[dict[str, Any]]]:
    slugs = [f"d{i:03d}" for i in range(count)]
    groups = [slugs[i : i + per_process] for i in range(0, count, per_process)]
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--serve-domains",
            str(root),
            *group,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for group in groups
    ]
    domains: list[dict[str, Any]] = []
    for child in children:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=600)
        if not line:
            raise RuntimeError("a domain process exited before it was ready")
        domains.extend(json.loads(line))
    return children, domains


async def stop_domains(children: list[asyncio.subprocess.Process]) -> None:
    for child in children:
        assert child.stdin is not None
        child.stdin.close()
    for child in children:
        try:
            await asyncio.wait_for(child.wait(), timeout=30)
        except TimeoutError:
            child.kill()
            await child.wait()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def measure(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    counts = [int(n) for n in args.domains.split(",")]
    if args.database_url is None:
        url, dropped = f"sqlite:///{root / 'bench.db'}", None
    else:
        url, dropped = await asyncio.to_thread(_fresh_postgres_database, args.database_url)
    await upgrade(url)
    store = StateStore.open(url)
    started = time.monotonic()
    children, domains = await start_domains(root, max(counts), args.domains_per_process)
    print(
        f"{len(domains)} domains in {len(children)} processes ready in "
        f"{time.monotonic() - started:.0f} s; domain process RSS "
        f"{statistics.median(rss_mib(c.pid) for c in children):.1f} MiB (median)",
        file=sys.stderr,
        flush=True,
    )
    rows = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            client = SupervisorClient(http, token=None)
            reconciler = Reconciler(store, client, clock=lambda: datetime.now(UTC))
            for n in counts:
                slug = f"scale-{n}"
                layout = FleetLayout.model_validate(
                    {"slug": slug, "activeDomainSlug": domains[0]["slug"], "domains": domains[:n]}
                )
                await store.apply_fleet_layout(layout, at=datetime.now(UTC))
                for _ in range(args.warmup):  # every domain ready, connections open
                    await reconciler.tick(slug)
                walls: list[float] = []
                cpus: list[float] = []
                for _ in range(args.ticks):
                    wall, cpu = time.perf_counter(), time.process_time()
                    await reconciler.tick(slug)
                    walls.append((time.perf_counter() - wall) * 1000)
                    cpus.append((time.process_time() - cpu) * 1000)
                rows.append({"domains": n, "walls": walls, "cpus": cpus})
                print(f"{n} domains: {statistics.median(walls):.1f} ms", file=sys.stderr)
    finally:
        await stop_domains(children)
        await store.close()
        if dropped is not None:
            await asyncio.to_thread(dropped)
    return rows


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(int(len(ordered) * 0.95) - 1, 0)]


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = rows[0]
    base_wall = statistics.median(base["walls"])
    lines = [
        "| domains | wall per tick median ms | p95 | CPU per tick median ms "
        f"| wall per domain beyond {base['domains']} (ms) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for row in rows:
        wall = statistics.median(row["walls"])
        extra = row["domains"] - base["domains"]
        slope = (wall - base_wall) / extra if extra else float("nan")
        lines.append(
            f"| {row['domains']} | {wall:.1f} | {p95(row['walls']):.1f} "
            f"| {statistics.median(row['cpus']):.1f} | {'-' if not extra else f'{slope:.2f}'} |"
        )
        if row["domains"] == 64:
            verdicts.append(
                f"- 64 domains < 40 ms: {wall:.1f} ms, {'met' if wall < 40 else 'NOT met'}"
            )
        if extra and row["domains"] == max(r["domains"] for r in rows):
            verdicts.append(
                f"- <= 0.5 ms per domain beyond the first ({base['domains']} to "
                f"{row['domains']}): {slope:.2f} ms, {'met' if slope <= 0.5 else 'NOT met'}"
            )
    store = "PostgreSQL (local)" if args.database_url else "SQLite"
    return "\n".join(lines) + (
        f"\n\n{store}; {args.ticks} ticks per row after {args.warmup} warm-up ticks; "
        f"{args.domains_per_process} domain(s) per supervisor process; load average "
        f"{os.getloadavg()[0]:.1f} at the end (`uptime`, {os.cpu_count()} CPUs).\n\n"
        + "\n".join(verdicts)
    )


def write_docs(body: str) -> None:
    text = DOCS.read_text()
    start = text.find(SECTION)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + ("" if end == -1 else text[end + 1 :])
    DOCS.write_text(text)


async def main() -> None:
    if sys.argv[1:2] == ["--serve-domains"]:
        await serve_domains(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domains", default="2,8,32,64,256")
    parser.add_argument("--ticks", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--domains-per-process", type=int, default=1)
    parser.add_argument("--database-url", default=None, help="PostgreSQL URL (default: SQLite)")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS.name}")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="haru-tick-") as tmp:
        rows = await measure(args, Path(tmp))
    rendered = render(rows, args)
    print(rendered)
    if args.write_docs:
        shown = ["<url>" if a == args.database_url else a for a in sys.argv[1:]]
        command = "uv run python bench/tick_scale.py " + " ".join(shown)
        write_docs(
            f"{SECTION}\n\nCommand: `{command.strip()}` ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)."
            f"\n\n{rendered}\n"
        )


if __name__ == "__main__":
    asyncio.run(main())
