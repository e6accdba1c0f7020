"""A whole local fleet as real processes on 127.0.0.1, no GPU, no database server.

:class:`DemoTopology` is the launcher both ``haru demo`` and the end-to-end tests use. It starts,
each as its own process in its own session:

- one emulated vLLM server (``python -m haru_sim.vllm``) per model per domain, shaped like the
  bundled example layout (``example-chat-small`` and ``example-chat-medium`` on GPU 0,
  ``example-chat-large`` on GPU 1); the standby's start asleep (``--start-asleep``);
- one real supervisor (``python -m haru_supervisor``) per domain, whose training slots run the
  emulated trainer and whose GPU memory comes from an emulated ``nvidia-smi``
  (:mod:`haru_sim.nvidia_smi`) first on its ``PATH``;
- the real server (``python -m haru_server serve``) on the embedded SQLite default (a
  ``haru.db`` in the workdir, migrated and seeded with the example layout rewritten with the
  real ports, URLs and checkpoint directories) or on a given ``DATABASE_URL``, with its
  background reconcile loop and autoFailover on, under short demo budgets.

Then it does what an operator would: waits for the first heartbeats and demotes every standby
(``POST /v1/fleets/{ref}/demote``), so the standby reaches standby posture (vLLM asleep,
training running) through the real system. Every file it writes (database, configs, logs,
checkpoints) lives in the workdir. Leaving the context stops every process it started.

The sim and the supervisor run as child processes (haru-demo depends on both): nothing here
imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Final, Self
from uuid import UUID

import aiohttp
from haru_db import StateStore, upgrade
from haru_protocol import (
    AcceptedResponse,
    DomainLayout,
    DomainState,
    FleetLayout,
    FleetSnapshot,
    InferenceSlotSpec,
    ModelBinding,
    Operation,
    OperationKind,
    OperationState,
    PolicyPatch,
    SlotSpec,
    SupervisorConfig,
    SupervisorInferenceSlot,
    SupervisorModel,
    SupervisorSlot,
    SupervisorTrainingSlot,
    TrainingSlotSpec,
    TrainingSlotState,
    TrainingStatusResponse,
    bearer_header,
    load_example_layout,
)
from haru_server.control_client import ControlApiError, ControlClient
from haru_sim import nvidia_smi as _gpu
from haru_sim.nvidia_smi import GPU_TOTAL_MIB, EmulatedGpu, GpuModel, write_nvidia_smi

from haru_demo._procs import (
    ChildProcess,
    DemoError,
    kill_stray_trainers,
    reap_orphans,
    spawn,
)

logger = logging.getLogger(__name__)

DEFAULT_DEMO_PORT: Final = 8700
"""Where ``haru demo`` serves when the port is free (the server's default ``PORT``)."""

DEMO_POLICY: Final = PolicyPatch(auto_failover=True)
"""The default policy with autoFailover on, as an operator would seed it: the demo shows the
failover an operator gets out of the box, with no demo-only tuning."""

GPU_SCRIPT: Final = Path(_gpu.__file__)
"""The emulated ``nvidia-smi``, run as a script."""

VLLM_GPU_SHARE: Final = 0.9
"""Share of a GPU its awake vLLM servers hold together (vLLM's gpu_memory_utilization)."""

_SIM_LISTENING = re.compile(r"^haru-sim-vllm listening on [^\s:]+:(\d+)\s*$", re.MULTILINE)
_SIM_CONTROL = re.compile(r"^haru-sim-vllm control on [^\s:]+:(\d+)\s*$", re.MULTILINE)
_SUPERVISOR_LISTENING = re.compile(r"haru-supervisor listening on http://[^\s:]+:(\d+)")
_SERVER_LISTENING = re.compile(r"haru-server listening on [^\s:]+:(\d+)")
_POLL_S: Final = 0.1

# Variables of the operator's own shell that must not leak into the demo's processes: the demo
# decides its database, ports and tokens itself.
_SCRUBBED_ENV: Final = ("DATABASE_URL", "PORT", "VLLM_SERVER_DEV_MODE")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoTimings:
    """Speeds of the emulated engines and the control plane's budgets.

    Attributes:
        sleep_latency_ms: How long an emulated vLLM sleep takes.
        wake_latency_ms: How long an emulated vLLM wake takes.
        first_token_latency_ms: Emulated time to first token.
        token_latency_ms: Emulated time per token.
        trainer_step_ms: Emulated training step.
        trainer_checkpoint_every: Steps between checkpoints.
        reconcile_interval_ms: The server's ``HARU_RECONCILE_INTERVAL_MS`` (None: not set,
            the server's default).
        supervisor_shutdown_grace_ms: ``HARU_SUPERVISOR_SHUTDOWN_GRACE_MS`` (trainer SIGTERM
            to SIGKILL when a supervisor stops).
        stop_grace_s: SIGTERM to SIGKILL grace when the demo stops a process.
        ready_timeout_s: Bound on each start-up wait.
        policy: The fleet's policy patch (autoFailover on, short budgets).
        trainer_extra_args: More arguments of the emulated trainer (``--ignore-sigterm``,
            ``--spawn-child``, ...: the fault-schedule harness uses them).
    """

    sleep_latency_ms: int = 50
    wake_latency_ms: int = 250
    first_token_latency_ms: int = 10
    token_latency_ms: int = 2
    trainer_step_ms: int = 100
    trainer_checkpoint_every: int = 10
    reconcile_interval_ms: int | None = None
    supervisor_shutdown_grace_ms: int = 2_000
    stop_grace_s: float = 5.0
    ready_timeout_s: float = 60.0
    policy: PolicyPatch = DEMO_POLICY
    trainer_extra_args: tuple[str, ...] = ()


LOOPBACK: Final = "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostPlacement:
    """Where one host of the topology (the server, or one domain) runs.

    By default every process runs here, on 127.0.0.1. A placement runs a host's processes
    through ``argv_prefix`` (for example ``ip netns exec NETNS``: the host is a network
    namespace) and makes the others reach it on ``address``; its processes then listen on every
    interface of their namespace (a domain's supervisor still reaches its vLLM on 127.0.0.1).

    Attributes:
        argv_prefix: Prepended to the argv of every process of the host.
        address: The address other hosts and the caller reach the host on.
    """

    argv_prefix: tuple[str, ...] = ()
    address: str = LOOPBACK


@dataclass(frozen=True, slots=True, kw_only=True)
class UnboundModel:
    """A model a domain's vLLM serves from the start that the seeded layout does not bind.

    vLLM serves what it was started with; Haru routes what the layout binds. The topology starts
    an emulated vLLM server for it (asleep on a standby) and lists it in the supervisor's config,
    so an apply can bind it later (:meth:`DemoTopology.layout_binding`).

    Attributes:
        domain: Slug of the domain that serves it.
        gpu_index: GPU of the inference slot it belongs to.
        name: The served model name.
    """

    domain: str
    gpu_index: int
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyOptions:
    """What :class:`DemoTopology` starts, and where.

    Attributes:
        workdir: Folder for everything the topology writes (created if missing).
        server_port: The server's ``PORT`` (0: a free one).
        database_url: ``DATABASE_URL`` of the server; None: the embedded SQLite default
            (``haru.db`` in the workdir).
        timings: Engine speeds and budgets.
        supervisor_token: The supervisor token of the server and the supervisors (None: open
            supervisors, listening on 127.0.0.1 only). Each side reads it from its own file
            (``HARU_SUPERVISOR_TOKEN_FILE``, :meth:`DemoTopology.supervisor_token_file`), so
            it can be rotated under the running processes.
        api_token: The server's admin token (``HARU_API_TOKEN_FILE``,
            :meth:`DemoTopology.api_token_file`; None: an open API on 127.0.0.1). With one,
            the proxy needs a client key (:meth:`DemoTopology.create_client_key`).
        supervisor_env: Further variables of every supervisor.
        layout: The layout whose shape is reproduced (default: the bundled example).
        standby_posture: Demote every standby once the fleet is up (vLLM asleep, training
            running), as an operator would after seeding.
        hosts: Where the server (key ``"server"``) and each domain (its slug) run; missing
            keys run here on 127.0.0.1.
        unbound_models: Models served from the start but not bound by the seeded layout.
    """

    workdir: Path
    server_port: int = 0
    database_url: str | None = None
    timings: DemoTimings = field(default_factory=DemoTimings)
    supervisor_token: str | None = None
    api_token: str | None = None
    supervisor_env: Mapping[str, str] = field(default_factory=dict)
    layout: FleetLayout | None = None
    standby_posture: bool = True
    hosts: Mapping[str, HostPlacement] = field(default_factory=dict)
    unbound_models: tuple[UnboundModel, ...] = ()


@dataclass(slots=True, kw_only=True)
class VllmServer:
    """One emulated vLLM server: one model of one domain."""

    name: str
    gpu_index: int
    port: int
    process: ChildProcess
    address: str = LOOPBACK
    control_port: int = 0
    """The emulator's control listener (``/_sim/*`` only): it stays open under the ``refuse``
    fault, which closes :attr:`port`."""

    @property
    def url(self) -> str:
        """Base URL (the layout's ``servingUrl``)."""
        return f"http://{self.address}:{self.port}"

    @property
    def control_url(self) -> str:
        """Base URL of the control listener (``POST /_sim/faults`` etc.)."""
        return f"http://{self.address}:{self.control_port}"


@dataclass(slots=True, kw_only=True)
class DemoDomain:
    """One domain of the topology: its vLLM servers, supervisor and checkpoint folders."""

    slug: str
    shape: DomainLayout
    """The domain as the reproduced layout describes it (ports and paths not yet real)."""
    vllm: dict[str, VllmServer] = field(default_factory=dict)
    supervisor: ChildProcess | None = None
    supervisor_url: str = ""
    checkpoint_dirs: dict[int, Path] = field(default_factory=dict)

    unbound: tuple[UnboundModel, ...] = ()
    """Models its vLLM serves that the seeded layout does not bind."""

    @property
    def models(self) -> tuple[str, ...]:
        """Model names the seeded layout binds, in layout order."""
        return tuple(m.name for s in self.shape.inference_slots for m in s.models)

    def served_on(self, gpu_index: int) -> tuple[str, ...]:
        """Every model served on inference GPU ``gpu_index``: the bound ones, then the unbound."""
        bound = tuple(
            m.name for s in self.shape.inference_slots if s.gpu_index == gpu_index for m in s.models
        )
        return bound + tuple(u.name for u in self.unbound if u.gpu_index == gpu_index)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound now (a hint: another process may take it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def trainer_command(timings: DemoTimings) -> tuple[str, ...]:
    """Argv of the emulated trainer: the console script next to this Python, else ``-m``."""
    script = Path(sys.executable).with_name("haru-sim-trainer")
    base = (
        (str(script),)
        if script.is_file() and os.access(script, os.X_OK)
        else (sys.executable, "-m", "haru_sim.trainer")
    )
    return (
        *base,
        "--step-ms",
        str(timings.trainer_step_ms),
        "--checkpoint-every",
        str(timings.trainer_checkpoint_every),
        *timings.trainer_extra_args,
    )


async def _all(coroutines: Iterable[Coroutine[object, object, object]]) -> None:
    """Run concurrently; on the first failure cancel the rest and raise that failure."""
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                group.create_task(coroutine)
    except BaseExceptionGroup as group_error:
        first = group_error.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group_error


def _base_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV and not k.startswith("HARU_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


class DemoTopology:
    """A whole local fleet as separate processes; ``async with DemoTopology(options) as t:``.

    Args:
        options: What to start and where.
    """

    def __init__(self, options: TopologyOptions) -> None:
        self.options = options
        self.workdir = options.workdir.resolve()
        self.timings = options.timings
        self.shape = options.layout or load_example_layout()
        self.domains: dict[str, DemoDomain] = {
            d.slug: DemoDomain(
                slug=d.slug,
                shape=d,
                unbound=tuple(u for u in options.unbound_models if u.domain == d.slug),
            )
            for d in self.shape.domains
        }
        for unbound in options.unbound_models:
            domain = self.domains.get(unbound.domain)
            if domain is None or unbound.gpu_index not in {
                s.gpu_index for s in domain.shape.inference_slots
            }:
                raise ValueError(
                    f"no inference slot on GPU {unbound.gpu_index} of {unbound.domain}"
                )
        self.layout: FleetLayout | None = None
        self.server: ChildProcess | None = None
        self.server_port = options.server_port
        self.fleet_id: UUID | None = None
        self._children: list[ChildProcess] = []
        self._closed = False

    # ---- addresses ---------------------------------------------------------------------------

    @property
    def fleet_slug(self) -> str:
        """Slug of the demo fleet."""
        return self.shape.slug

    @property
    def server_url(self) -> str:
        """Base URL of the server (its ``/v1`` is the OpenAI-compatible proxy)."""
        if not self.server_port:
            raise DemoError("the server has not been started")
        return f"http://{self.placement('server').address}:{self.server_port}"

    @property
    def database_path(self) -> Path | None:
        """The embedded SQLite file, or None on another database."""
        return None if self.options.database_url else self.workdir / "haru.db"

    @property
    def checkpoint_root(self) -> Path:
        """Folder holding every trainer's checkpoint directory."""
        return self.workdir / "checkpoints"

    def initial_active(self) -> str:
        """Slug of the domain the layout makes active first."""
        return self.shape.active_domain_slug or self.shape.domains[0].slug

    def placement(self, host: str) -> HostPlacement:
        """Where ``host`` (``"server"`` or a domain slug) runs."""
        return self.options.hosts.get(host, HostPlacement())

    def control(self, *, timeout_s: float = 10.0) -> ControlClient:
        """A control API client of the server (use as ``async with``).

        It presents the admin token the server's file holds now.
        """
        # A placed server is on a private lab network: plain HTTP to it is deliberate.
        placed = self.placement("server").address != LOOPBACK
        return ControlClient(
            self.server_url, token=self.api_token(), timeout_s=timeout_s, allow_plaintext=placed
        )

    # ---- secrets -----------------------------------------------------------------------------

    @property
    def secrets_dir(self) -> Path:
        """Folder of the token files (mode 0700; each file 0600)."""
        return self.workdir / "secrets"

    def api_token_file(self) -> Path:
        """The server's ``HARU_API_TOKEN_FILE`` (written at start when there is a token)."""
        return self.secrets_dir / "api.token"

    def supervisor_token_file(self, side: str) -> Path:
        """The ``HARU_SUPERVISOR_TOKEN_FILE`` of ``side``: ``"server"`` or a domain's slug.

        Every side has its own file, as every host has in production: rewriting one rotates
        the token of that process only.
        """
        return self.secrets_dir / f"supervisor-{side}.token"

    def api_token(self) -> str | None:
        """The admin token the server's file holds now (None: an open API)."""
        if self.options.api_token is None:
            return None
        return self.api_token_file().read_text(encoding="utf-8").strip()

    def _supervisor_token_of(self, side: str) -> str | None:
        if self.options.supervisor_token is None:
            return None
        return self.supervisor_token_file(side).read_text(encoding="utf-8").strip()

    def _write_secrets(self) -> None:
        self.secrets_dir.mkdir(mode=0o700, exist_ok=True)
        files: dict[Path, str] = {}
        if self.options.api_token is not None:
            files[self.api_token_file()] = self.options.api_token
        if self.options.supervisor_token is not None:
            for side in ("server", *self.domains):
                files[self.supervisor_token_file(side)] = self.options.supervisor_token
        for path, token in files.items():
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(token + "\n")

    async def create_client_key(self, name: str) -> str:
        """Create an inference client key (``POST /v1/keys``) and return its secret.

        Raises:
            DemoError: The server refused or did not answer.
        """
        try:
            async with self.control() as client:
                created = await client.create_key(name, fleets=[self.fleet_slug])
        except ControlApiError as exc:
            raise DemoError(f"creating the client key {name!r}: {exc}") from exc
        return created.secret

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self, *, on_progress: Callable[[str], None] | None = None) -> None:
        """Start everything, seed the fleet and reach standby posture.

        Raises:
            DemoError: A process did not start, or the fleet did not settle in time.
        """
        progress = on_progress or (lambda _message: None)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        active = self.initial_active()
        if self.database_path is not None and self.database_path.exists():
            raise DemoError(
                f"{self.database_path} already exists: the demo seeds a fresh database; "
                "use an empty --workdir"
            )
        await self._migrate()
        self._write_secrets()
        # The server imports the most and starts the slowest: it boots while the rest starts,
        # and its reconcile loop finds the fleet once it is seeded.
        progress("starting the server")
        server_start = asyncio.create_task(self.start_server(), name="haru-demo-server-start")
        try:
            served = sum(len(d.models) + len(d.unbound) for d in self.domains.values())
            progress(f"starting {served} emulated vLLM")
            await _all(
                self._start_vllm(domain, asleep=domain.slug != active)
                for domain in self.domains.values()
            )
            progress("starting the supervisors")
            await _all(self._start_supervisor(domain) for domain in self.domains.values())
            progress("seeding the state store")
            self.layout = self._build_layout()
            (self.workdir / "layout.json").write_text(
                self.layout.model_dump_json(indent=2, exclude_none=True), encoding="utf-8"
            )
            await self._seed(self.layout)
        except BaseException:
            server_start.cancel()
            with contextlib.suppress(BaseException):
                await server_start
            raise
        await server_start
        progress("waiting for the first heartbeats")
        await self.wait_for_fleet(heartbeats_judged, what="every domain to answer a heartbeat")
        if self.options.standby_posture:
            progress("demoting the standby: vLLM asleep, training started")
            await self.ensure_standby_posture()

    async def close(self) -> None:
        """Stop every process (server, supervisors and their trainers, vLLM servers)."""
        if self._closed:
            return
        self._closed = True
        grace = self.timings.stop_grace_s
        if self.server is not None:
            await self.server.stop(grace_s=grace)
        supervisors = [d.supervisor for d in self.domains.values() if d.supervisor is not None]
        # A supervisor stops its trainers first (SIGTERM, then SIGKILL after its own grace).
        supervisor_grace = grace + self.timings.supervisor_shutdown_grace_ms / 1000
        await asyncio.gather(*(s.stop(grace_s=supervisor_grace) for s in supervisors))
        await asyncio.gather(
            *(v.process.stop(grace_s=grace) for d in self.domains.values() for v in d.vllm.values())
        )
        # Anything a failed start left half-way (spawned, never recorded as ready).
        await asyncio.gather(
            *(c.stop(grace_s=self.timings.stop_grace_s) for c in self._children if c.running)
        )
        await reap_orphans()
        strays = kill_stray_trainers(self.checkpoint_root)
        if strays:
            logger.warning("killed %d trainer(s) left behind: %s", len(strays), strays)

    # ---- emulated vLLM servers ---------------------------------------------------------------

    def _vllm_argv(self, name: str, *, port: int, asleep: bool, placed: bool) -> list[str]:
        t = self.timings
        argv = [
            sys.executable,
            "-m",
            "haru_sim.vllm",
            "--host",
            "0.0.0.0" if placed else LOOPBACK,
            "--port",
            str(port),
            "--control-port",
            "0",
            "--served-model-name",
            name,
            "--model",
            f"haru-demo/{name}",
            "--sleep-latency-ms",
            str(t.sleep_latency_ms),
            "--wake-latency-ms",
            str(t.wake_latency_ms),
            "--first-token-latency-ms",
            str(t.first_token_latency_ms),
            "--token-latency-ms",
            str(t.token_latency_ms),
        ]
        if asleep:
            argv.append("--start-asleep")
        return argv

    async def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log: str,
        host: str | None = None,
    ) -> ChildProcess:
        if host is not None:
            argv = [*self.placement(host).argv_prefix, *argv]
        child = await spawn(name, argv, env=env, cwd=cwd, log_path=self.workdir / "logs" / log)
        self._children.append(child)
        return child

    async def _spawn_vllm(
        self, domain: DemoDomain, name: str, gpu: int, *, port: int, asleep: bool
    ) -> VllmServer:
        placement = self.placement(domain.slug)
        process = await self._spawn(
            f"vllm-{domain.slug}-{name}",
            self._vllm_argv(name, port=port, asleep=asleep, placed=placement.address != LOOPBACK),
            env=_base_env(),
            cwd=self.workdir,
            log=f"vllm-{domain.slug}-{name}.log",
            host=domain.slug,
        )
        match = await process.wait_for_line(_SIM_LISTENING, timeout_s=self.timings.ready_timeout_s)
        control = await process.wait_for_line(_SIM_CONTROL, timeout_s=self.timings.ready_timeout_s)
        server = VllmServer(
            name=name,
            gpu_index=gpu,
            port=int(match.group(1)),
            process=process,
            address=placement.address,
            control_port=int(control.group(1)),
        )
        domain.vllm[name] = server
        return server

    async def _start_vllm(self, domain: DemoDomain, *, asleep: bool) -> None:
        await _all(
            self._spawn_vllm(domain, name, slot.gpu_index, port=0, asleep=asleep)
            for slot in domain.shape.inference_slots
            for name in domain.served_on(slot.gpu_index)
        )

    async def kill_vllm(self, slug: str) -> datetime:
        """SIGKILL every emulated vLLM server of domain ``slug`` (an unplanned failure).

        Returns:
            When the kill signals were sent.
        """
        servers = list(self.domains[slug].vllm.values())
        at = datetime.now(UTC)
        await asyncio.gather(*(s.process.kill() for s in servers))
        return at

    async def kill_host(self, slug: str) -> datetime:
        """SIGKILL domain ``slug``'s supervisor and every vLLM server at once (a lost host).

        Returns:
            When the kill signals were sent.
        """
        domain = self.domains[slug]
        processes = [s.process for s in domain.vllm.values()]
        if domain.supervisor is not None:
            processes.append(domain.supervisor)
        at = datetime.now(UTC)
        await asyncio.gather(*(p.kill() for p in processes))
        return at

    async def restart_vllm(self, slug: str, *, asleep: bool) -> None:
        """Start domain ``slug``'s vLLM servers again on their ports (after :meth:`kill_vllm`)."""
        domain = self.domains[slug]
        old = list(domain.vllm.values())
        for server in old:
            if server.process.running:
                await server.process.stop(grace_s=self.timings.stop_grace_s)
        await _all(
            self._spawn_vllm(domain, s.name, s.gpu_index, port=s.port, asleep=asleep) for s in old
        )

    # ---- supervisors -------------------------------------------------------------------------

    async def restart_host(self, slug: str) -> None:
        """Bring a lost host back (after :meth:`kill_host`).

        Domain ``slug``'s vLLM servers (asleep) and supervisor start again on their old ports.
        """
        domain = self.domains[slug]
        await self.restart_vllm(slug, asleep=True)
        if domain.supervisor is not None and domain.supervisor.running:
            await domain.supervisor.stop(grace_s=self.timings.stop_grace_s)
        port = int(domain.supervisor_url.rsplit(":", 1)[1]) if domain.supervisor_url else 0
        await self._start_supervisor(domain, port=port)

    async def _start_supervisor(self, domain: DemoDomain, *, port: int = 0) -> None:
        folder = self.workdir / domain.slug
        bin_dir = folder / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        command = trainer_command(self.timings)
        slots: list[SupervisorSlot] = []
        gpus: dict[int, EmulatedGpu] = {}
        for slot in domain.shape.slots:
            if isinstance(slot, InferenceSlotSpec):
                servers = [domain.vllm[name] for name in domain.served_on(slot.gpu_index)]
                slots.append(
                    SupervisorInferenceSlot(
                        gpu_index=slot.gpu_index,
                        models=tuple(SupervisorModel(name=s.name, port=s.port) for s in servers),
                    )
                )
                share = int(GPU_TOTAL_MIB * VLLM_GPU_SHARE / len(servers))
                gpu = gpus.get(slot.gpu_index, EmulatedGpu(index=slot.gpu_index))
                gpus[slot.gpu_index] = dataclasses.replace(
                    gpu,
                    models=tuple(
                        GpuModel(name=s.name, port=s.port, awake_mib=share) for s in servers
                    ),
                )
            else:
                directory = self.checkpoint_root / f"{domain.slug}-gpu{slot.gpu_index}"
                directory.mkdir(parents=True, exist_ok=True)
                domain.checkpoint_dirs[slot.gpu_index] = directory
                slots.append(
                    SupervisorTrainingSlot(
                        gpu_index=slot.gpu_index, command=command, checkpoint_dir=str(directory)
                    )
                )
                gpu = gpus.get(slot.gpu_index, EmulatedGpu(index=slot.gpu_index))
                gpus[slot.gpu_index] = dataclasses.replace(gpu, checkpoint_dir=str(directory))
        config_path = folder / "supervisor.json"
        config_path.write_text(
            SupervisorConfig(slots=tuple(slots)).model_dump_json(indent=2, exclude_none=True),
            encoding="utf-8",
        )
        write_nvidia_smi(bin_dir, [gpus[i] for i in sorted(gpus)])
        env = _base_env()
        env.update(
            PORT=str(port),
            HARU_SUPERVISOR_CONFIG=str(config_path),
            HARU_SUPERVISOR_GPU_SOURCE="nvidia-smi",
            HARU_SUPERVISOR_SHUTDOWN_GRACE_MS=str(self.timings.supervisor_shutdown_grace_ms),
            PATH=os.pathsep.join([str(bin_dir), env.get("PATH", os.defpath)]),
        )
        if self.options.supervisor_token is not None:
            env["HARU_SUPERVISOR_TOKEN_FILE"] = str(self.supervisor_token_file(domain.slug))
        env.update(self.options.supervisor_env)
        placement = self.placement(domain.slug)
        if placement.address != LOOPBACK:
            # Alone in its namespace: every interface there, the token (if any) guarding it.
            env["HARU_HOST"] = "0.0.0.0"
            if self.options.supervisor_token is None:
                env["HARU_ALLOW_OPEN_BIND"] = "1"
        process = await self._spawn(
            f"supervisor-{domain.slug}",
            [sys.executable, "-m", "haru_supervisor"],
            env=env,
            cwd=folder,
            log=f"supervisor-{domain.slug}.log",
            host=domain.slug,
        )
        domain.supervisor = process
        match = await process.wait_for_line(
            _SUPERVISOR_LISTENING, timeout_s=self.timings.ready_timeout_s
        )
        domain.supervisor_url = f"http://{placement.address}:{match.group(1)}"

    # ---- layout and store --------------------------------------------------------------------

    def _domain_layout(self, domain: DemoDomain) -> DomainLayout:
        command = trainer_command(self.timings)
        slots: list[SlotSpec] = []
        for slot in domain.shape.slots:
            if isinstance(slot, InferenceSlotSpec):
                slots.append(
                    slot.model_copy(
                        update={
                            "models": tuple(
                                ModelBinding(name=m.name, serving_url=domain.vllm[m.name].url)
                                for m in slot.models
                            )
                        }
                    )
                )
            else:
                slots.append(
                    TrainingSlotSpec(
                        gpu_index=slot.gpu_index,
                        command=command,
                        checkpoint_dir=str(domain.checkpoint_dirs[slot.gpu_index]),
                    )
                )
        first = domain.vllm[domain.models[0]]
        return domain.shape.model_copy(
            update={
                "supervisor_url": domain.supervisor_url,
                # No load balancer in front of a demo domain: its first model's server stands in
                # for the domain's public endpoint in the route intent.
                "serving_base_url": first.url,
                "slots": tuple(slots),
            }
        )

    def _build_layout(self) -> FleetLayout:
        layout = self.shape.model_copy(
            update={
                "schema_uri": None,
                "display_name": "Haru demo fleet",
                "policy": self.timings.policy,
                "domains": tuple(self._domain_layout(d) for d in self.domains.values()),
            }
        )
        # Validate the rewritten document as an operator's would be.
        return FleetLayout.model_validate_json(layout.model_dump_json(exclude_none=True))

    def layout_binding(self, unbound: UnboundModel) -> FleetLayout:
        """The seeded layout with ``unbound`` bound to its slot, at its server's URL.

        What an operator would ``haru apply`` to have Haru route the model.

        Raises:
            DemoError: The topology has not been started.
        """
        if self.layout is None:
            raise DemoError("the topology has not been started")
        server = self.domains[unbound.domain].vllm[unbound.name]
        binding = ModelBinding(name=unbound.name, serving_url=server.url)
        domains: list[DomainLayout] = []
        for domain in self.layout.domains:
            if domain.slug == unbound.domain:
                slots = tuple(
                    slot.model_copy(update={"models": (*slot.models, binding)})
                    if isinstance(slot, InferenceSlotSpec) and slot.gpu_index == unbound.gpu_index
                    else slot
                    for slot in domain.slots
                )
                domain = domain.model_copy(update={"slots": slots})
            domains.append(domain)
        layout = self.layout.model_copy(update={"domains": tuple(domains)})
        return FleetLayout.model_validate_json(layout.model_dump_json(exclude_none=True))

    @property
    def _store_url(self) -> str:
        return self.options.database_url or str(self.database_path)

    async def _migrate(self) -> None:
        await upgrade(self._store_url)

    async def _seed(self, layout: FleetLayout) -> None:
        store = StateStore.open(self._store_url)
        try:
            result = await store.apply_fleet_layout(layout, at=datetime.now(UTC))
        finally:
            await store.close()
        self.fleet_id = result.fleet_id

    # ---- server ------------------------------------------------------------------------------

    def server_env(self) -> dict[str, str]:
        """The server's environment."""
        env = _base_env()
        env.update(
            PORT=str(self.server_port),
            HARU_DEFAULT_FLEET=self.fleet_slug,
        )
        if self.timings.reconcile_interval_ms is not None:
            env["HARU_RECONCILE_INTERVAL_MS"] = str(self.timings.reconcile_interval_ms)
        if self.options.database_url is not None:
            env["DATABASE_URL"] = self.options.database_url
        if self.options.supervisor_token is not None:
            env["HARU_SUPERVISOR_TOKEN_FILE"] = str(self.supervisor_token_file("server"))
        if self.options.api_token is not None:
            env["HARU_API_TOKEN_FILE"] = str(self.api_token_file())
        placement = self.placement("server")
        if placement.address != LOOPBACK:
            env["HARU_HOST"] = placement.address
            env["HARU_ALLOW_OPEN_BIND"] = "1"
        if any(self.placement(slug).address != LOOPBACK for slug in self.domains):
            # Placed domains sit on a private lab network, reached over plain HTTP.
            env["HARU_ALLOW_PLAINTEXT"] = "1"
        return env

    async def start_server(self) -> None:
        """Start the server (again, on the same port and database, after :meth:`stop_server`).

        Raises:
            DemoError: It did not start listening in time.
        """
        if self.server is not None and self.server.running:
            raise DemoError("the server is already running")
        # The embedded default: DATABASE_URL unset, haru.db in the working directory.
        self.server = await self._spawn(
            "server",
            [sys.executable, "-m", "haru_server", "serve"],
            env=self.server_env(),
            cwd=self.workdir,
            log="server.log",
            host="server",
        )
        match = await self.server.wait_for_line(
            _SERVER_LISTENING, timeout_s=self.timings.ready_timeout_s
        )
        self.server_port = int(match.group(1))

    async def stop_server(self, *, kill: bool = False) -> None:
        """Stop the server: SIGKILL (a crash) with ``kill``, else SIGTERM and a grace."""
        if self.server is None:
            return
        if kill:
            await self.server.kill()
        else:
            await self.server.stop(grace_s=self.timings.stop_grace_s)

    # ---- reading and waiting -----------------------------------------------------------------

    async def fleet(self) -> FleetSnapshot:
        """The fleet snapshot from the server."""
        async with self.control() as client:
            return await client.fleet(self.fleet_slug)

    async def wait_for_fleet(
        self,
        predicate: Callable[[FleetSnapshot], bool],
        *,
        what: str,
        timeout_s: float | None = None,
    ) -> FleetSnapshot:
        """Poll the fleet until ``predicate`` holds.

        Raises:
            DemoError: It did not hold within ``timeout_s`` (default: the ready timeout).
        """
        bound = self.timings.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        last_error = ""
        async with self.control() as client:
            while True:
                try:
                    fleet = await client.fleet(self.fleet_slug)
                except ControlApiError as exc:
                    last_error = f" (last error: {exc})"
                else:
                    if predicate(fleet):
                        return fleet
                if time.monotonic() >= deadline:
                    raise DemoError(f"timed out after {bound:.0f}s waiting for {what}{last_error}")
                await asyncio.sleep(_POLL_S)

    async def wait_for_operation(self, operation_id: UUID, *, timeout_s: float) -> Operation:
        """Poll an operation until it ends (succeeded, failed or cancelled).

        Raises:
            DemoError: It was still in flight after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        async with self.control() as client:
            while True:
                with contextlib.suppress(ControlApiError):
                    operation = await client.operation(self.fleet_slug, operation_id)
                    if operation.state not in (OperationState.PENDING, OperationState.RUNNING):
                        return operation
                if time.monotonic() >= deadline:
                    raise DemoError(f"operation {operation_id} still in flight after {timeout_s}s")
                await asyncio.sleep(_POLL_S)

    async def request(self, kind: OperationKind, slug: str) -> Operation | None:
        """Ask for a promote or demote of domain ``slug``.

        Returns:
            The accepted operation, or None when a promote's target is already active.
        """
        async with self.control() as client:
            fleet = await client.fleet(self.fleet_slug)
            target = next(d for d in fleet.domains if d.slug == slug)
            answer = await client.request_operation(self.fleet_slug, kind, target.id)
        return answer.operation if isinstance(answer, AcceptedResponse) else None

    async def ensure_standby_posture(self) -> None:
        """Demote every standby whose training is not running, and wait for each demote.

        Raises:
            DemoError: A demote failed or did not finish in time.
        """
        fleet = await self.fleet()
        for domain in fleet.domains:
            if domain.id == fleet.active_domain_id:
                continue
            training = [s for s in domain.slots if s.training_spec is not None]
            if training and all(s.state is TrainingSlotState.TRAINING for s in training):
                continue
            operation = await self.request(OperationKind.DEMOTE, domain.slug)
            if operation is None:
                continue
            final = await self.wait_for_operation(
                operation.id, timeout_s=self.timings.ready_timeout_s
            )
            if final.state is not OperationState.SUCCEEDED:
                raise DemoError(f"demote of {domain.slug} ended {final.state.value}: {final.error}")

    async def vllm_states(self, slug: str) -> dict[str, dict[str, object] | None]:
        """``GET /_sim/state`` of each of domain ``slug``'s vLLM servers (None: no answer)."""
        domain = self.domains[slug]
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def state(server: VllmServer) -> dict[str, object] | None:
                try:
                    async with session.get(f"{server.url}/_sim/state") as response:
                        body = await response.json()
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    return None
                return body if isinstance(body, dict) else None

            servers = list(domain.vllm.values())
            states = await asyncio.gather(*(state(s) for s in servers))
        return {s.name: st for s, st in zip(servers, states, strict=True)}

    async def training_status(self, slug: str) -> TrainingStatusResponse:
        """Domain ``slug``'s supervisor's ``GET /v1/training/status``.

        Raises:
            DemoError: The supervisor did not answer with a status.
        """
        url = f"{self.domains[slug].supervisor_url}/v1/training/status"
        headers = bearer_header(self._supervisor_token_of(slug))
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session,
                session.get(url, headers=headers) as response,
            ):
                raw = await response.read()
                response.raise_for_status()
            return TrainingStatusResponse.model_validate_json(raw)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise DemoError(f"training status of {slug}: {exc}") from exc


