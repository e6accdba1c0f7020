"""Random fault schedules against a whole local fleet, with invariants checked as it runs.

One schedule: a fleet of 2 or 3 domains (real supervisors, emulated vLLM servers and trainers,
:class:`haru_demo.DemoTopology`), 1 (``sqlite-single``) or 2-3 (``pg-replicas``) ``haru serve``
processes, constant chat traffic through every replica, and a seeded list of faults. Everything
the seed decides is printed in the history's first lines, so ``--seed N --variant V`` replays
the same schedule (timing differs: processes are real).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import aiohttp
from fault_procs import (
    TEMPLATE,
    FaultTopology,
    PgForwarder,
    Recorder,
    RedirectTrap,
    Replica,
    SqliteWriteLock,
    checkpoint_dirs_of,
    clock_offset_file,
    drop_database,
    forged_lines,
    hold_heads,
    hold_slow_clients,
    hostile_requests,
    raw_request,
    restart_supervisor,
    set_clock_offset,
    trainers_in,
)
from haru_db import StateStore
from haru_demo import (
    DemoError,
    DemoTimings,
    DemoTopology,
    TopologyOptions,
    operation_budget_s,
    promote_budget_s,
)
from haru_protocol import (
    Cloud,
    DomainLayout,
    FleetLayout,
    InferenceSlotSpec,
    ModelBinding,
    Operation,
    OperationState,
    Placement,
    PolicyPatch,
    TrainingSlotSpec,
    resolve_policy,
)
from haru_sim.nvidia_smi import trainer_processes

TOKEN = "fault-harness-supervisor-token-0123"
WRONG_TOKEN = "fault-harness-rotated-token-98765"

POLICY = PolicyPatch(
    auto_failover=True,
    heartbeat_stale_ms=2_000,
    degraded_grace_ms=600,
    training_stop_grace_ms=800,
    failover_training_stop_grace_ms=800,
    stop_training_timeout_ms=4_000,
    verify_gpu_timeout_ms=3_000,
    wake_timeout_ms=4_000,
    probe_timeout_ms=3_000,
    switch_active_timeout_ms=3_000,
    sleep_timeout_ms=2_000,
    start_training_timeout_ms=3_000,
)

TIMINGS = DemoTimings(
    sleep_latency_ms=20,
    wake_latency_ms=150,
    first_token_latency_ms=2,
    token_latency_ms=1,
    trainer_step_ms=50,
    trainer_checkpoint_every=5,
    reconcile_interval_ms=300,
    supervisor_shutdown_grace_ms=800,
    stop_grace_s=3.0,
    ready_timeout_s=90.0,
    policy=POLICY,
)

MODEL = "fault-chat"
SETTLE_CONFIRM_S = 1.0
"""The settle check must hold twice this far apart, with no operation created between."""
REPLICA_START_ATTEMPTS = 60
REPLICA_RESTART_DELAY_S = 0.5
"""A killed replica is started again like a restart policy would: up to 60 tries, 0.5 s apart."""
_UNROUTABLE = frozenset({"HTTP 503 no_active_domain", "HTTP 502 upstream_unreachable"})
_NOTABLE = frozenset(
    {
        "operation.auto_failover",
        "operation.restore_demote",
        "operation.failed",
        "operation.promotion_backoff",
        "operation.step.timeout_best_effort",
        "domain.state.changed",
        "domain.degraded.escalated",
        "domain.supervisor.unauthorized",
        "domain.dead_suspected",
        "domain.dead_cleared",
        "server.partitioned",
        "slot.state.changed",
    }
)
VARIANTS = ("pg-replicas", "sqlite-single")


# ---- the schedule ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    kind: str
    target: str  # a domain slug, a replica index, or "store"
    duration_s: float = 0.0
    extra: str = ""

    def describe(self) -> str:
        more = f" {self.extra}" if self.extra else ""
        return f"t+{self.at_s:5.1f}s {self.kind} {self.target} for {self.duration_s:.1f}s{more}"


@dataclass(frozen=True, slots=True)
class Schedule:
    seed: int
    variant: str
    domains: tuple[str, ...]
    replicas: int
    trainer_args: tuple[str, ...]
    faults: tuple[Fault, ...]
    fault_window_s: float
    workers: tuple[tuple[int, int], ...] = ()
    """(replica index, ``HARU_WORKERS``) of the replicas that run several worker processes."""

    def describe(self) -> list[str]:
        workers = " ".join(f"replica{i}={n}" for i, n in self.workers)
        lines = [
            f"seed={self.seed} variant={self.variant} domains={','.join(self.domains)} "
            f"replicas={self.replicas} trainer_args={' '.join(self.trainer_args) or '-'}"
            + (f" workers={workers}" if workers else ""),
        ]
        lines += [f"  fault {f.describe()}" for f in self.faults]
        return lines


_KINDS_ALL = (
    ("promote", 6),
    ("demote", 3),
    ("vllm_crash", 2),
    ("vllm_hang", 2),
    ("vllm_error_500", 2),
    ("vllm_slow_probe", 1),
    ("vllm_wake_fails", 2),
    ("vllm_sleeping_garbage", 1),
    ("supervisor_restart", 2),
    ("supervisor_outage", 2),
    ("token_rotation", 1),
    ("slow_clients", 1),
)
_KINDS_PG = (("replica_kill", 3), ("store_cut", 2), ("store_stall", 2))

CLOCK_JUMP_MS = (400, 1_500)
"""Size range of a clock jump: below every budget of ``POLICY`` but ``degradedGraceMs``
(600 ms, which a jump may shorten to nothing: an earlier escalation, a legal outcome)."""


def _extra_faults(seed: int, variant: str, replicas: int, window_s: float) -> list[Fault]:
    """Faults of the kinds added after the first 52 schedules, from their own random stream
    (so the eight faults a seed drew before stay the same): a clock jump of one replica
    (forward or back, then back to true time) and, on SQLite, a long write transaction."""
    rng = random.Random(f"{variant}:{seed}:extra")
    extra: list[Fault] = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        ms = rng.randint(*CLOCK_JUMP_MS) * rng.choice((-1, 1))
        extra.append(
            Fault(
                round(rng.uniform(0, window_s), 1),
                "clock_jump",
                str(rng.randrange(replicas)),
                round(rng.uniform(1.0, 6.0), 1),
                f"{ms:+d} ms",
            )
        )
    if variant == "sqlite-single":
        for _ in range(rng.choice((0, 1, 1, 2))):
            # Up to past the server's 5 s busy timeout: writes wait, and some fail.
            extra.append(
                Fault(
                    round(rng.uniform(0, window_s), 1),
                    "store_lock",
                    "store",
                    round(rng.uniform(1.0, 7.0), 1),
                    "BEGIN IMMEDIATE held",
                )
            )
    return extra


PAUSE_S = (1.0, 7.0)
"""How long a SIGSTOPped worker or replica stays stopped (below the clients' 10 s timeout: a
request that reached it is answered once it runs again)."""
CLOCK_OFFSET_MS = (2_000, 3 * 3_600_000)
"""Size range of a clock offset (log-uniform, either sign): from past every step budget to
three hours."""
DRILL_SLACK_S = 10.0
"""Failover drill: beyond ``heartbeatStaleMs`` and the promote's step budgets, two ticks whose
heartbeat round waits out the stopped supervisor's call deadline."""
HOSTILE_HEADS = 600
"""Half-sent request heads a hostile client holds open: more than the default connection cap
(``HARU_HTTP_MAX_CONNECTIONS``, 512)."""


