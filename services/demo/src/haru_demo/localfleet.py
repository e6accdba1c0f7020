"""A whole fleet on one machine without GPUs: emulated vLLM servers and real supervisors.

Every model gets its own :class:`haru_sim.VllmSim` on a real 127.0.0.1 port, every domain a
real supervisor (``haru_supervisor.api.create_app``) on another, whose trainers are real
``haru-sim-trainer`` processes. GPU memory is reported through the supervisor's
``nvidia-smi`` path with an injected exec that answers from :attr:`LocalDomain.gpu_used_mib`.
Used by haru-server's tests, the end-to-end tests and the promotion benchmark.
"""

from __future__ import annotations

import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from aiohttp import web
from haru_exec import ExecResult
from haru_protocol import (
    Cloud,
    DomainLayout,
    FleetLayout,
    InferenceSlotSpec,
    ModelBinding,
    Placement,
    PolicyPatch,
    SlotSpec,
    SupervisorConfig,
    SupervisorInferenceSlot,
    SupervisorModel,
    SupervisorSlot,
    SupervisorTrainingSlot,
    TrainingSlotSpec,
)
from haru_sim import VllmSim, VllmSimConfig
from haru_supervisor.api import Settings as SupervisorSettings
from haru_supervisor.api import create_app as create_supervisor_app
from pydantic import SecretStr

DEFAULT_MODELS: Mapping[int, tuple[str, ...]] = {
    0: ("example-chat-small", "example-chat-medium"),
    1: ("example-chat-large",),
}
"""Models per GPU: a bundle of small models on GPU 0 and one large model on GPU 1."""

