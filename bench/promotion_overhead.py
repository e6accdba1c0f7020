"""Control overhead of a promotion, with and without step chaining.

What it measures: the time from "promote accepted" (the operation row was created; with
chaining the loop is then kicked, as the API does) to "routing flipped" (the switch_active CAS
landed), MINUS the emulated work the promotion has to wait for anyway, measured in the same
run by the reconciler's own supervisor client: the trainer's exit (from the
``training/stop`` call to the first status that shows every run idle), the ``vllm/wake``
call and the ``probe`` call. What is left is the control plane's own cost: loop waits,
heartbeats, database round trips, the other supervisor calls. For reference the same work is
also measured directly on a separate supervisor (medians printed above the table).

Everything is real except the GPUs: emulated vLLM servers and real supervisors on 127.0.0.1
sockets, in a process of their own as in production (the supervisors run on the GPU hosts;
``--fleet-in-process`` puts them on the reconciler's event loop instead, as before 2026-12-01,
which charges their request handling to the control plane), real ``haru-sim-trainer``
processes stopped with SIGTERM, a SQLite state store (or
PostgreSQL with ``--database-url``: a server URL whose user may create databases; each
configuration runs in a fresh database, dropped afterwards), the real reconciler and background
loop. "Without
chaining" is the plain design: one step per tick, no quick re-tick while an operation is in
flight, no kick on acceptance.

Run:  uv run python bench/promotion_overhead.py [--runs 5] [--unchained-runs 2]
      [--intervals 1 5] [--database-url postgresql://postgres@127.0.0.1:5432/postgres]
      [--fleet-in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from haru_db import StateStore, upgrade
from haru_demo.localfleet import LocalFleet, LocalFleetOptions
from haru_protocol import (
    FleetLayout,
    OperationKind,
    OperationState,
    ProbeResponse,
    SlotKind,
    SupervisorStatus,
    TrainingRunState,
)
from haru_server._loop import LoopOptions, ReconcileLoop
from haru_server._reconciler import Accepted, Reconciler, ReconcilerOptions
from haru_sim import read_trainer_checkpoint
from haru_supervisor_client import SupervisorClient
from sqlalchemy.engine import make_url

INTERVALS_S = (0.25, 1.0, 5.0)
BUSY_INTERVAL_S = 0.15
TARGET_OVERHEAD_MS = 25.0


@dataclass
class Baseline:
    trainer_exit_ms: float
    wake_ms: float
    probe_ms: float

    @property
    def total_ms(self) -> float:
        return self.trainer_exit_ms + self.wake_ms + self.probe_ms


@dataclass
class Row:
    interval_s: float
    chaining: bool
    totals_ms: list[float]
    work_ms: list[float]
    overheads_ms: list[float]


def _ms(seconds: float) -> float:
    return seconds * 1000.0


@dataclass(frozen=True)
class FleetDomain:
    """What the bench needs of one domain of a running local fleet."""

    supervisor_url: str
    checkpoint_dirs: dict[int, Path]


@dataclass(frozen=True)
class Fleet:
    """A running local fleet, in this process or in a child process."""

    layout_document: FleetLayout
    domains: dict[str, FleetDomain]

    def layout(self) -> FleetLayout:
        return self.layout_document

    def domain(self, slug: str) -> FleetDomain:
        return self.domains[slug]


def _describe(fleet: LocalFleet) -> Fleet:
    domains = {
        slug: FleetDomain(
            supervisor_url=fleet.domain(slug).supervisor_url,
            checkpoint_dirs=dict(fleet.domain(slug).checkpoint_dirs),
        )
        for slug in fleet.options.domains
    }
    return Fleet(fleet.layout(), domains)


@contextlib.asynccontextmanager
async def local_fleet(
    workdir: Path, options: LocalFleetOptions, *, in_process: bool
) -> AsyncIterator[Fleet]:
    """A local fleet on 127.0.0.1: on this event loop, or in a child process (the default)."""
    if in_process:
        async with LocalFleet(workdir, options) as fleet:
            yield _describe(fleet)
        return
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve-fleet",
        str(workdir),
        options.slug,
        *options.domains,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
        if not line:
            raise RuntimeError("the fleet process exited before it was ready")
        described = json.loads(line)
        yield Fleet(
            FleetLayout.model_validate(described["layout"]),
            {
                slug: FleetDomain(
                    supervisor_url=d["supervisorUrl"],
                    checkpoint_dirs={int(k): Path(v) for k, v in d["checkpointDirs"].items()},
                )
                for slug, d in described["domains"].items()
            },
        )
    finally:
        child.stdin.close()  # the child closes its fleet and exits at end of input
        try:
            await asyncio.wait_for(child.wait(), timeout=30)
        except TimeoutError:
            child.kill()
            await child.wait()


async def serve_fleet(workdir: Path, slug: str, domains: tuple[str, ...]) -> None:
    """The child process of :func:`local_fleet`: describe the fleet on stdout, run until EOF."""
    options = LocalFleetOptions(slug=slug, domains=domains)
    async with LocalFleet(workdir, options) as fleet:
        described = _describe(fleet)
        document = {
            "layout": described.layout_document.model_dump(mode="json", by_alias=True),
            "domains": {
                name: {
                    "supervisorUrl": d.supervisor_url,
                    "checkpointDirs": {str(k): str(v) for k, v in d.checkpoint_dirs.items()},
                }
                for name, d in described.domains.items()
            },
        }
        print(json.dumps(document), flush=True)
        await asyncio.to_thread(sys.stdin.read)


class TimedClient(SupervisorClient):
    """The reconciler's client, noting how long it waited for the emulated work."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        super().__init__(session, token=None)
        self.reset("")

    def reset(self, target_url: str) -> None:
        self.target_url = target_url
        self.stop_started: float | None = None
        self.idle_seen: float | None = None
        self.wake_s = 0.0
        self.probe_s = 0.0

    @property
    def work_ms(self) -> float:
        exit_s = 0.0
        if self.stop_started is not None and self.idle_seen is not None:
            exit_s = self.idle_seen - self.stop_started
        return _ms(exit_s + self.wake_s + self.probe_s)

    async def status(self, base_url: str, *, timeout_s: float) -> SupervisorStatus:
        status = await super().status(base_url, timeout_s=timeout_s)
        if (
            base_url == self.target_url
            and self.stop_started is not None
            and self.idle_seen is None
            and _training(status, TrainingRunState.IDLE)
        ):
            self.idle_seen = time.monotonic()
        return status

    async def stop_training(self, base_url: str, *, timeout_s: float, grace_ms: int) -> None:
        if base_url == self.target_url and self.stop_started is None:
            self.stop_started = time.monotonic()
        await super().stop_training(base_url, timeout_s=timeout_s, grace_ms=grace_ms)

    async def wake(self, base_url: str, *, timeout_s: float) -> None:
        started = time.monotonic()
        try:
            await super().wake(base_url, timeout_s=timeout_s)
        finally:
            if base_url == self.target_url:
                self.wake_s += time.monotonic() - started

    async def probe(
        self,
        base_url: str,
        *,
        timeout_s: float,
        prompt: str,
        max_tokens: int,
    ) -> ProbeResponse:
        started = time.monotonic()
        try:
            return await super().probe(
                base_url,
                timeout_s=timeout_s,
                prompt=prompt,
                max_tokens=max_tokens,
            )
        finally:
            if base_url == self.target_url:
                self.probe_s += time.monotonic() - started