def _round_three_faults(
    seed: int, variant: str, replicas: int, domains: tuple[str, ...], window_s: float
) -> tuple[list[Fault], dict[int, int]]:
    """Faults of the third round, from a stream of their own (``<variant>:<seed>:round3``: the
    faults a seed drew before stay the same): a replica running two worker processes, a
    worker or replica SIGSTOPped for a while, a clock offset of any size on one replica, and
    hostile clients beside the schedule. Returns the faults and replica index -> workers."""
    rng = random.Random(f"{variant}:{seed}:round3")
    workers: dict[int, int] = {}
    if rng.random() < 0.5:
        workers[rng.randrange(replicas)] = 2
    faults: list[Fault] = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        target = rng.randrange(replicas)
        what = f"worker {rng.randrange(2)}" if target in workers and rng.random() < 0.8 else ""
        faults.append(
            Fault(
                round(rng.uniform(0, window_s), 1),
                "pause",
                str(target),
                round(rng.uniform(*PAUSE_S), 1),
                what or "whole replica",
            )
        )
    if rng.random() < 0.5:
        low, high = (math.log10(v) for v in CLOCK_OFFSET_MS)
        ms = round(10 ** rng.uniform(low, high)) * rng.choice((-1, 1))
        faults.append(
            Fault(
                round(rng.uniform(0, window_s), 1),
                "clock_offset",
                str(rng.randrange(replicas)),
                round(rng.uniform(2.0, 8.0), 1),
                f"{ms:+d} ms",
            )
        )
    if rng.random() < 0.3:
        where = str(rng.randrange(replicas)) if rng.random() < 0.6 else rng.choice(domains)
        faults.append(
            Fault(
                round(rng.uniform(0, window_s), 1),
                "hostile_clients",
                where,
                round(rng.uniform(2.0, 8.0), 1),
                f"{HOSTILE_HEADS} half-sent heads, non-UTF-8 bearer, CR/LF path"
                + (", redirects" if where.isdigit() else ""),
            )
        )
    return faults, workers


FLAP_PERIOD_S = (0.1, 0.6)
"""A lossy link: the supervisor is stopped and resumed in turns of this length (heartbeats that
time out between ones that answer)."""


def _round_four_faults(seed: int, domains: tuple[str, ...], window_s: float) -> list[Fault]:
    """Faults of the fourth round (evidence-based detection), from a stream of their own
    (``<seed>:evidence``: the faults a seed drew before stay the same): a partition of a
    domain (its supervisor and vLLM servers stopped: every connection times out, which is
    weak evidence), a lossy link (the supervisor stopped and resumed in turns) and a lost host
    (supervisor and vLLM servers SIGKILLed: connections refused, strong evidence)."""
    rng = random.Random(f"{seed}:evidence")
    faults: list[Fault] = []
    for kind, chance in (("partition", 0.4), ("lossy_link", 0.4), ("host_loss", 0.35)):
        if rng.random() < chance:
            faults.append(
                Fault(
                    round(rng.uniform(0, window_s), 1),
                    kind,
                    rng.choice(domains),
                    round(rng.uniform(1.0, 4.0), 1),
                    f"period {rng.uniform(*FLAP_PERIOD_S):.2f}s" if kind == "lossy_link" else "",
                )
            )
    return faults


def make_schedule(
    seed: int, variant: str, *, faults: int = 8, window_s: float = 20.0, evidence: bool = True
) -> Schedule:
    """The schedule of ``seed``; ``evidence`` False leaves out the fourth round's faults (the
    schedule the seed drew before they existed)."""
    rng = random.Random(f"{variant}:{seed}")
    domains = ("alpha", "beta", "gamma")[: rng.choice((2, 3))]
    replicas = rng.choice((2, 3)) if variant == "pg-replicas" else 1
    trainer_args = tuple(
        a for a, p in (("--ignore-sigterm", 0.3), ("--spawn-child", 0.3)) if rng.random() < p
    )
    kinds = list(_KINDS_ALL) + (list(_KINDS_PG) if variant == "pg-replicas" else [])
    names = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    chosen: list[Fault] = []
    for _ in range(faults):
        kind = rng.choices(names, weights)[0]
        at = round(rng.uniform(0, window_s), 1)
        duration = round(rng.uniform(0.5, 4.0), 1)
        if kind in ("promote", "demote"):
            target = rng.choice(domains)
            extra = f"via replica {rng.randrange(replicas)}"
            duration = 0.0
        elif kind == "replica_kill":
            target = str(rng.randrange(replicas))
            extra = ""
        elif kind in ("store_cut", "store_stall"):
            target, extra = "store", ""
        elif kind == "slow_clients":
            target, extra = str(rng.randrange(replicas)), "40 connections"
        else:
            target, extra = rng.choice(domains), ""
        chosen.append(Fault(at, kind, target, duration, extra))
    chosen += _extra_faults(seed, variant, replicas, window_s)
    third, workers = _round_three_faults(seed, variant, replicas, domains, window_s)
    chosen += third
    if evidence:
        chosen += _round_four_faults(seed, domains, window_s)
    chosen.sort(key=lambda f: f.at_s)
    return Schedule(
        seed,
        variant,
        domains,
        replicas,
        trainer_args,
        tuple(chosen),
        window_s,
        tuple(sorted(workers.items())),
    )


def _processes_in(folder: Path) -> list[int]:
    """Pids of live processes whose working directory is ``folder`` or inside it (Linux)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == str(folder) or cwd.startswith(f"{folder}{os.sep}"):
            found.append(int(entry.name))
    return found


def fleet_shape(domains: tuple[str, ...]) -> FleetLayout:
    """A small fleet: each domain has one model on GPU 0 and a training slot on GPU 0."""
    return FleetLayout(
        slug="faults",
        display_name="fault schedule fleet",
        active_domain_slug=domains[0],
        policy=POLICY,
        domains=tuple(
            DomainLayout(
                slug=slug,
                placement=Placement(
                    cloud=Cloud.AWS, region="local", accelerator="EXAMPLE-GPU", accelerator_count=1
                ),
                supervisor_url=f"http://127.0.0.1:{9000 + i}",
                serving_base_url=f"http://127.0.0.1:{9100 + i}",
                slots=(
                    InferenceSlotSpec(
                        gpu_index=0,
                        models=(
                            ModelBinding(name=MODEL, serving_url=f"http://127.0.0.1:{9200 + i}"),
                        ),
                    ),
                    TrainingSlotSpec(
                        gpu_index=0,
                        command=("haru-sim-trainer",),
                        checkpoint_dir=f"/var/lib/haru/checkpoints/{slug}",
                    ),
                ),
            )
            for i, slug in enumerate(domains)
        ),
    )


# ---- history ---------------------------------------------------------------------------------


class History:
    """A compact, readable log of one schedule: faults, operations, checks, violations."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self.violations: list[str] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, kind: str, text: str) -> None:
        self.lines.append(f"{self.now():7.2f} {kind:<10} {text}")

    def violation(self, name: str, text: str) -> None:
        self.violations.append(f"{name}: {text}")
        self.note("VIOLATION", f"{name}: {text}")

    def write(self) -> None:
        self.path.write_text("\n".join(self.lines) + "\n", encoding="utf-8")


# ---- traffic ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    replica: int
    start: float
    end: float
    ok: bool
    cause: str = ""
    stale: bool = False