GPU_TOTAL_MIB = 81_920.0
IDLE_GPU_USED_MIB = 1_024.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalFleetOptions:
    """Shape and timing of a local fleet.

    Attributes:
        slug: Fleet slug.
        domains: Domain slugs; the first is the active one.
        models: Model names per GPU index (every domain serves the same models).
        training_gpus: GPUs that carry a training slot.
        trainer_args: Arguments of ``python -m haru_sim.trainer``.
        sleep_latency_ms: How long an emulated sleep takes.
        wake_latency_ms: How long an emulated wake takes.
        supervisor_token: Token the supervisors require (None: open, loopback).
        trainer_shutdown_grace_s: SIGTERM-to-SIGKILL grace when a supervisor shuts down.
        supervisor_tls: ``(certificate file, key file)``: the supervisors serve HTTPS with
            them (their URLs are ``https://``); None serves plain HTTP.
    """

    slug: str = "local"
    domains: tuple[str, ...] = ("alpha", "beta")
    models: Mapping[int, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    training_gpus: tuple[int, ...] = (0, 1)
    trainer_args: tuple[str, ...] = ("--step-ms", "20", "--checkpoint-every", "5")
    sleep_latency_ms: float = 5.0
    wake_latency_ms: float = 5.0
    supervisor_token: str | None = None
    trainer_shutdown_grace_s: float = 2.0
    supervisor_tls: tuple[Path, Path] | None = None


@dataclass(slots=True, kw_only=True)
class LocalDomain:
    """One domain: its emulated vLLM servers and its supervisor."""

    slug: str
    sims: dict[str, VllmSim]
    """Emulated vLLM server of each model, by model name."""
    models: Mapping[int, tuple[str, ...]]
    checkpoint_dirs: dict[int, Path]
    gpu_used_mib: dict[int, float]
    """What the emulated ``nvidia-smi`` reports as used, per GPU (tests change it)."""
    gpu_processes: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    """``(pid, MiB)`` of the compute processes the emulated ``nvidia-smi`` lists, per GPU."""
    supervisor_url: str = ""
    runner: web.AppRunner | None = None
    supervisor_settings: SupervisorSettings | None = None
    """The supervisor's settings (:meth:`LocalFleet.restart_supervisor` reuses them)."""

    def binding_url(self, model: str) -> str:
        """The serving URL of ``model`` in this domain."""
        return self.sims[model].url

    def layout(self, training_command: Sequence[str]) -> DomainLayout:
        """This domain as a fleet layout document describes it."""
        slots: list[SlotSpec] = [
            InferenceSlotSpec(
                gpu_index=gpu,
                models=tuple(ModelBinding(name=m, serving_url=self.sims[m].url) for m in names),
            )
            for gpu, names in sorted(self.models.items())
        ]
        slots.extend(
            TrainingSlotSpec(
                gpu_index=gpu,
                command=tuple(training_command),
                checkpoint_dir=str(directory),
            )
            for gpu, directory in sorted(self.checkpoint_dirs.items())
        )
        first = next(iter(self.sims.values()))
        return DomainLayout(
            slug=self.slug,
            placement=Placement(
                cloud=Cloud.AWS,
                region="local",
                accelerator="EXAMPLE-GPU",
                accelerator_count=max(len(self.models), 1),
            ),
            supervisor_url=self.supervisor_url,
            serving_base_url=first.url,
            slots=tuple(slots),
        )

    async def _nvidia_smi(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        gpus = sorted(set(self.models) | set(self.checkpoint_dirs))
        lines = [
            f"{gpu}, {self.gpu_used_mib.get(gpu, 0.0):.0f}, {GPU_TOTAL_MIB:.0f}" for gpu in gpus
        ]
        if any(arg.startswith("--query-compute-apps=") for arg in argv):
            lines = [
                f"{pid}, GPU-local-{gpu}, {mib:.0f}"
                for gpu, held in sorted(self.gpu_processes.items())
                for pid, mib in held
            ]
        elif "--query-gpu=index,uuid" in argv:
            lines = [f"{gpu}, GPU-local-{gpu}" for gpu in gpus]
        return ExecResult(argv=tuple(argv), returncode=0, stdout="\n".join(lines) + "\n", stderr="")


class LocalFleet:
    """Start with ``async with LocalFleet(workdir, options) as fleet:``.

    Args:
        workdir: Scratch directory (checkpoints, the fake ``nvidia-smi``).
        options: Shape and timing.
    """

    def __init__(self, workdir: Path, options: LocalFleetOptions | None = None) -> None:
        self.workdir = workdir
        self.options = options or LocalFleetOptions()
        self.domains: dict[str, LocalDomain] = {}

    @property
    def training_command(self) -> tuple[str, ...]:
        """Argv of the emulated trainer."""
        return (sys.executable, "-m", "haru_sim.trainer", *self.options.trainer_args)

    def domain(self, slug: str) -> LocalDomain:
        """The domain ``slug``."""
        return self.domains[slug]

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Start every emulated vLLM server and every supervisor."""
        options = self.options
        bin_dir = self.workdir / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        # The supervisor looks nvidia-smi up on its search path; the injected exec answers.
        fake_smi = bin_dir / "nvidia-smi"
        fake_smi.write_text("#!/bin/sh\nexit 1\n", encoding="utf-8")
        fake_smi.chmod(0o755)
        try:
            for index, slug in enumerate(options.domains):
                await self._start_domain(slug, active=index == 0, search_path=str(bin_dir))
        except BaseException:
            await self.close()
            raise

    async def _start_domain(self, slug: str, *, active: bool, search_path: str) -> None:
        options = self.options
        domain = LocalDomain(
            slug=slug,
            sims={},
            models=options.models,
            checkpoint_dirs={
                gpu: self.workdir / "checkpoints" / f"{slug}-gpu{gpu}"
                for gpu in options.training_gpus
            },
            gpu_used_mib=dict.fromkeys(
                set(options.models) | set(options.training_gpus), IDLE_GPU_USED_MIB
            ),
        )
        self.domains[slug] = domain
        for names in options.models.values():
            for name in names:
                sim = VllmSim(
                    VllmSimConfig(
                        served_model_names=(name,),
                        start_asleep=not active,
                        sleep_latency_ms=options.sleep_latency_ms,
                        wake_latency_ms=options.wake_latency_ms,
                    )
                )
                domain.sims[name] = sim
                await sim.start()
        for directory in domain.checkpoint_dirs.values():
            directory.mkdir(parents=True, exist_ok=True)
        slots: list[SupervisorSlot] = [
            SupervisorInferenceSlot(
                gpu_index=gpu,
                models=tuple(SupervisorModel(name=n, port=domain.sims[n].port) for n in names),
            )
            for gpu, names in sorted(options.models.items())
        ]
        slots.extend(
            SupervisorTrainingSlot(
                gpu_index=gpu, command=self.training_command, checkpoint_dir=str(directory)
            )
            for gpu, directory in sorted(domain.checkpoint_dirs.items())
        )
        settings = SupervisorSettings(
            config=SupervisorConfig(slots=tuple(slots)),
            port=0,
            token=None if options.supervisor_token is None else SecretStr(options.supervisor_token),
            gpu_source="nvidia-smi",
            shutdown_grace_ms=round(options.trainer_shutdown_grace_s * 1000),
            trainer_env=dict(os.environ),
            search_path=search_path,
            tls_cert_file=None if options.supervisor_tls is None else options.supervisor_tls[0],
            tls_key_file=None if options.supervisor_tls is None else options.supervisor_tls[1],
        )
        domain.supervisor_settings = settings
        await self._serve_supervisor(domain, settings, port=0)

    @staticmethod
    async def _serve_supervisor(
        domain: LocalDomain, settings: SupervisorSettings, *, port: int
    ) -> None:
        app = create_supervisor_app(settings, exec_=domain._nvidia_smi)
        runner = web.AppRunner(app, shutdown_timeout=2.0)
        await runner.setup()
        domain.runner = runner
        tls = settings.tls
        context = None
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls.cert_file, tls.key_file)
        site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=context)
        await site.start()
        scheme = "http" if context is None else "https"
        domain.supervisor_url = f"{scheme}://127.0.0.1:{site.port}"

    def layout(
        self,
        *,
        policy: PolicyPatch | None = None,
        active: str | None = None,
    ) -> FleetLayout:
        """The fleet layout document of this fleet (the first domain active by default)."""
        command = self.training_command
        return FleetLayout(
            slug=self.options.slug,
            active_domain_slug=active if active is not None else self.options.domains[0],
            policy=policy,
            domains=tuple(d.layout(command) for d in self.domains.values()),
        )

    async def stop_supervisor(self, slug: str) -> None:
        """Stop one domain's supervisor (its trainers stop with it); it stays down."""
        domain = self.domains[slug]
        runner, domain.runner = domain.runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart_supervisor(self, slug: str) -> None:
        """Start a stopped supervisor of one domain again, on its old port (its URL).

        Like an operator's service manager restarting it: a fresh process that knows nothing
        of the training runs its predecessor stopped; the vLLM servers kept running.
        """
        domain = self.domains[slug]
        if domain.supervisor_settings is None:
            raise RuntimeError(f"domain {slug!r} was never started")
        if domain.runner is not None:
            await self.stop_supervisor(slug)
        port = int(domain.supervisor_url.rsplit(":", 1)[1])
        await self._serve_supervisor(domain, domain.supervisor_settings, port=port)

    async def close(self) -> None:
        """Stop every supervisor (and its trainers), then every emulated vLLM server."""
        for domain in self.domains.values():
            runner, domain.runner = domain.runner, None
            if runner is not None:
                await runner.cleanup()
        for domain in self.domains.values():
            for sim in domain.sims.values():
                await sim.stop()