async def _poll(
    client: SupervisorClient,
    url: str,
    done: Callable[[SupervisorStatus], bool],
    *,
    pause_s: float = 0.001,
    timeout_s: float = 30.0,
) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if done(await client.status(url, timeout_s=5)):
                return
            await asyncio.sleep(pause_s)


def _training(status: SupervisorStatus, state: TrainingRunState) -> bool:
    runs = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
    return bool(runs) and all(
        r is not None and r.state is state and (state is not TrainingRunState.RUNNING or r.pids)
        for r in runs
    )


async def _trainers_warm(fleet: Fleet, slug: str) -> None:
    # A trainer that has written a checkpoint really trains: SIGTERM reaches its handler.
    async with asyncio.timeout(30):
        for directory in fleet.domain(slug).checkpoint_dirs.values():
            before = read_trainer_checkpoint(directory)
            while True:
                now = read_trainer_checkpoint(directory)
                if now is not None and (before is None or now.saved_at > before.saved_at):
                    break
                await asyncio.sleep(0.01)


async def measure_baseline(
    workdir: Path, http: aiohttp.ClientSession, samples: int, *, in_process: bool
) -> Baseline:
    """Medians of the emulated work, measured directly on a separate one-domain fleet."""
    exits: list[float] = []
    wakes: list[float] = []
    probes: list[float] = []
    options = LocalFleetOptions(slug="baseline", domains=("base",))
    async with local_fleet(workdir, options, in_process=in_process) as fleet:
        client = SupervisorClient(http, token=None)
        url = fleet.domain("base").supervisor_url
        for _ in range(samples):
            await client.sleep(url, timeout_s=30)
            await client.start_training(url, timeout_s=5)
            await _poll(client, url, lambda s: _training(s, TrainingRunState.RUNNING))
            await _trainers_warm(fleet, "base")
            started = time.monotonic()
            await client.stop_training(url, timeout_s=5, grace_ms=30_000)
            await _poll(client, url, lambda s: _training(s, TrainingRunState.IDLE))
            exits.append(_ms(time.monotonic() - started))
            started = time.monotonic()
            await client.wake(url, timeout_s=30)
            wakes.append(_ms(time.monotonic() - started))
            started = time.monotonic()
            result = await client.probe(url, timeout_s=30, prompt="ping", max_tokens=4)
            probes.append(_ms(time.monotonic() - started))
            assert result.ok, result
    return Baseline(
        trainer_exit_ms=statistics.median(exits),
        wake_ms=statistics.median(wakes),
        probe_ms=statistics.median(probes),
    )