class Traffic:
    """Chat clients on every replica, each outcome recorded (monotonic times of the history)."""

    def __init__(self, replicas: list[Replica], history: History, *, per_replica: int = 2) -> None:
        self.replicas = replicas
        self.history = history
        self.per_replica = per_replica
        self.outcomes: list[Outcome] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    def start(self) -> None:
        for replica in self.replicas:
            for _ in range(self.per_replica):
                self._tasks.append(asyncio.create_task(self._client(replica)))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, replica: Replica) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        timeout = aiohttp.ClientTimeout(total=10.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                start = self.history.now()
                outcome = Outcome(replica.index, start, start, ok=False)
                try:
                    async with session.post(
                        f"{replica.url}/v1/chat/completions", json=body
                    ) as response:
                        raw = await response.read()
                        outcome.stale = response.headers.get("X-Haru-Routing") == "stale"
                        if response.status == 200:
                            outcome.ok = bool(json.loads(raw).get("choices"))
                            outcome.cause = "" if outcome.ok else "empty answer"
                        else:
                            code = ""
                            with contextlib.suppress(ValueError, AttributeError):
                                code = json.loads(raw).get("error", {}).get("code", "")
                            outcome.cause = f"HTTP {response.status} {code}".strip()
                except aiohttp.ClientConnectorError:
                    outcome.cause = "connect refused"
                except (aiohttp.ClientError, OSError) as exc:
                    outcome.cause = f"connection {type(exc).__name__}"
                except TimeoutError:
                    outcome.cause = "timeout"
                outcome.end = self.history.now()
                self.outcomes.append(outcome)
                await asyncio.sleep(0.2 if not outcome.ok else 0.05)


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Window:
    kind: str
    target: str
    start: float
    end: float = float("inf")


@dataclass
class Result:
    schedule: Schedule
    violations: list[str]
    history_path: Path
    requests: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    excused: dict[str, int] = field(default_factory=dict)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    operations: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    """Wall seconds per phase: start (fleet up), faults, settle, checks, close."""

    def summary(self) -> str:
        status = "OK" if not self.violations else f"{len(self.violations)} VIOLATION(S)"
        return (
            f"seed={self.schedule.seed} variant={self.schedule.variant} {status} "
            f"requests={self.requests} failed={sum(self.failures.values())} "
            f"(excused {sum(self.excused.values())}: {dict(self.excused)}; "
            f"unexcused: {dict(self.failures)}) p50={self.p50_ms:.1f}ms p99={self.p99_ms:.1f}ms "
            f"operations={self.operations} "
            f"phases={' '.join(f'{k}={v:.1f}s' for k, v in self.phases.items())} "
            f"history={self.history_path}"
        )


class Run:
    def __init__(
        self, schedule: Schedule, workdir: Path, admin_url: str | None, *, hold: bool = False
    ) -> None:
        self.schedule = schedule
        self.workdir = workdir
        self.admin_url = admin_url
        self.history = History(workdir / "history.txt")
        self.topology: FaultTopology | None = None
        self.replicas: list[Replica] = []
        self.forwarder: PgForwarder | None = None
        self.store: StateStore | None = None
        self.fleet_id: UUID | None = None
        self.windows: list[Window] = []
        self.db_name: str | None = None
        self.slug_of: dict[UUID, str] = {}
        self.id_of: dict[str, UUID] = {}
        self.pointers: list[tuple[float, UUID | None, int]] = []
        self.awake_counts: dict[tuple[str, int], int] = {}
        self.requested = 0
        self.faults_end = 0.0
        self.hold = hold
        self.unplanned: list[tuple[float, float]] = []
        self.database_path: Path | None = None
        # The largest clock offset a replica ran with: wall-clock times written by it (operation
        # and step starts, backoff ends) may be off by this much.
        self.max_skew_s = 0.0
        self.phases: dict[str, float] = {}
        # When each replica (re)started listening, history time, per replica index: a replica's
        # route cache is cold from then until its first routed request.
        self.starts: dict[int, list[float]] = defaultdict(list)
        self.outcomes: list[Outcome] = []
        self._process_locks: dict[str, asyncio.Lock] = {}
        # When the monitor first saw each operation, and last saw it pending or running, in
        # history time (the harness's monotonic clock: the one time source of the "decision
        # delayed" invariant).
        self.op_seen: dict[UUID, float] = {}
        self.op_running: dict[UUID, float] = {}
        hostile = any(f.kind == "hostile_clients" for f in schedule.faults)
        self.trap = RedirectTrap() if hostile else None
        self.recorder = Recorder() if hostile else None
        self.forged = f"FORGED-{schedule.seed}-{os.getpid()}"
        """What a client-made log line would begin with (the CR/LF path's payload)."""
        self.hostile_5xx: list[tuple[float, str, str]] = []
        self.healthz_failures: list[tuple[float, str, str]] = []

    # -- set-up ---------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.schedule
        timings = dataclasses.replace(TIMINGS, trainer_extra_args=s.trainer_args)
        direct_url: str
        server_url: str | None = None
        if s.variant == "pg-replicas":
            assert self.admin_url is not None, "pg-replicas needs a PostgreSQL URL"
            self.db_name = f"haru_faults_{os.getpid()}_{s.seed}"
            direct_url = await TEMPLATE.copy(self.admin_url, self.db_name)
            from sqlalchemy.engine import make_url

            target = make_url(direct_url)
            self.forwarder = PgForwarder(
                target.host or "127.0.0.1",
                target.port or 5432,
                note=lambda text: self.history.note("forwarder", text),
            )
            await self.forwarder.start()
            server_url = target.set(host="127.0.0.1", port=self.forwarder.port).render_as_string(
                hide_password=False
            )
        else:
            direct_url = str(self.workdir / "fleet" / "haru.db")
        if self.recorder is not None:
            await self.recorder.start()
        self.topology = FaultTopology(
            TopologyOptions(
                workdir=self.workdir / "fleet",
                database_url=server_url,
                timings=timings,
                supervisor_token=TOKEN,
                layout=fleet_shape(s.domains),
            ),
            workers=dict(s.workers),
            trap=self.trap,
        )
        (self.workdir / "fleet" / "logs").mkdir(parents=True, exist_ok=True)
        # The extra replicas boot while the fleet starts (the database is already migrated: a
        # copy of the template); their loops find the fleet once it is seeded.
        others = [Replica(self.topology, i, server_url) for i in range(1, s.replicas)]
        self.replicas = others
        await asyncio.gather(self.topology.start(), *(r.start() for r in others))
        assert self.topology.server is not None
        first = Replica(self.topology, 0, server_url)
        first.process, first.port = self.topology.server, self.topology.server_port
        self.replicas = [first, *others]
        for replica in self.replicas:
            self.starts[replica.index].append(self.history.now())
        self.database_path = None if s.variant == "pg-replicas" else Path(direct_url)
        self.store = StateStore.open(direct_url)
        fleet = await self.store.get_fleet_snapshot("faults")
        assert fleet is not None
        self.fleet_id = fleet.id
        self.slug_of = {d.id: d.slug for d in fleet.domains}
        self.id_of = {d.slug: d.id for d in fleet.domains}
        self.history.note("start", f"replicas at {[r.url for r in self.replicas]}")

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        # The verdicts are in: no replica needs a graceful shutdown (SIGTERM waits for its
        # connections to drain, seconds per schedule).
        await asyncio.gather(*(r.kill() for r in self.replicas), return_exceptions=True)
        if self.topology is not None:
            await self.topology.close()
        if self.forwarder is not None:
            await self.forwarder.close()
        if self.trap is not None:
            await self.trap.close()
        if self.recorder is not None:
            await self.recorder.close()
        if self.db_name is not None and self.admin_url is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(drop_database, self.admin_url, self.db_name)

    # -- faults ---------------------------------------------------------------------------------

    async def _sim_faults(self, slug: str, faults: dict[str, Any] | None) -> None:
        assert self.topology is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for server in self.topology.domains[slug].vllm.values():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    if faults is None:
                        await session.delete(f"{server.url}/_sim/faults")
                    else:
                        await session.post(f"{server.url}/_sim/faults", json=faults)

    async def _pointer_slug(self) -> str | None:
        assert self.store is not None
        with contextlib.suppress(Exception):
            pointer = await self.store.get_fleet_route_pointer("faults")
            if pointer is not None and pointer.active_domain_id is not None:
                return self.slug_of.get(pointer.active_domain_id)
        return None

    async def _request(self, kind: str, slug: str, replica: int) -> None:
        url = f"{self.replicas[replica].url}/v1/fleets/faults/{kind}"
        self.requested += 1
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                session.post(url, json={"targetDomainId": str(self.id_of[slug])}) as response,
            ):
                text = (await response.text())[:160]
                self.history.note(
                    "request", f"{kind} {slug} via {replica}: {response.status} {text}"
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.history.note("request", f"{kind} {slug} via {replica}: {type(exc).__name__}")

    def _process_of(self, fault: Fault) -> str | None:
        """The process a fault stops and starts again, if any (faults on one process run one
        after the other: two restarts of one supervisor at once would start two on its port,
        and the one left untracked would keep serving, with whatever token it had)."""
        if fault.kind in (
            "supervisor_restart",
            "supervisor_outage",
            "token_rotation",
            "lossy_link",
        ):
            return f"supervisor {fault.target}"
        if fault.kind == "vllm_crash":
            return f"vllm {fault.target}"
        if fault.kind in ("replica_kill", "pause"):
            return f"replica {fault.target}"
        if fault.kind in ("clock_jump", "clock_offset"):
            # Each resets the offset file to 0 when it ends: one at a time per replica.
            return f"clock {fault.target}"
        return None

    async def _restart_replica(self, replica: Replica) -> None:
        """Start a killed replica again, as the deployment's restart policy does.

        ``haru serve`` migrates the store before it listens, so a replica started while the
        store is cut or stalled exits 1 (``cannot start: state store``); a restart policy
        (``restart: unless-stopped`` in deploy/compose.yaml) starts it again. Until it listens
        it is down, and the fault's window (traffic to it excused) lasts that long.
        """
        for attempt in range(1, REPLICA_START_ATTEMPTS + 1):
            try:
                await replica.start()
            except DemoError as exc:
                if attempt == REPLICA_START_ATTEMPTS:
                    raise
                reason = str(exc).splitlines()[0]
                self.history.note(
                    "fault",
                    f"replica {replica.index} did not start (attempt {attempt}): {reason}; "
                    f"restarting in {REPLICA_RESTART_DELAY_S:g}s",
                )
                await asyncio.sleep(REPLICA_RESTART_DELAY_S)
                continue
            self.starts[replica.index].append(self.history.now())
            return

    async def apply(self, fault: Fault) -> None:
        processes = self._processes_of(fault)
        async with contextlib.AsyncExitStack() as held:
            for process in processes:  # sorted: no two faults wait for each other
                lock = self._process_locks.setdefault(process, asyncio.Lock())
                if lock.locked():
                    self.history.note(
                        "fault", f"{fault.kind} waits: a fault on {process} is running"
                    )
                await held.enter_async_context(lock)
            await self._apply(fault)

    def _processes_of(self, fault: Fault) -> tuple[str, ...]:
        if fault.kind in ("partition", "host_loss"):
            return (f"supervisor {fault.target}", f"vllm {fault.target}")
        process = self._process_of(fault)
        return () if process is None else (process,)

    async def _apply(self, fault: Fault) -> None:
        assert self.topology is not None
        topo = self.topology
        self.history.note("fault", fault.describe())
        window = Window(fault.kind, fault.target, self.history.now())
        if fault.kind in ("promote", "demote"):
            await self._request(fault.kind, fault.target, int(fault.extra.rsplit(" ", 1)[1]))
            return
        self.windows.append(window)
        try:
            await self._apply_for(fault, topo)
        finally:
            window.end = self.history.now()
            self.history.note("fault-end", f"{fault.kind} {fault.target}")

    async def _apply_for(self, fault: Fault, topo: DemoTopology) -> None:  # noqa: C901 - per kind
        d = fault.duration_s
        slug = fault.target
        if fault.kind == "vllm_crash":
            await self.check_sims()  # its counters go with it
            await topo.kill_vllm(slug)
            await asyncio.sleep(d)
            # A restarted vLLM comes up in the mode its role implies (an operator's unit file).
            asleep = await self._pointer_slug() != slug
            await topo.restart_vllm(slug, asleep=asleep)
            self.history.note(
                "fault", f"vllm of {slug} restarted {'asleep' if asleep else 'awake'}"
            )
        elif fault.kind.startswith("vllm_"):
            knobs: dict[str, dict[str, Any]] = {
                "vllm_hang": {"hang": True},
                "vllm_error_500": {"error_500": True},
                "vllm_slow_probe": {"slow_first_token_ms": 4_000},
                "vllm_wake_fails": {"wake_fails": True},
                "vllm_sleeping_garbage": {"is_sleeping_garbage": True},
            }
            knob = knobs[fault.kind]
            await self._sim_faults(slug, knob)
            await asyncio.sleep(d)
            await self._sim_faults(slug, None)
        elif fault.kind == "supervisor_restart":
            await restart_supervisor(topo, slug, token=TOKEN)
        elif fault.kind in ("partition", "lossy_link", "host_loss"):
            await self._network_fault(fault, topo)
        elif fault.kind == "supervisor_outage":
            supervisor = topo.domains[slug].supervisor
            assert supervisor is not None
            supervisor.signal_group(signal.SIGSTOP)
            try:
                await asyncio.sleep(d)
            finally:
                supervisor.signal_group(signal.SIGCONT)
        elif fault.kind == "token_rotation":
            await restart_supervisor(topo, slug, token=WRONG_TOKEN)
            await asyncio.sleep(d)
            await restart_supervisor(topo, slug, token=TOKEN)
        elif fault.kind == "slow_clients":
            held = await hold_slow_clients(self.replicas[int(slug)].port, 40, d)
            self.history.note("fault", f"{held} slow connections held")
        elif fault.kind == "replica_kill":
            replica = self.replicas[int(slug)]
            if replica.running:
                await replica.kill()
                await asyncio.sleep(d)
                await self._restart_replica(replica)
                if replica.index == 0:
                    topo.server = replica.process
        elif fault.kind in ("store_cut", "store_stall"):
            assert self.forwarder is not None
            (self.forwarder.cut if fault.kind == "store_cut" else self.forwarder.stall)()
            await asyncio.sleep(d)
            self.forwarder.restore()
            if self.forwarder.refused:
                self.history.note("fault", f"{self.forwarder.refused} connections refused so far")
        elif fault.kind == "store_lock":
            assert self.database_path is not None
            lock = SqliteWriteLock(self.database_path)
            await lock.acquire()
            self.history.note("fault", "write lock held")
            try:
                await asyncio.sleep(d)
            finally:
                await lock.release()
        elif fault.kind == "pause":
            await self._pause(fault)
        elif fault.kind == "hostile_clients":
            await self._hostile(fault)
        elif fault.kind in ("clock_jump", "clock_offset"):
            offset_ms = float(fault.extra.split()[0])
            path = clock_offset_file(topo.workdir, int(slug))
            # The store-time checks (over-budget, backoff) compare times different processes
            # wrote: their slack grows by the offset; "decision-delayed" needs none.
            self.max_skew_s = max(self.max_skew_s, abs(offset_ms) / 1000)
            set_clock_offset(path, offset_ms)
            try:
                await asyncio.sleep(d)
            finally:
                set_clock_offset(path, 0)

    async def _network_fault(self, fault: Fault, topo: DemoTopology) -> None:
        """A domain cut off (``partition``: its supervisor and vLLM servers SIGSTOPped, so
        every connection to them times out), a lossy link to its supervisor (``lossy_link``:
        stopped and resumed in turns) or its host lost (``host_loss``: supervisor and vLLM
        servers SIGKILLed, so connections are refused; started again afterwards, the vLLM
        servers in the mode the domain's role implies)."""
        slug, d = fault.target, fault.duration_s
        domain = topo.domains[slug]
        supervisor = domain.supervisor
        assert supervisor is not None
        if fault.kind == "host_loss":
            await self.check_sims()  # its counters go with it
            await asyncio.gather(supervisor.kill(), topo.kill_vllm(slug))
            # Everything else the host ran goes with it: its trainers (and their children), which
            # work in the domain's folder.
            left = _processes_in(topo.workdir / slug)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self.history.note(
                "fault", f"host of {slug} lost (supervisor, vLLM and {len(left)} more killed)"
            )
            await asyncio.sleep(d)
            asleep = await self._pointer_slug() != slug
            await topo.restart_vllm(slug, asleep=asleep)
            await restart_supervisor(topo, slug, token=TOKEN)
            self.history.note(
                "fault", f"host of {slug} back, vLLM {'asleep' if asleep else 'awake'}"
            )
            return
        if fault.kind == "partition":
            procs = [supervisor, *(s.process for s in domain.vllm.values())]
            for proc in procs:
                proc.signal_group(signal.SIGSTOP)
            try:
                await asyncio.sleep(d)
            finally:
                for proc in procs:
                    proc.signal_group(signal.SIGCONT)
            return
        period = float(fault.extra.split()[1].rstrip("s"))
        end = self.history.now() + d
        try:
            while self.history.now() < end:
                supervisor.signal_group(signal.SIGSTOP)
                await asyncio.sleep(period)
                supervisor.signal_group(signal.SIGCONT)
                await asyncio.sleep(period)
        finally:
            supervisor.signal_group(signal.SIGCONT)

    async def _pause(self, fault: Fault) -> None:
        """SIGSTOP one worker process of a replica (``HARU_WORKERS`` > 1) or the whole replica
        for the fault's duration, then SIGCONT: a process descheduled, swapped out or stopped
        under a debugger that resumes with whatever it had cached."""
        replica = self.replicas[int(fault.target)]
        if not replica.running:
            self.history.note("fault", f"replica {replica.index} is down: nothing to pause")
            return
        workers = await replica.worker_pids()
        if fault.extra.startswith("worker") and workers:
            pid = workers[int(fault.extra.split()[1]) % len(workers)]

            def send(signum: signal.Signals) -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

            what = f"worker pid {pid} of replica {replica.index}"
        else:

            def send(signum: signal.Signals) -> None:
                replica.signal_all(signum, workers)

            what = f"replica {replica.index} (pids {[replica.process.pid, *workers]})"  # type: ignore[union-attr]
        send(signal.SIGSTOP)
        self.history.note("fault", f"stopped {what}")
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            send(signal.SIGCONT)

    async def _hostile(self, fault: Fault) -> None:
        """Hostile clients beside the schedule, from another peer address (:data:`HOSTILE_PEER`)
        than the good ones: half-sent heads held past the connection cap, a bearer token that
        is not UTF-8, a path with encoded CR/LF, and (through a replica) chats the trap answers
        with a redirect to the recorder or to a sleeping server. Meanwhile ``/healthz`` is
        asked from the good peer on a new connection every 0.3 s."""
        assert self.topology is not None
        if fault.target.isdigit():
            replica = self.replicas[int(fault.target)]
            port, name = replica.port, f"replica {fault.target}"
        else:
            url = self.topology.domains[fault.target].supervisor_url
            port, name = int(url.rsplit(":", 1)[1]), f"supervisor {fault.target}"
        redirect_ids: list[int] = []
        trap = self.trap if fault.target.isdigit() else None
        if trap is not None and self.recorder is not None:
            trap.locations[0] = f"{self.recorder.url}/sleep"
            redirect_ids += [0, 1]
        requests = hostile_requests(port, self.forged, redirect_ids)
        statuses: Counter[str] = Counter()
        stop = asyncio.Event()

        async def attack() -> None:
            while not stop.is_set():
                if trap is not None:
                    # Location 1: a server asleep right now (else the marked chat goes through).
                    asleep = await self._sleeping_server()
                    if asleep is None:
                        trap.locations.pop(1, None)
                    else:
                        trap.locations[1] = f"{asleep}/v1/chat/completions"
                for label, raw in requests:
                    status = await raw_request(port, raw)
                    statuses[f"{label}: {status}"] += 1
                    if status == 500:
                        self.hostile_5xx.append((self.history.now(), name, label))
                await asyncio.sleep(0.3)

        async def health() -> None:
            # A new connection each time: a kept-alive one would hide a locked-out listener.
            connector = aiohttp.TCPConnector(force_close=True)
            timeout = aiohttp.ClientTimeout(total=2)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                while not stop.is_set():
                    at = self.history.now()
                    why = ""
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                            if response.status != 200:
                                why = f"HTTP {response.status}"
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        why = type(exc).__name__
                    if why:
                        self.healthz_failures.append((at, fault.target, why))
                    await asyncio.sleep(0.3)

        helpers = [asyncio.create_task(attack()), asyncio.create_task(health())]
        try:
            held = await hold_heads(port, HOSTILE_HEADS, fault.duration_s)
        finally:
            stop.set()
            await asyncio.gather(*helpers, return_exceptions=True)
        self.history.note(
            "fault", f"hostile on {name}: {held} half-sent heads held; answers {dict(statuses)}"
        )

    async def _sleeping_server(self) -> str | None:
        """The URL of an emulated vLLM server that says it is asleep, or None."""
        assert self.topology is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
            for domain in self.topology.domains.values():
                for server in domain.vllm.values():
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                        async with session.get(f"{server.url}/_sim/state") as response:
                            if (await response.json()).get("sleeping") is True:
                                return server.url
        return None

    # -- continuous checks ----------------------------------------------------------------------

    async def check_sims(self, session: aiohttp.ClientSession | None = None) -> None:
        """No emulated vLLM server counts a request that arrived while it slept (per process:
        a restarted server counts from 0)."""
        assert self.topology is not None
        if session is None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as own:
                await self.check_sims(own)
            return
        for domain in self.topology.domains.values():
            for server in domain.vllm.values():
                with contextlib.suppress(Exception):
                    async with session.get(f"{server.url}/_sim/state") as response:
                        state = await response.json()
                    key = (f"{domain.slug}/{server.name}", server.process.pid)
                    count = int(state["counters"]["arrived_while_sleeping"])
                    if count > self.awake_counts.get(key, 0):
                        self.history.violation(
                            "forwarded-to-asleep",
                            f"{key[0]} (pid {key[1]}) counted {count} request(s) that "
                            "arrived while it slept",
                        )
                        self.awake_counts[key] = count

    async def monitor(self, stop: asyncio.Event) -> None:
        assert self.store is not None
        assert self.fleet_id is not None
        assert self.topology is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    asked = self.history.now()
                    recent = await self.store.list_recent_operations(self.fleet_id, limit=50)
                    for op in recent:
                        self.op_seen.setdefault(op.id, asked)
                        if op.state in (OperationState.PENDING, OperationState.RUNNING):
                            # Still running when the read began: it ended later than this.
                            self.op_running[op.id] = asked
                    in_flight = [
                        o
                        for o in recent
                        if o.state in (OperationState.PENDING, OperationState.RUNNING)
                    ]
                    if len(in_flight) > 1:
                        self.history.violation(
                            "one-in-flight", f"{len(in_flight)} in flight: {in_flight}"
                        )
                    pointer = await self.store.get_fleet_route_pointer("faults")
                    if pointer is not None:
                        last = self.pointers[-1] if self.pointers else None
                        now = (pointer.active_domain_id, pointer.route_revision)
                        if last is None or (last[1], last[2]) != now:
                            self.pointers.append((self.history.now(), *now))
                            slug = self.slug_of.get(pointer.active_domain_id)  # type: ignore[arg-type]
                            self.history.note(
                                "pointer", f"-> {slug} revision {pointer.route_revision}"
                            )
                await self.check_sims(session)
                await asyncio.sleep(0.15)

    # -- the schedule ---------------------------------------------------------------------------

    async def run(self, settle_s: float) -> Result:
        for line in self.schedule.describe():
            self.history.note("schedule", line)
        await self.start()
        self.phases["start"] = self.history.now()
        traffic = Traffic(self.replicas, self.history)
        stop = asyncio.Event()
        monitor = asyncio.create_task(self.monitor(stop))
        traffic.start()
        t0 = self.history.now()
        tasks = []
        for fault in self.schedule.faults:
            delay = t0 + fault.at_s - self.history.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.apply(fault)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for fault, outcome in zip(self.schedule.faults, results, strict=True):
            if isinstance(outcome, BaseException):
                self.history.note("harness", f"fault {fault.kind} raised {outcome!r}")
        self.faults_end = self.history.now()
        self.phases["faults"] = self.faults_end - t0
        self.history.note("faults", "every fault cleared; settling")
        settled = await self.settle(settle_s)
        self.phases["settle"] = self.history.now() - self.faults_end
        await traffic.stop()
        if any(f.kind == "clock_offset" for f in self.schedule.faults):
            drill_start = self.history.now()
            await self.failover_drill(settle_s)
            self.phases["drill"] = self.history.now() - drill_start
        stop.set()
        await monitor
        checks_start = self.history.now()
        await self.check_sims()
        await self.final_checks(settled)
        self._check_decisions()
        await self._check_hostile()
        self.phases["checks"] = self.history.now() - checks_start
        return self.result(traffic)

    async def failover_drill(self, settle_s: float) -> None:
        """After a clock offset, a decision that reads stored times must come in its bound.

        Once settled (traffic stopped, the monitor still running), the active's supervisor is
        stopped (SIGSTOP): its heartbeats go stale and an automatic failover must move the route
        pointer away within ``heartbeatStaleMs`` + the promote's step budgets +
        :data:`DRILL_SLACK_S` + the longest promotion backoff announced so far (a duration from
        the event, started before the drill), all on the harness's monotonic clock. A stored
        heartbeat, finish or backoff time from the future (written while a replica's clock ran
        ahead) that holds the failover back is a ``decision-delayed`` violation. Then the
        supervisor resumes and the fleet must settle again.
        """
        assert self.topology is not None
        active = await self._pointer_slug()
        supervisor = self.topology.domains[active].supervisor if active else None
        if active is None or supervisor is None:
            self.history.note("drill", "no active domain to stop; no drill")
            return
        policy = resolve_policy(POLICY)
        backoff_s = await self._announced_backoff_s()
        bound = (
            policy.heartbeat_stale_ms / 1000 + promote_budget_s(policy) + DRILL_SLACK_S + backoff_s
        )
        started = self.history.now()
        window = Window("supervisor_outage", active, started)
        self.windows.append(window)
        supervisor.signal_group(signal.SIGSTOP)
        self.history.note(
            "drill", f"{active}'s supervisor stopped: a failover is due within {bound:.1f}s"
        )
        moved: str | None = None
        try:
            while self.history.now() - started < bound:
                slug = await self._pointer_slug()
                if slug is not None and slug != active:
                    moved = slug
                    break
                await asyncio.sleep(0.1)
        finally:
            supervisor.signal_group(signal.SIGCONT)
            window.end = self.history.now()
        took = window.end - started
        if moved is None:
            self.history.violation(
                "decision-delayed",
                f"no failover away from {active} within {bound:.1f}s of its supervisor stopping "
                "(harness clock)",
            )
        else:
            self.history.note("drill", f"failover to {moved} after {took:.1f}s; settling again")
        await self.settle(settle_s, since=window.end)

    async def _announced_backoff_s(self) -> float:
        """The longest automatic-promotion backoff the fleet announced so far (its duration)."""
        assert self.store is not None
        try:
            events = await self._all_events()
        except Exception:  # noqa: BLE001 - then no backoff is allowed for
            return 0.0
        return max(
            (
                int(e.payload.get("delayMs", 0)) / 1000
                for e in events
                if e.type == "operation.promotion_backoff"
            ),
            default=0.0,
        )

    async def settle(self, bound_s: float, *, since: float | None = None) -> str | None:
        """Wait until the fleet matches its supervisors; returns the last mismatch, or None.

        Settled means matching twice, :data:`SETTLE_CONFIRM_S` apart, with no operation
        created in between: a reconciler that acts right after the first match (an operation
        queued by a tick that was already running) is waited for, not judged mid-flight.
        """
        deadline = self.history.now() + bound_s
        mismatch: str | None = "never checked"
        matched: tuple[float, UUID | None] | None = None
        while self.history.now() < deadline:
            mismatch = await self.mismatch()
            newest = await self._newest_operation() if mismatch is None else None
            if mismatch is not None:
                matched = None
            elif matched is not None and matched[1] == newest:
                if self.history.now() - matched[0] >= SETTLE_CONFIRM_S:
                    began = self.faults_end if since is None else since
                    self.history.note("settled", f"after {matched[0] - began:.1f}s")
                    return None
            else:
                if matched is not None:
                    self.history.note("settle", "an operation was created meanwhile; again")
                matched = (self.history.now(), newest)
            await asyncio.sleep(SETTLE_CONFIRM_S if matched is not None else 0.5)
        self.history.violation("settle", f"not settled {bound_s:.0f}s after faults: {mismatch}")
        return mismatch

    async def _newest_operation(self) -> UUID | None:
        assert self.store is not None
        assert self.fleet_id is not None
        try:
            recent = await self.store.list_recent_operations(self.fleet_id, limit=1)
        except Exception:  # noqa: BLE001 - the next round asks again
            return None
        return recent[0].id if recent else None

    async def mismatch(self) -> str | None:  # noqa: C901 - one check per line of the invariant
        assert self.store is not None
        assert self.topology is not None
        try:
            fleet = await self.store.get_fleet_snapshot("faults")
            in_flight = await self.store.get_in_flight_operation(self.fleet_id)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - reported as the mismatch
            return f"store: {exc!r}"
        if fleet is None:
            return "fleet missing"
        if in_flight is not None:
            return f"operation {in_flight.kind.value} in flight at {in_flight.current_step}"
        if fleet.active_domain_id is None:
            return "no active domain"
        # A /proc scan: off the loop, which also runs the PostgreSQL forwarder and the traffic.
        strays = await asyncio.to_thread(trainer_processes)
        for domain in fleet.domains:
            active = domain.id == fleet.active_domain_id
            if domain.state.value != "ready":
                return f"{domain.slug} is {domain.state.value}"
            states = await self.topology.vllm_states(domain.slug)
            for name, state in states.items():
                if state is None:
                    return f"{domain.slug}/{name} does not answer"
                if bool(state["sleeping"]) == active:
                    return f"{domain.slug}/{name} sleeping={state['sleeping']} (active={active})"
            for slot in domain.slots:
                want = (
                    ("serving" if active else "sleeping")
                    if slot.inference_spec
                    else ("idle" if active else "training")
                )
                if slot.state.value != want:
                    return (
                        f"{domain.slug} {slot.kind.value} slot is {slot.state.value}, want {want}"
                    )
            try:
                status = await self.topology.training_status(domain.slug)
            except Exception as exc:  # noqa: BLE001
                return f"{domain.slug} training status: {exc}"
            for run in status.slots:
                running = run.state.value == "running" and bool(run.pids)
                if running == active:
                    return f"{domain.slug} training gpu{run.gpu_index} is {run.state.value}"
            if active:
                held = trainers_in(strays, checkpoint_dirs_of(self.topology, domain.slug))
                if held:
                    return f"{domain.slug} (active) still has trainer processes {held}"
        return None

    # -- end checks -----------------------------------------------------------------------------

    async def _all_events(self) -> list[Any]:
        assert self.store is not None
        assert self.fleet_id is not None
        events: list[Any] = []
        after = 0
        while True:
            page = await self.store.list_events(self.fleet_id, after=after, limit=500)
            events += page
            if len(page) < 500:
                return events
            after = page[-1].id

    async def final_checks(self, settled: str | None) -> None:  # noqa: C901 - one per invariant
        assert self.store is not None
        assert self.fleet_id is not None
        events = await self._all_events()
        ops = await self.store.list_recent_operations(self.fleet_id, limit=10_000)
        self.operations = ops
        by_op: dict[UUID, list[Any]] = defaultdict(list)
        for event in events:
            if event.operation_id is not None:
                by_op[event.operation_id].append(event)
        start_wall = self._start_wall()
        for event in events:
            if event.type in _NOTABLE and event.created_at >= start_wall:
                at = (event.created_at - start_wall).total_seconds()
                slug = self.slug_of.get(event.domain_id) if event.domain_id else ""
                payload = json.dumps(event.payload, separators=(",", ":"))[:200]
                self.history.note("event", f"@{at:6.2f} {event.type} {slug or ''} {payload}")
        budget = operation_budget_s(resolve_policy(POLICY)) + 3.0 + self.max_skew_s
        t_end = datetime.now(UTC)
        faults_end_wall = t_end - timedelta(seconds=self.history.now() - self.faults_end)
        for op in sorted(ops, key=lambda o: o.created_at):
            evs = by_op[op.id]
            err = f" {op.error.step and op.error.step.value}:{op.error.code}" if op.error else ""
            self.history.note(
                "operation",
                f"{op.kind.value} -> {self.slug_of.get(op.target_domain_id)} {op.state.value}"
                f"{err} committed={op.routing_committed} "
                f"steps={[e.payload.get('step') for e in evs if e.type == 'operation.step.done']}",
            )
            terminal = [e for e in evs if e.type in ("operation.succeeded", "operation.failed")]
            ended = op.state in (OperationState.SUCCEEDED, OperationState.FAILED)
            if ended and len(terminal) != 1:
                self.history.violation("terminal-event", f"{op.id} has {len(terminal)}")
            if op.state is OperationState.FAILED and op.routing_committed:
                self.history.violation("failed-and-committed", str(op.id))
            if op.routing_committed:
                self._check_commit(op, evs)
            if op.finished_at is None:
                self.history.violation("never-ended", f"{op.id} {op.kind.value}")
            elif op.finished_at > faults_end_wall:
                began = max(op.created_at, faults_end_wall)
                took = (op.finished_at - began).total_seconds()
                if took > budget:
                    self.history.violation(
                        "over-budget", f"{op.id} ended {took:.1f}s after faults stopped"
                    )
        committed = [o for o in ops if o.routing_committed]
        if len(self.pointers) >= 1:
            first_rev = self.pointers[0][2]
            last_rev = self.pointers[-1][2]
            commits_after = [o for o in committed if o.created_at > self._start_wall()]
            if last_rev - first_rev > len(commits_after):
                self.history.violation(
                    "pointer-moved-without-promote",
                    f"revision {first_rev}->{last_rev} with {len(commits_after)} commit(s)",
                )
            targets = {o.target_domain_id for o in committed}
            for at, pointer, rev in self.pointers[1:]:
                if pointer not in targets:
                    self.history.violation(
                        "pointer-moved-without-promote", f"t={at:.1f} revision {rev} -> {pointer}"
                    )
        self._check_backoff(events, ops)
        self._check_evidence(events)

    def _check_evidence(self, events: list[Any]) -> None:
        """No fast failover without strong evidence, and none without a real cause.

        Every escalation of the active on evidence (``domain.degraded.escalated`` with
        ``evidence``: the fast path, without the grace) must follow a ``domain.dead_suspected``
        of the same domain and evidence, at least ``deadConfirmMs`` earlier (its confirmed
        second observation). And every ``domain.dead_suspected`` must fall in a window of a
        fault that really killed the domain's serving (``vllm_crash``, ``host_loss``: the
        harness's own ground truth), give or take the clock faults' skew and a slack: a
        partition, a lossy link, a hang, 500s or a supervisor restart never prove a domain
        dead. Escalations after the grace and stale failovers keep their own timers (weak
        evidence) and are not checked here.
        """
        confirm = timedelta(milliseconds=resolve_policy(POLICY).dead_confirm_ms)
        start_wall = self._start_wall()
        slack = 2.0 + self.max_skew_s
        deadly = [w for w in self.windows if w.kind in ("vllm_crash", "host_loss")]
        suspected: dict[tuple[UUID | None, str], list[datetime]] = defaultdict(list)
        for event in events:
            if event.created_at < start_wall:
                continue
            slug = self.slug_of.get(event.domain_id) if event.domain_id else None
            if event.type == "domain.dead_suspected":
                evidence = str(event.payload.get("evidence"))
                suspected[(event.domain_id, evidence)].append(event.created_at)
                at = (event.created_at - start_wall).total_seconds()
                if not any(
                    w.target == slug and w.start - slack <= at <= w.end + slack for w in deadly
                ):
                    self.history.violation(
                        "dead-without-cause",
                        f"{slug} suspected dead ({evidence}) at t={at:.1f}s with no crash or "
                        "lost host on it",
                    )
            elif event.type == "domain.degraded.escalated" and event.payload.get("evidence"):
                evidence = str(event.payload["evidence"])
                seen = suspected.get((event.domain_id, evidence), [])
                skew = timedelta(seconds=self.max_skew_s)
                if not any(at + confirm - skew <= event.created_at for at in seen):
                    self.history.violation(
                        "failover-without-strong-evidence",
                        f"{slug} failed on {evidence} without a dead_suspected at least "
                        f"{confirm.total_seconds():.1f}s before",
                    )

    def _start_wall(self) -> datetime:
        return datetime.now(UTC) - timedelta(seconds=self.history.now())

    def _check_commit(self, op: Operation, evs: list[Any]) -> None:
        steps = [(e.id, e.payload.get("step")) for e in evs if e.type == "operation.step.done"]
        ids = {step: eid for eid, step in steps}
        if "probe" not in ids or "wake_vllm" not in ids:
            self.history.violation("commit-without-probe", f"{op.id}: steps done {steps}")
        elif "switch_active" in ids and not ids["wake_vllm"] < ids["probe"] < ids["switch_active"]:
            self.history.violation("commit-order", f"{op.id}: steps done {steps}")

    def _check_backoff(self, events: list[Any], ops: list[Operation]) -> None:
        by_id = {o.id: o for o in ops}
        until: dict[UUID, datetime] = {}
        for event in events:
            if event.type == "operation.promotion_backoff":
                until[UUID(event.payload["targetDomainId"])] = datetime.fromisoformat(
                    event.payload["until"]
                )
            elif event.type == "operation.succeeded" and event.operation_id in by_id:
                op = by_id[event.operation_id]
                if op.kind.value == "promote":
                    until.pop(op.target_domain_id, None)
            elif event.type == "operation.auto_failover" and event.operation_id in by_id:
                op = by_id[event.operation_id]
                bound = until.get(op.target_domain_id)
                slack = timedelta(milliseconds=50) + timedelta(seconds=self.max_skew_s)
                if bound is not None and op.created_at < bound - slack:
                    self.history.violation(
                        "backoff",
                        f"auto promote {op.id} of {self.slug_of.get(op.target_domain_id)} at "
                        f"{op.created_at.isoformat()} before its backoff ended {bound.isoformat()}",
                    )
        auto = [e for e in events if e.type == "operation.auto_failover"]
        start_wall = self._start_wall()
        for event in auto:
            found = by_id.get(event.operation_id) if event.operation_id is not None else None
            if found is not None:
                end = found.finished_at or datetime.now(UTC)
                self.unplanned.append(
                    (
                        (found.created_at - start_wall).total_seconds(),
                        (end - start_wall).total_seconds(),
                    )
                )
        duration = max(self.history.now(), 1.0)
        if len(auto) > 4 + duration / 5:
            self.history.violation(
                "tick-rate", f"{len(auto)} automatic promotions in {duration:.0f}s"
            )

    def _check_decisions(self) -> None:
        """No decision delayed by a stored future time, on the harness's monotonic clock only.

        Every operation the monitor saw must not be seen still pending or running more than
        its budget (every step's budget, +3 s) after it was first seen or after the last fault
        cleared, whichever is later. Both ends are history times of the monitor's own reads (no
        time written by a replica or the store is used): the first sighting is after the
        operation was created, and the last sighting while it ran is before it ended, so the
        measured span never exceeds the real one. A step budget measured against a start time
        some replica wrote from a clock running ahead (or a claim, heartbeat or backoff time
        from the future) shows up here as an operation that outlives its budget.
        """
        budget = operation_budget_s(resolve_policy(POLICY)) + 3.0
        for op_id, last in sorted(self.op_running.items(), key=lambda item: item[1]):
            began = max(self.op_seen[op_id], self.faults_end)
            if last - began > budget:
                self.history.violation(
                    "decision-delayed",
                    f"operation {op_id} still in flight {last - began:.1f}s after "
                    f"{'it was first seen' if began > self.faults_end else 'the faults stopped'} "
                    f"(harness clock; budget {budget:.1f}s)",
                )

    async def _check_hostile(self) -> None:
        """What hostile clients did must not show: no 500, no forged log line, nothing at the
        recorder, ``/healthz`` answering (unless the process was down or stopped)."""
        for at, name, label in self.hostile_5xx[:10]:
            self.history.violation("hostile-500", f"{name} answered 500 to {label} at {at:.2f}s")
        if len(self.hostile_5xx) > 10:
            self.history.violation("hostile-500", f"... {len(self.hostile_5xx)} in all")
        if self.recorder is not None:
            for hit in self.recorder.hits:
                self.history.violation("hostile-reached-recorder", hit)
        if self.trap is not None:
            self.history.note("hostile", f"{self.trap.redirects} redirect(s) answered upstream")
        found = await asyncio.to_thread(forged_lines, self.workdir / "fleet" / "logs", self.forged)
        for line in found[:10]:
            self.history.violation("log-forged", line)
        down = {
            "replica_kill",
            "pause",
            "supervisor_restart",
            "supervisor_outage",
            "token_rotation",
            "partition",
            "lossy_link",
            "host_loss",
        }
        for at, target, why in self.healthz_failures:
            excused = any(
                w.kind in down and w.target == target and w.start - 0.5 <= at <= w.end + 2.5
                for w in self.windows
            )
            if not excused:
                self.history.violation("healthz", f"{target} /healthz at {at:.2f}s: {why}")

    # -- traffic verdicts -----------------------------------------------------------------------

    def excuse(self, outcome: Outcome) -> str | None:
        """Why a failed request is allowed, or None."""
        grace = 1.5
        if not self.hold and outcome.cause in _UNROUTABLE:
            # Without issue 17's failover hold, a request sent while an unplanned failover has
            # no routable active fails (the snapshot cache may show the old verdict for its TTL).
            for start, end in self.unplanned:
                if start - 0.5 <= outcome.end and outcome.start <= end + 2.5:
                    return "no routable active during an unplanned failover (no hold on main)"
        for w in self.windows:
            if w.start - 0.2 <= outcome.end and outcome.start <= w.end + grace:
                if w.kind == "replica_kill" and int(w.target) == outcome.replica:
                    return "replica down (a load balancer retries another)"
                if (
                    w.kind == "pause"
                    and int(w.target) == outcome.replica
                    and (outcome.cause == "timeout" or outcome.cause.startswith("connection"))
                ):
                    return "replica or worker stopped (a health check takes it out)"
                if w.kind.startswith("vllm_") and w.kind != "vllm_wake_fails":
                    return f"{w.kind} on {w.target}: no domain could serve"
                if w.kind in ("partition", "host_loss"):
                    return f"{w.kind} of {w.target}: its vLLM servers were gone or stopped"
                if w.kind in ("store_cut", "store_stall") and not self._warm(
                    outcome.replica, w.start, outcome.end
                ):
                    return "store down with a cold cache"
        return None

    def _warm(self, replica: int, outage_start: float, at: float) -> bool:
        """Whether ``replica``'s route cache was warm when the outage began: it had not
        restarted since (before ``at``), and a request through it was routed between its last
        start and the outage. A replica that never routed before the store went away has no
        routing to serve from its cache."""
        starts = [s for s in self.starts[replica] if s <= at]
        if not starts or starts[-1] > outage_start:
            return False
        since = starts[-1]
        return any(
            o.ok and o.replica == replica and o.start >= since and o.end <= outage_start
            for o in self.outcomes
        )

    def result(self, traffic: Traffic) -> Result:
        outcomes = self.outcomes = traffic.outcomes
        failures: Counter[str] = Counter()
        excused: Counter[str] = Counter()
        for o in outcomes:
            if o.ok:
                continue
            why = self.excuse(o)
            if why is None:
                failures[o.cause] += 1
                self.history.violation(
                    "traffic",
                    f"replica {o.replica} request {o.start:.2f}-{o.end:.2f}s failed: {o.cause}",
                )
            else:
                excused[f"{o.cause} ({why})"] += 1
        latencies = sorted((o.end - o.start) * 1000 for o in outcomes if o.ok)
        p50 = statistics.median(latencies) if latencies else 0.0
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0
        self.history.note(
            "traffic",
            f"{len(outcomes)} requests, {sum(failures.values())} unexcused failures "
            f"{dict(failures)}, excused {dict(excused)}, p50 {p50:.1f} ms, p99 {p99:.1f} ms",
        )
        self.history.write()
        return Result(
            self.schedule,
            list(self.history.violations),
            self.history.path,
            requests=len(outcomes),
            failures=dict(failures),
            excused=dict(excused),
            p50_ms=p50,
            p99_ms=p99,
            operations=len(getattr(self, "operations", [])),
            phases=self.phases,
        )


async def run_schedule(
    schedule: Schedule,
    workdir: Path,
    *,
    admin_url: str | None,
    settle_s: float = 45.0,
    hold: bool = False,
) -> Result:
    os.makedirs(workdir, exist_ok=True)
    run = Run(schedule, workdir, admin_url, hold=hold)
    try:
        result = await run.run(settle_s)
    except BaseException as exc:
        run.history.violation("harness", f"{exc!r}")
        run.history.write()
        raise
    finally:
        closing = time.monotonic()
        await run.close()
        run.phases["close"] = time.monotonic() - closing
        run.history.note("timing", " ".join(f"{k}={v:.1f}s" for k, v in run.phases.items()))
        run.history.write()
    return result
