"""The supervisor's config document and every request and response body of its API (DESIGN 6)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Final, Literal
from uuid import UUID

from pydantic import Field, StrictInt, model_validator

from haru_protocol._base import (
    DurationMs,
    GpuIndex,
    ModelName,
    NonEmptyStr,
    PeerModel,
    Port,
    WireModel,
)
from haru_protocol._enums import SlotKind, TrainingRunState


class SupervisorModel(WireModel):
    """A local vLLM server: one model on ``127.0.0.1:<port>``."""

    name: ModelName
    """The server's ``--served-model-name``."""
    port: Port
    api_key_env: NonEmptyStr | None = None
    """Name of a variable of the supervisor's environment holding the server's ``--api-key``
    (sent as a bearer token by the probe; the admin routes and ``/metrics`` need none)."""
    api_key_file: NonEmptyStr | None = None
    """Path of a file holding the server's ``--api-key`` (trimmed), instead of ``apiKeyEnv``."""

    @model_validator(mode="after")
    def _one_key_source(self) -> SupervisorModel:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError(f"model {self.name!r}: set apiKeyEnv or apiKeyFile, not both")
        return self


class SupervisorInferenceSlot(WireModel):
    """The vLLM servers on one GPU."""

    kind: Literal[SlotKind.INFERENCE] = SlotKind.INFERENCE
    gpu_index: GpuIndex
    models: tuple[SupervisorModel, ...] = Field(min_length=1)


class SupervisorTrainingSlot(WireModel):
    """The training run on one GPU."""

    kind: Literal[SlotKind.TRAINING] = SlotKind.TRAINING
    gpu_index: GpuIndex
    command: tuple[NonEmptyStr, ...] = Field(min_length=1)
    checkpoint_dir: NonEmptyStr
    run_as: NonEmptyStr | None = None
    """Run the trainer as this user (a name or a numeric uid) with its primary group and no
    supplementary group, so it cannot read the supervisor's environment or token file. Needs
    a supervisor running as root; the user must exist when the config is loaded."""


SupervisorSlot = Annotated[
    SupervisorInferenceSlot | SupervisorTrainingSlot, Field(discriminator="kind")
]