def _timed_switch(store: StateStore) -> Callable[[], Awaitable[float]]:
    """Wrap ``store.switch_active`` so the bench learns when the pointer CAS landed."""
    original = store.switch_active
    flipped: list[asyncio.Future[float]] = []

    async def switch_active(**kwargs: Any) -> bool:
        landed = await original(**kwargs)
        if landed and flipped and not flipped[-1].done():
            flipped[-1].set_result(time.monotonic())
        return landed

    store.switch_active = switch_active  # type: ignore[method-assign]  # bench instrumentation

    async def next_flip() -> float:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        flipped.append(future)
        return await future

    return next_flip


async def measure_config(
    *,
    interval_s: float,
    chaining: bool,
    runs: int,
    workdir: Path,
    database_url: str | None,
    http: aiohttp.ClientSession,
    verbose: bool,
    in_process: bool,
) -> Row:
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    if database_url is None:
        url = f"sqlite:///{workdir / 'bench.db'}"
        dropped = None
    else:
        url, dropped = await asyncio.to_thread(_fresh_postgres_database, database_url)
    await upgrade(url)
    store = StateStore.open(url)
    slug = f"bench-{int(interval_s * 1000)}-{'c' if chaining else 'n'}"
    options = LocalFleetOptions(slug=slug)
    row = Row(interval_s, chaining, [], [], [])
    try:
        async with local_fleet(workdir / "fleet", options, in_process=in_process) as fleet:
            await store.apply_fleet_layout(fleet.layout(), at=datetime.now(UTC))
            snapshot = await store.get_fleet_snapshot(slug)
            assert snapshot is not None
            ids = {d.slug: d.id for d in snapshot.domains}
            client = TimedClient(http)
            # Standby posture for beta: asleep, trainers running.
            await client.start_training(fleet.domain("beta").supervisor_url, timeout_s=5)
            await _trainers_warm(fleet, "beta")
            reconciler = Reconciler(
                store,
                client,
                clock=lambda: datetime.now(UTC),
                options=ReconcilerOptions(chaining=chaining),
            )
            next_flip = _timed_switch(store)
            loop = ReconcileLoop(
                reconciler,
                store,
                LoopOptions(
                    interval_s=interval_s,
                    busy_interval_s=BUSY_INTERVAL_S if chaining else interval_s,
                    fleets=(slug,),
                ),
            )
            loop.start()
            try:
                target, standby = "beta", "alpha"
                for _ in range(runs):
                    # Land somewhere in the loop's cycle, as a real request would.
                    await asyncio.sleep(interval_s * 0.37)
                    client.reset(fleet.domain(target).supervisor_url)
                    flip = asyncio.ensure_future(next_flip())
                    # What the API does before it accepts: read the fleet to validate the target
                    # (the kick hands this snapshot to the loop, as the API's does).
                    fresh = await store.get_fleet_snapshot(slug)
                    assert fresh is not None
                    accepted_at = datetime.now(UTC)
                    operation, created = await store.create_operation(
                        fleet_id=snapshot.id,
                        kind=OperationKind.PROMOTE,
                        target_domain_id=ids[target],
                        at=accepted_at,
                    )
                    # Accepted: the row exists (the API answers 202 here).
                    accepted = time.monotonic()
                    assert created
                    if chaining:
                        loop.kick(snapshot.id, accepted=Accepted(fleet=fresh, operation=operation))
                    flipped = await asyncio.wait_for(flip, timeout=interval_s * 12 + 30)
                    total = _ms(flipped - accepted)
                    row.totals_ms.append(total)
                    row.work_ms.append(client.work_ms)
                    row.overheads_ms.append(total - client.work_ms)
                    if verbose:
                        print(
                            f"  {target}: accepted->flipped {total:.1f} ms, work "
                            f"{client.work_ms:.1f} ms, overhead {total - client.work_ms:.1f} ms",
                            flush=True,
                        )
                        events = await store.list_events(snapshot.id, limit=1000)
                        marks = [
                            f"{e.payload.get('step', e.type)} "
                            f"{(e.created_at - accepted_at).total_seconds() * 1000:.0f}"
                            for e in events
                            if e.operation_id == operation.id
                        ]
                        print("    " + ", ".join(marks), flush=True)
                    async with asyncio.timeout(interval_s * 6 + 30):
                        while True:
                            current = await store.get_operation(operation.id)
                            assert current is not None
                            if current.state is not OperationState.RUNNING and (
                                current.state is not OperationState.PENDING
                            ):
                                break
                            await asyncio.sleep(0.02)
                    assert current.state is OperationState.SUCCEEDED, current.error
                    # The old active now trains; wait until it really does before promoting back.
                    await _trainers_warm(fleet, standby)
                    target, standby = standby, target
            finally:
                await loop.stop()
    finally:
        await store.close()
        if dropped is not None:
            await asyncio.to_thread(dropped)
    return row


