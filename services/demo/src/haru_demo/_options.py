"""The demo topology's options, timings and records of the processes it starts.

:class:`TopologyOptions` says what to start and where (:class:`HostPlacement` for each host,
:class:`UnboundModel` for models served but not bound), :class:`DemoTimings` how fast the
emulated engines and the control plane run; :class:`DemoDomain` and :class:`VllmServer` record
what :class:`haru_demo.DemoTopology` started for each domain.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from haru_protocol import (
    DomainLayout,
    FleetLayout,
    PolicyPatch,
)
from haru_sim import nvidia_smi as _gpu

from haru_demo._procs import (
    ChildProcess,
)

DEFAULT_DEMO_PORT: Final = 8700
"""Where ``haru demo`` serves when the port is free (the server's default ``PORT``)."""

DEMO_POLICY: Final = PolicyPatch(auto_failover=True)
"""The default policy with autoFailover on, as an operator would seed it: the demo shows the
failover an operator gets out of the box, with no demo-only tuning."""

GPU_SCRIPT: Final = Path(_gpu.__file__)
"""The emulated ``nvidia-smi``, run as a script."""

VLLM_GPU_SHARE: Final = 0.9
"""Share of a GPU its awake vLLM servers hold together (vLLM's gpu_memory_utilization)."""


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
