"""Unplanned failover out of the box: kill -> first good answer, and what failed meanwhile.

Setup, as an operator gets it: ``haru serve`` (a real process on the embedded SQLite default)
with NO reconcile or failover setting in its environment, the fleet seeded with the default
policy and only ``autoFailover: true``, two real supervisors with emulated vLLM servers and
``haru-sim-trainer`` processes (the standby trains), and 8 concurrent OpenAI-SDK clients
(every other request streams) through the proxy, SDK retries off. Each run kills the active
domain and measures:

- ``kill->good``: the kill to the first good answer (from a request sent after the kill);
- the failover operation's own work measured in the same run, from its audit events:
  ``trainer`` (the slowest trainer's SIGTERM-to-gone, as its supervisor measured it, and
  whether it was SIGKILLed), ``wake`` and ``probe`` (the steps' durations), and
  ``detect`` (the kill to the ``operation.auto_failover`` event);
- ``over``: kill->good minus trainer, wake and probe (the control plane's share, which the
  target bounds: 2 s for a dead vLLM, 5 s for a lost host);
- failures among requests in flight from the kill until the first good answer plus 2 s:
  ``failed`` non-streamed requests, ``no-byte`` streams that failed before any content,
  and ``cut`` streams the kill cut after their answer had started (no proxy can resend those).

Rows: ``vllm`` SIGKILLs every vLLM server of the active (its supervisor keeps answering);
``host`` SIGKILLs the active's supervisor and vLLM servers together (a lost host). After each
run the killed domain is restarted and brought back to standby posture, and the next run kills
the other domain. Nothing is asserted: a busy machine only makes the numbers worse.

Run:  uv run python bench/failover.py [--runs 10] [--rows vllm host] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from haru_demo import (
    ChatTraffic,
    DemoTimings,
    DemoTopology,
    TopologyOptions,
    active_slug,
    fetch_events,
    is_standby_posture,
)
from haru_protocol import (
    Event,
    OperationAutoFailover,
    OperationStarted,
    OperationState,
    OperationStepDone,
    PolicyPatch,
)

TIMINGS = DemoTimings(
    reconcile_interval_ms=None,  # the server's default: nothing set in its environment
    policy=PolicyPatch(auto_failover=True),  # the default policy, autoFailover on
    ready_timeout_s=120.0,
)
SETTLE_S = 2.0


@dataclass
class Run:
    row: str
    source: str
    kill_to_good_s: float | None
    detect_s: float | None
    trainer_s: float | None
    trainer_killed: bool
    wake_s: float | None
    probe_s: float | None
    sent: int
    failed: int
    no_byte: int
    cut: int
    note: str = ""

    @property
    def over_s(self) -> float | None:
        parts = (self.kill_to_good_s, self.trainer_s, self.wake_s, self.probe_s)
        if any(p is None for p in parts):
            return None
        good, trainer, wake, probe = (p or 0.0 for p in parts)
        return good - trainer - wake - probe


def steps_of(events: list[Event], operation_id: object) -> dict[str, float]:
    mark = None
    durations: dict[str, float] = {}
    for event in sorted(events, key=lambda e: e.id):
        if event.operation_id != operation_id:
            continue
        if isinstance(event.data, OperationStarted):
            mark = event.created_at
        elif isinstance(event.data, OperationStepDone) and mark is not None:
            durations[event.data.step.value] = (event.created_at - mark).total_seconds()
            mark = event.created_at
    return durations


def trainer_of(events: list[Event], operation_id: object) -> tuple[float | None, bool]:
    for event in events:
        data = event.data
        if (
            event.operation_id == operation_id
            and isinstance(data, OperationStepDone)
            and data.step.value == "stop_training"
        ):
            stops = data.training_stops or ()
            if not stops:
                return 0.0, False
            return max(s.stop_ms for s in stops) / 1000, any(s.killed for s in stops)
    return None, False


async def wait_posture(topology: DemoTopology, slug: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        fleet = await topology.fleet()
        if is_standby_posture(fleet, slug):
            return
        if any(d.slug == slug and d.state.value == "ready" for d in fleet.domains):
            try:
                await topology.ensure_standby_posture()
            except Exception as exc:  # noqa: BLE001 - the failover's tail may still be in flight
                print(f"  (posture: {exc})", file=sys.stderr)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{slug} did not return to standby posture in {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


async def one_run(topology: DemoTopology, traffic: ChatTraffic, row: str) -> Run:
    fleet = await topology.fleet()
    source = active_slug(fleet) or topology.initial_active()
    async with topology.control() as client:
        before = await fetch_events(client, topology.fleet_slug)
    cursor = before[-1].id if before else 0
    if row == "vllm":
        killed = (await topology.kill_vllm(source)).timestamp()
    else:
        killed = (await topology.kill_host(source)).timestamp()
    first = None
    deadline = time.monotonic() + 300
    while first is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        first = traffic.first_good_after(killed)
    await asyncio.sleep(SETTLE_S)
    until = (first.ended_at if first is not None else time.time()) + SETTLE_S
    window = traffic.window(since=killed, until=until)
    failed = [r for r in window if not r.ok]
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug, after=cursor)
    auto = next((e for e in events if isinstance(e.data, OperationAutoFailover)), None)
    run = Run(
        row=row,
        source=source,
        kill_to_good_s=None if first is None else first.ended_at - killed,
        detect_s=None if auto is None else auto.created_at.timestamp() - killed,
        trainer_s=None,
        trainer_killed=False,
        wake_s=None,
        probe_s=None,
        sent=len(window),
        failed=sum(1 for r in failed if not r.stream),
        no_byte=sum(1 for r in failed if r.stream and not r.cut),
        cut=sum(1 for r in failed if r.cut),
    )
    errors = sorted({r.error or "?" for r in failed if not r.cut})
    run.note = "; ".join(errors)[:160]
    if auto is None or auto.operation_id is None:
        run.note = f"no automatic failover; {run.note}"
        return run
    operation = await topology.wait_for_operation(auto.operation_id, timeout_s=600)
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug, after=cursor)
    steps = steps_of(events, auto.operation_id)
    run.trainer_s, run.trainer_killed = trainer_of(events, auto.operation_id)
    run.wake_s, run.probe_s = steps.get("wake_vllm"), steps.get("probe")
    if operation.state is not OperationState.SUCCEEDED:
        run.note = f"promote {operation.state.value}; {run.note}"
    # Bring the killed domain back, as standby, for the next run (which kills the other one).
    if row == "vllm":
        await topology.restart_vllm(source, asleep=True)
    else:
        await topology.restart_host(source)
    await wait_posture(topology, source, timeout_s=300)
    return run


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:6.2f}"


def table(runs: list[Run]) -> str:
    lines = [
        "| row | # | from | kill->good s | detect s | trainer s (killed) | wake s | probe s "
        "| over s | sent | failed | no-byte | cut | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, r in enumerate(runs):
        lines.append(
            f"| {r.row} | {index} | {r.source} | {fmt(r.kill_to_good_s)} | {fmt(r.detect_s)} "
            f"| {fmt(r.trainer_s)} ({'yes' if r.trainer_killed else 'no'}) | {fmt(r.wake_s)} "
            f"| {fmt(r.probe_s)} | {fmt(r.over_s)} | {r.sent} | {r.failed} | {r.no_byte} "
            f"| {r.cut} | {r.note} |"
        )
    return "\n".join(lines)


def summary(runs: list[Run]) -> str:
    out = []
    for row in sorted({r.row for r in runs}):
        mine = [r for r in runs if r.row == row]
        goods = [r.kill_to_good_s for r in mine if r.kill_to_good_s is not None]
        overs = [r.over_s for r in mine if r.over_s is not None]
        trainers = [r.trainer_s for r in mine if r.trainer_s is not None]
        out.append(
            f"{row}: {len(mine)} runs; kill->good median {statistics.median(goods):.2f} s "
            f"(max {max(goods):.2f}); over median {statistics.median(overs):.2f} s "
            f"(max {max(overs):.2f}); trainer median {statistics.median(trainers):.2f} s; "
            f"failed {sum(r.failed for r in mine)}, no-byte {sum(r.no_byte for r in mine)}, "
            f"cut {sum(r.cut for r in mine)} of {sum(r.sent for r in mine)} requests"
            if goods and overs and trainers
            else f"{row}: {len(mine)} runs, incomplete measurements"
        )
    return "\n".join(out)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per row (default 10)")
    parser.add_argument("--rows", nargs="+", default=["vllm", "host"], choices=["vllm", "host"])
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="haru-bench-failover-") as workdir:
        topology = DemoTopology(TopologyOptions(workdir=Path(workdir), timings=TIMINGS))
        async with topology:
            models = [m for d in topology.domains.values() for m in d.models]
            async with ChatTraffic(
                topology.server_url,
                fleet=topology.fleet_slug,
                models=sorted(set(models)),
                clients=args.clients,
                pause_s=0.05,
                timeout_s=120.0,
            ) as traffic:
                for row in args.rows:
                    for _ in range(args.runs):
                        run = await one_run(topology, traffic, row)
                        runs.append(run)
                        print(table(runs).splitlines()[-1], flush=True)
    print()
    print(table(runs))
    print()
    print(summary(runs))


if __name__ == "__main__":
    asyncio.run(main())