def heartbeats_judged(fleet: FleetSnapshot) -> bool:
    """Whether every domain answered a heartbeat and was judged on it (no longer provisioning).

    A tick records the heartbeats (``lastSeenAt``) in one statement and moves a provisioning
    domain to ready or degraded in the next; between the two a demote of that domain is
    refused (422: only a degraded or ready domain can be demoted), so waiting for
    ``lastSeenAt`` alone is not enough (fault schedules ``pg-replicas:2052`` and ``:2053``).
    """
    return all(
        d.last_seen_at is not None and d.state is not DomainState.PROVISIONING
        for d in fleet.domains
    )


def is_standby_posture(fleet: FleetSnapshot, slug: str) -> bool:
    """Whether domain ``slug`` is a standby whose vLLM sleeps and whose training runs."""
    domain = next((d for d in fleet.domains if d.slug == slug), None)
    if domain is None or domain.id == fleet.active_domain_id:
        return False
    inference = [s for s in domain.slots if s.inference_spec is not None]
    training = [s for s in domain.slots if s.training_spec is not None]
    return all(s.state.value == "sleeping" for s in inference) and all(
        s.state is TrainingSlotState.TRAINING for s in training
    )


def active_slug(fleet: FleetSnapshot) -> str | None:
    """Slug of the fleet's active domain."""
    return next((d.slug for d in fleet.domains if d.id == fleet.active_domain_id), None)