class SupervisorConfig(WireModel):
    """``HARU_SUPERVISOR_CONFIG``: what runs on this GPU host."""

    schema_uri: str | None = Field(default=None, alias="$schema")
    slots: tuple[SupervisorSlot, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> SupervisorConfig:
        seen: set[tuple[int, SlotKind]] = set()
        for slot in self.slots:
            key = (slot.gpu_index, slot.kind)
            if key in seen:
                raise ValueError(f"duplicate {slot.kind.value} slot on GPU {slot.gpu_index}")
            seen.add(key)
        names = [
            m.name for s in self.slots if isinstance(s, SupervisorInferenceSlot) for m in s.models
        ]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names configured twice: {duplicates!r}")
        ports = [
            m.port for s in self.slots if isinstance(s, SupervisorInferenceSlot) for m in s.models
        ]
        if len(set(ports)) != len(ports):
            raise ValueError("two models share a port")
        return self

    @property
    def inference_slots(self) -> tuple[SupervisorInferenceSlot, ...]:
        """The inference slots."""
        return tuple(s for s in self.slots if isinstance(s, SupervisorInferenceSlot))

    @property
    def training_slots(self) -> tuple[SupervisorTrainingSlot, ...]:
        """The training slots."""
        return tuple(s for s in self.slots if isinstance(s, SupervisorTrainingSlot))


ModelAction = Literal["sleep", "wake"]
"""An admin action the supervisor has sent to a vLLM server and not seen finish."""


class ModelStatus(PeerModel):
    """One local vLLM server's sleep state; ``sleeping`` is null when it proved nothing."""

    name: str
    port: int
    sleeping: bool | None
    action: ModelAction | None = Field(default=None, exclude_if=lambda value: value is None)
    """A sleep or wake of this server is in progress (sent by the supervisor and not finished,
    or a sleep that timed out and is not confirmed yet): vLLM does not answer
    ``/is_sleeping`` meanwhile, so ``sleeping`` is null and means "busy", not "down"."""
    vllm_version: str | None = None
    """The server's ``GET /version``, once read (null: not read yet or unreachable).
    ``action`` and ``error`` are absent when null."""
    error: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """Why the supervisor refuses to drive this server (an unsupported vLLM version)."""
    down: bool = Field(default=False, exclude_if=lambda value: not value)
    """The server refused the connection (nothing listens on its port: the process is gone
    or not started yet). A timeout, an error answer or a dropped connection is not ``down``.
    Absent when false, so older peers read it as "not proven down"."""


class TrainingStop(PeerModel):
    """How a run's last stop (``POST /v1/training/stop``) ended."""

    stop_ms: int
    """From SIGTERM to the run's last process gone (the supervisor's monotonic clock)."""
    killed: bool
    """The grace ran out: the run was SIGKILLed."""
    grace_ms: int
    """The grace it was given (the shortest, when several stops asked)."""


class TrainingStatus(PeerModel):
    """One training run."""

    state: TrainingRunState
    pids: tuple[int, ...] = ()
    last_stop: TrainingStop | None = Field(default=None, exclude_if=lambda value: value is None)
    """The run's last stop since it was started (absent: not stopped since, or an older
    supervisor)."""


class SlotStatus(PeerModel):
    """One configured slot in ``GET /v1/status``."""

    gpu_index: int
    kind: SlotKind
    models: tuple[ModelStatus, ...] | None = None
    training: TrainingStatus | None = None


class SupervisorStatus(PeerModel):
    """``GET /v1/status``."""

    slots: tuple[SlotStatus, ...]
    ready: bool
    """At least one model is configured and every model reports awake."""


class ReadyResponse(PeerModel):
    """``GET /v1/ready``."""

    ready: bool


class SleepRequest(WireModel):
    """Body of ``POST /v1/vllm/sleep``; an empty body targets every inference slot."""

    gpu_index: GpuIndex | None = None
    drain_timeout_ms: DurationMs | None = None
    """Wait up to this long for in-flight requests to finish before sleeping."""


class WakeRequest(WireModel):
    """Body of ``POST /v1/vllm/wake``; an empty body targets every inference slot."""

    gpu_index: GpuIndex | None = None


class OkResponse(PeerModel):
    """A plain success."""

    status: Literal["ok"] = "ok"


class TrainingStopRequest(WireModel):
    """Body of ``POST /v1/training/stop``."""

    grace_ms: DurationMs | None = None
    """SIGTERM now, SIGKILL after this grace (default 30 s)."""


class TrainingSlotStatus(PeerModel):
    """One run in ``GET /v1/training/status``."""

    gpu_index: int
    state: TrainingRunState
    pids: tuple[int, ...] = ()
    last_stop: TrainingStop | None = Field(default=None, exclude_if=lambda value: value is None)
    """As in :class:`TrainingStatus`."""


class TrainingStatusResponse(PeerModel):
    """``GET /v1/training/status``."""

    slots: tuple[TrainingSlotStatus, ...]


class GpuProcess(PeerModel):
    """A compute process holding memory on a GPU (NVML or ``nvidia-smi``)."""

    pid: int
    """As the GPU driver reports it (the host's pid namespace)."""
    name: str | None = None
    """The process's command name, when the supervisor can see the process."""
    used_mib: float | None = Field(default=None, alias="usedMiB")
    """Its GPU memory; null when the driver does not say (some containers)."""


class GpuMemory(PeerModel):
    """Memory of one GPU, in MiB, with ``used`` excluding driver-reserved memory."""

    index: int
    used_mib: float = Field(alias="usedMiB")
    total_mib: float = Field(alias="totalMiB")
    processes: tuple[GpuProcess, ...] | None = Field(
        default=None, exclude_if=lambda value: value is None
    )
    """In ``GET /v1/gpu/processes``: the compute processes holding its memory (empty: none).
    Absent from ``GET /v1/gpu/memory``."""


class GpuMemoryResponse(PeerModel):
    """``GET /v1/gpu/memory``."""

    gpus: tuple[GpuMemory, ...]


class ProbeRequest(WireModel):
    """Body of ``POST /v1/probe``."""

    prompt: NonEmptyStr = "ping"
    max_tokens: Annotated[StrictInt, Field(ge=1, le=4096)] = 4
    timeout_ms: DurationMs | None = None


class ProbeResult(PeerModel):
    """The probe of one model."""

    model: str
    ok: bool
    latency_ms: float
    error: str | None = None


class ProbeResponse(PeerModel):
    """``POST /v1/probe``: ``ok`` only when every configured model answered with content."""

    ok: bool
    results: tuple[ProbeResult, ...]


FENCE_HEADER: Final = "X-Haru-Fence"
"""Request header carrying a :class:`SupervisorFence`: ``<fleet-id>:<token>``."""

MAX_FENCE: Final = 2**63 - 1
"""The largest token (the store's counter is a signed 64-bit integer)."""

_FENCE_VALUE = re.compile(r"(?P<fleet>[0-9a-fA-F-]{32,36}):(?P<token>[0-9]{1,19})")


class FenceParseError(ValueError):
    """An ``X-Haru-Fence`` value that is not ``<fleet-uuid>:<decimal token>``."""


@dataclass(frozen=True, slots=True)
class SupervisorFence:
    """The fencing token of the operation step a supervisor call is made for.

    The server's store raises a fleet's token with every operation write (create, claim,
    advance, complete, fail); a supervisor refuses a state-changing call whose token is lower
    than the highest it has seen for that fleet (``409 stale_fence``): the caller lost the
    step to another server process.
    """

    fleet_id: UUID
    token: int

    def __post_init__(self) -> None:
        if not 0 <= self.token <= MAX_FENCE:
            raise FenceParseError(f"{FENCE_HEADER}: the token is outside 0..{MAX_FENCE}")

    def header_value(self) -> str:
        """The value of :data:`FENCE_HEADER`."""
        return f"{self.fleet_id}:{self.token}"

    @classmethod
    def parse(cls, raw: str) -> SupervisorFence:
        """Parse a :data:`FENCE_HEADER` value.

        Raises:
            FenceParseError: Not ``<fleet-uuid>:<decimal token>`` within range.
        """
        match = _FENCE_VALUE.fullmatch(raw.strip())
        if match is None:
            raise FenceParseError(
                f"{FENCE_HEADER} must be '<fleet-uuid>:<token>' (a decimal token)"
            )
        try:
            fleet_id = UUID(match["fleet"])
        except ValueError as exc:
            raise FenceParseError(f"{FENCE_HEADER}: the fleet id is not a UUID") from exc
        return cls(fleet_id, int(match["token"]))