def _fresh_postgres_database(admin_url: str) -> tuple[str, Callable[[], None]]:
    """A new empty database on the server of ``admin_url`` (and how to drop it).

    Each configuration gets its own: a fleet left by an earlier run (same slug, supervisor
    URLs of dead ports) would otherwise be reused and skew every number.
    """
    parsed = make_url(admin_url)
    libpq = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"haru_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return parsed.set(database=name).render_as_string(hide_password=False), drop


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f}"


def print_table(baseline: Baseline, rows: list[Row]) -> None:
    print()
    print(
        f"emulated work measured directly (medians, for reference): trainer exit "
        f"{baseline.trainer_exit_ms:.1f} ms, wake {baseline.wake_ms:.1f} ms, probe "
        f"{baseline.probe_ms:.1f} ms = {baseline.total_ms:.1f} ms"
    )
    print()
    header = (
        f"| {'loop interval':>13} | {'chaining':>8} | {'runs':>4} | {'accepted->flipped ms':>20} "
        f"| {'emulated work ms':>16} | {'overhead ms (median)':>20} | {'min':>7} | {'max':>7} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for row in rows:
        print(
            f"| {f'{row.interval_s * 1000:.0f} ms':>13} | {'on' if row.chaining else 'off':>8} "
            f"| {len(row.totals_ms):>4} | {_fmt(row.totals_ms):>20} "
            f"| {_fmt(row.work_ms):>16} "
            f"| {_fmt(row.overheads_ms):>20} | {min(row.overheads_ms):7.1f} "
            f"| {max(row.overheads_ms):7.1f} |"
        )
    chained = [statistics.median(r.overheads_ms) for r in rows if r.chaining]
    if not chained:
        verdict = "not measured (no chained runs)"
    else:
        verdict = "met" if max(chained) <= TARGET_OVERHEAD_MS else "NOT met"
    print()
    print(f"target: overhead <= {TARGET_OVERHEAD_MS:.0f} ms with chaining: {verdict}")


async def main() -> None:
    if sys.argv[1:2] == ["--serve-fleet"]:
        workdir, slug, *domains = sys.argv[2:]
        await serve_fleet(Path(workdir), slug, tuple(domains))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="promotions per chained config")
    parser.add_argument(
        "--unchained-runs", type=int, default=2, help="promotions per unchained config"
    )
    parser.add_argument("--baseline-samples", type=int, default=5)
    parser.add_argument(
        "--intervals",
        type=float,
        nargs="+",
        default=list(INTERVALS_S),
        help="loop intervals in seconds",
    )
    parser.add_argument("--database-url", default=None, help="PostgreSQL URL (default: SQLite)")
    parser.add_argument("--verbose", action="store_true", help="print every promotion")
    parser.add_argument(
        "--fleet-in-process",
        action="store_true",
        help="run the supervisors and emulated vLLM servers on the reconciler's event loop",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="haru-bench-") as tmp:
        root = Path(tmp)
        async with aiohttp.ClientSession() as http:
            baseline = await measure_baseline(
                root / "baseline", http, args.baseline_samples, in_process=args.fleet_in_process
            )
            rows: list[Row] = []
            for index, interval in enumerate(args.intervals):
                for chaining in (True, False):
                    runs = args.runs if chaining else args.unchained_runs
                    if runs <= 0:
                        # Nothing to measure (and no median of nothing to print).
                        continue
                    label = (
                        f"interval {interval * 1000:.0f} ms, chaining {'on' if chaining else 'off'}"
                    )
                    print(f"measuring {label} ({runs} promotions)...", flush=True)
                    rows.append(
                        await measure_config(
                            interval_s=interval,
                            chaining=chaining,
                            runs=runs,
                            workdir=root / f"run-{index}-{int(chaining)}",
                            database_url=args.database_url,
                            http=http,
                            verbose=args.verbose,
                            in_process=args.fleet_in_process,
                        )
                    )
    print_table(baseline, rows)


if __name__ == "__main__":
    asyncio.run(main())
