"""The files, addresses and environments of a demo topology: everything short of a process.

:class:`TopologyFiles` is the base of :class:`haru_demo.DemoTopology`: the workdir's paths and
token files, the emulated vLLM argv, each supervisor's config, emulated ``nvidia-smi`` and
environment, the fleet layout rewritten with the real ports and URLs, and the server's
environment. Starting and stopping the processes is :mod:`haru_demo._topology`'s job.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Final
from uuid import UUID

from haru_protocol import (
    DomainLayout,
    FleetLayout,
    InferenceSlotSpec,
    ModelBinding,
    SlotSpec,
    SupervisorConfig,
    SupervisorInferenceSlot,
    SupervisorModel,
    SupervisorSlot,
    SupervisorTrainingSlot,
    TrainingSlotSpec,
    load_example_layout,
)
from haru_server.control_client import ControlClient
from haru_sim.nvidia_smi import GPU_TOTAL_MIB, EmulatedGpu, GpuModel, write_nvidia_smi

from haru_demo._options import (
    LOOPBACK,
    VLLM_GPU_SHARE,
    DemoDomain,
    HostPlacement,
    TopologyOptions,
    UnboundModel,
    trainer_command,
)
from haru_demo._procs import (
    ChildProcess,
    DemoError,
)

# Variables of the operator's own shell that must not leak into the demo's processes: the demo
# decides its database, ports and tokens itself.
_SCRUBBED_ENV: Final = ("DATABASE_URL", "PORT", "VLLM_SERVER_DEV_MODE")


def _base_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV and not k.startswith("HARU_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


class TopologyFiles:
    """The paths, configs and environments of a demo topology (the base of ``DemoTopology``).

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

    # ---- supervisors -------------------------------------------------------------------------

    def _supervisor_env(self, domain: DemoDomain, *, port: int) -> dict[str, str]:
        """Write the supervisor config and ``nvidia-smi`` of ``domain``; return its environment."""
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
        return env

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
