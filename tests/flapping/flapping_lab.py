"""Faults that must not fail over, on a real network path (the flapping suite).

A failover costs the standby's training, so a blip must not cause one. :func:`lab_fleet` runs a
whole fleet as real processes (``haru serve``, two supervisors with their emulated vLLM servers
and trainers) with each host in its own network namespace (:mod:`haru_sim.netlab`): the
server in one, each domain's supervisor and vLLM servers in another. The fleet runs the default
policy with only ``autoFailover`` on. :func:`run_trial` injects one fault on the active domain
while two OpenAI-SDK clients send traffic through the proxy, waits for the fleet to settle, and
reports whether it failed over and what made the fault visible:

- ``partition``: the active's host is cut off from the server for 2 s (``iptables -j DROP``);
  visible as the server's ``haru_domain_heartbeat_age_seconds`` reaching the cut's length;
- ``loss``: 20 % of the packets between the active's host and the server are dropped at random
  for 30 s; visible in the link's drop counters, with the heartbeat age and heartbeat failures
  the server saw beside it;
- ``slow_heartbeat``: the active's supervisor is stopped (SIGSTOP) for 1.5 s, longer than the
  reconcile interval, so one heartbeat answers late; visible as the heartbeat age;
- ``burst_500``: one model of the active answers 500 to a burst of 20 requests; visible in
  ``haru_proxy_requests{status="500"}``;
- ``vllm_blip``: every vLLM server of the active refuses connections (their listening sockets
  closed, as when the processes are gone) until the server has seen it (``domain.not_ready``),
  then listens again at once: a vLLM back within ``deadConfirmMs``. Visible as that event.

``tests/flapping/test_flapping.py`` runs one trial of each in CI; ``bench/flapping.py`` runs
many and prints a table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import openai
from haru_demo import (
    ChatTraffic,
    DemoTimings,
    DemoTopology,
    HostPlacement,
    TopologyOptions,
    active_slug,
    fetch_events,
    is_standby_posture,
)
from haru_protocol import (
    DomainNotReady,
    OperationAutoFailover,
    OperationRequestedPromote,
    PolicyPatch,
    RoutingSwitched,
)
from haru_sim.netlab import Lab

FAULTS = ("partition", "loss", "slow_heartbeat", "burst_500", "vllm_blip")

PARTITION_S = 2.0
LOSS = 0.2
LOSS_S = 30.0
SLOW_HEARTBEAT_S = 1.5
BURST = 20

TIMINGS = DemoTimings(
    sleep_latency_ms=20,
    wake_latency_ms=100,
    first_token_latency_ms=5,
    token_latency_ms=1,
    trainer_step_ms=50,
    trainer_checkpoint_every=5,
    supervisor_shutdown_grace_ms=1_000,
    stop_grace_s=5.0,
    ready_timeout_s=90.0,
    # The default policy: only autoFailover is set.
    policy=PolicyPatch(auto_failover=True),
)

_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Trial:
    """One fault and what the fleet did."""

    fault: str
    failovers: int
    """``operation.auto_failover`` and promote events, and routing flips, after the fault."""
    visible: bool
    evidence: str
    """What showed the fault (numbers the server or the lab reported)."""
    settled: bool
    """The active domain was ready again, with a fresh heartbeat, and the standby in posture."""
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failovers == 0 and self.visible and self.settled


@dataclass
class LabFleet:
    lab: Lab
    topology: DemoTopology

    def host_of(self, slug: str) -> str:
        return self.lab.hosts[slug].address


@contextlib.asynccontextmanager
async def lab_fleet(lab: Lab, workdir: Path) -> AsyncIterator[LabFleet]:
    """The whole fleet, each host in its own namespace; stopped (and checked) on exit."""
    hosts = {name: lab.host(name) for name in ("server", "alpha", "beta")}
    placements = {
        name: HostPlacement(argv_prefix=tuple(host.argv([])), address=host.address)
        for name, host in hosts.items()
    }
    topology = DemoTopology(TopologyOptions(workdir=workdir, timings=TIMINGS, hosts=placements))
    async with topology:
        yield LabFleet(lab=lab, topology=topology)


async def scrape(topology: DemoTopology) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The server's /metrics as {(name, labels): value}."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"{topology.server_url}/metrics") as response,
    ):
        text = await response.text()
    samples = {}
    for match in _SAMPLE.finditer(text):
        labels = frozenset(_LABEL.findall(match["labels"] or ""))
        with contextlib.suppress(ValueError):
            samples[(match["name"], labels)] = float(match["value"])
    return samples


def metric(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


async def heartbeat_age(topology: DemoTopology, slug: str) -> float:
    samples = await scrape(topology)
    return metric(samples, "haru_domain_heartbeat_age_seconds", domain=slug)


async def last_event_id(topology: DemoTopology) -> int:
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug)
    return events[-1].id if events else 0


async def post_faults(url: str, faults: dict[str, object]) -> None:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(f"{url}/_sim/faults", json=faults) as response,
    ):
        response.raise_for_status()


async def _partition(fleet: LabFleet, slug: str, cursor: int) -> tuple[bool, str]:
    host, server = fleet.lab.hosts[slug], fleet.lab.hosts["server"]
    host.partition(peer=server)
    started = time.monotonic()
    try:
        await asyncio.sleep(PARTITION_S)  # the fault's length, not a wait for an outcome
        cut_s = time.monotonic() - started
        age = await heartbeat_age(fleet.topology, slug)
    finally:
        host.heal()
    # No heartbeat can be answered through the cut, so the age covers it (less a reply that was
    # already on its way when the rules went in).
    return age >= cut_s - 0.3, f"heartbeat age {age:.2f} s after a {cut_s:.2f} s cut"


async def _loss(fleet: LabFleet, slug: str, cursor: int, *, loss_s: float) -> tuple[bool, str]:
    host, server = fleet.lab.hosts[slug], fleet.lab.hosts["server"]
    before = await scrape(fleet.topology)
    host.lose(LOSS, peer=server)
    started, max_age = time.monotonic(), 0.0
    try:
        while time.monotonic() - started < loss_s:
            await asyncio.sleep(0.5)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                max_age = max(max_age, await heartbeat_age(fleet.topology, slug))
        dropped = host.dropped()
    finally:
        host.heal()
    after = await scrape(fleet.topology)
    failures = metric(after, "haru_heartbeat_failures_total", domain=slug) - metric(
        before, "haru_heartbeat_failures_total", domain=slug
    )
    return dropped > 0, (
        f"{dropped} packets dropped; max heartbeat age {max_age:.2f} s, "
        f"{failures:.0f} heartbeat failures"
    )


async def _slow_heartbeat(fleet: LabFleet, slug: str, cursor: int) -> tuple[bool, str]:
    supervisor = fleet.topology.domains[slug].supervisor
    assert supervisor is not None
    os.kill(supervisor.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        await asyncio.sleep(SLOW_HEARTBEAT_S)  # the fault's length
        stopped_s = time.monotonic() - started
        age = await heartbeat_age(fleet.topology, slug)
    finally:
        os.kill(supervisor.pid, signal.SIGCONT)
    return age >= stopped_s - 0.3, f"heartbeat age {age:.2f} s after a {stopped_s:.2f} s stop"


async def _burst_500(fleet: LabFleet, slug: str, cursor: int) -> tuple[bool, str]:
    topology = fleet.topology
    model = topology.domains[slug].models[0]
    server = topology.domains[slug].vllm[model]
    before = await scrape(topology)
    await post_faults(server.control_url, {"error_500": True})
    statuses: list[int] = []
    try:
        client = openai.AsyncOpenAI(
            base_url=f"{topology.server_url}/v1", api_key="none", max_retries=0, timeout=30
        )
        async with client:

            async def one() -> None:
                try:
                    await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "burst"}], max_tokens=4
                    )
                    statuses.append(200)
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)

            await asyncio.gather(*(one() for _ in range(BURST)))
    finally:
        await post_faults(server.control_url, {"error_500": False})
    after = await scrape(topology)
    counted = metric(after, "haru_proxy_requests_total", model=model, status="500") - metric(
        before, "haru_proxy_requests_total", model=model, status="500"
    )
    got = statuses.count(500)
    return got > 0 and counted >= got, (
        f'{got} of {BURST} answered 500; haru_proxy_requests_total{{status="500"}} +{counted:.0f}'
    )


async def _vllm_blip(fleet: LabFleet, slug: str, cursor: int) -> tuple[bool, str]:
    topology = fleet.topology
    servers = list(topology.domains[slug].vllm.values())
    await asyncio.gather(*(post_faults(s.control_url, {"refuse": True}) for s in servers))
    refused = time.monotonic()
    seen = None
    try:
        deadline = refused + 30
        async with topology.control() as client:
            while seen is None and time.monotonic() < deadline:
                events = await fetch_events(client, topology.fleet_slug, after=cursor)
                seen = next((e for e in events if isinstance(e.data, DomainNotReady)), None)
                if seen is None:
                    await asyncio.sleep(0.02)
    finally:
        await asyncio.gather(*(post_faults(s.control_url, {"refuse": False}) for s in servers))
    back_s = time.monotonic() - refused
    if seen is None:
        return False, f"no domain.not_ready within {back_s:.1f} s of refusing"
    return True, f"domain.not_ready seen; listening again {back_s * 1000:.0f} ms after the refusal"


_FAULTS: dict[str, Callable[..., Awaitable[tuple[bool, str]]]] = {
    "partition": _partition,
    "loss": _loss,
    "slow_heartbeat": _slow_heartbeat,
    "burst_500": _burst_500,
    "vllm_blip": _vllm_blip,
}


async def settle(topology: DemoTopology, slug: str, *, after: datetime, timeout_s: float) -> bool:
    """Wait until ``slug`` is ready with a heartbeat newer than ``after`` and the standby is
    in standby posture (the fleet as it was before the fault)."""

    def settled(fleet: object) -> bool:
        from haru_protocol import FleetSnapshot

        assert isinstance(fleet, FleetSnapshot)
        domain = next(d for d in fleet.domains if d.slug == slug)
        others = [d.slug for d in fleet.domains if d.slug != slug]
        return (
            domain.state.value == "ready"
            and domain.last_seen_at is not None
            and domain.last_seen_at > after
            and all(is_standby_posture(fleet, other) for other in others)
        )

    try:
        await topology.wait_for_fleet(settled, what="the fleet to settle", timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - reported as unsettled
        return False
    return True


async def run_trial(fleet: LabFleet, fault: str, *, loss_s: float = LOSS_S) -> Trial:
    """Inject ``fault`` on the active domain under traffic; count failovers after it."""
    topology = fleet.topology
    snapshot = await topology.fleet()
    active = active_slug(snapshot) or topology.initial_active()
    cursor = await last_event_id(topology)
    models = list(topology.domains[active].models)
    inject = _FAULTS[fault]
    kwargs = {"loss_s": loss_s} if fault == "loss" else {}
    async with ChatTraffic(
        topology.server_url,
        fleet=topology.fleet_slug,
        models=models,
        clients=2,
        pause_s=0.1,
        timeout_s=60.0,
    ) as traffic:
        visible, evidence = await inject(fleet, active, cursor, **kwargs)
        ended = datetime.now(UTC)
        settled = await settle(topology, active, after=ended, timeout_s=90.0)
    async with topology.control() as client:
        events = await fetch_events(client, topology.fleet_slug, after=cursor)
    failovers = sum(
        1
        for e in events
        if isinstance(e.data, OperationAutoFailover | OperationRequestedPromote | RoutingSwitched)
    )
    after = await topology.fleet()
    if active_slug(after) != active:
        failovers = max(failovers, 1)
    records = traffic.records
    # Requests the burst itself asked to fail are not the traffic's; the traffic's own 500s from
    # the faulted model during the burst are expected too.
    failed = [r for r in records if not r.ok]
    if fault == "burst_500":
        failed = [r for r in failed if "HTTP 500" not in (r.error or "")]
    return Trial(
        fault=fault,
        failovers=failovers,
        visible=visible,
        evidence=evidence,
        settled=settled,
        requests=len(records),
        failed=len(failed),
        errors=sorted({r.error or "" for r in failed})[:5],
    )


def short(trial: Trial) -> str:
    return replace(trial, errors=trial.errors[:2]).__repr__()
