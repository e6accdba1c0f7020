"""Operator-authored slot specs: what each GPU of a domain hosts (DESIGN 3.3).

An inference slot binds models (one vLLM server each) to a GPU; a training slot runs a
preemptible trainer on one while its domain is standby.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StrictFloat, model_validator

from haru_protocol._base import GpuIndex, HttpUrl, ModelName, NonEmptyStr, WireModel
from haru_protocol._enums import SlotKind

DEFAULT_GPU_MEMORY_BUDGET = 0.9
"""Share of a GPU's memory the vLLM servers on it get together by default (vLLM's own
default for one server); split evenly between the models of the GPU."""

MAX_GPU_MEMORY_BUDGET = 0.95
"""The most the explicit shares of one GPU's models may add up to."""

_ARG_RE = re.compile(r"[^\x00-\x1f\x7f]+")


def _check_arg(value: str) -> str:
    if not value or _ARG_RE.fullmatch(value) is None:
        raise ValueError(f"argument {value!r} must be non-empty without control characters")
    return value


CliArg = Annotated[str, AfterValidator(_check_arg)]
"""One command-line argument (passed as one argv item, never through a shell)."""


def is_unset(value: object) -> bool:
    """Whether a provisioning-only key is unset (so dumps leave it out).

    Left out, such keys keep static documents (and the slot specs stored from them) in their
    exact shape.
    """
    return value is None or value == ()


class ModelBinding(WireModel):
    """One model an inference slot serves, and where the proxy reaches it."""

    name: ModelName
    """Routing key (the ``model`` field of requests); equals vLLM's ``--served-model-name``."""
    serving_url: HttpUrl | None = None
    """Base URL of the vLLM server of this model (path prefix and query are kept). Required on
    a ``static`` domain; on a provisioned domain Haru records it once the machine is up."""
    source: NonEmptyStr | None = Field(default=None, exclude_if=is_unset)
    """Provisioned domains: what vLLM loads (a Hugging Face repo id or a path on the machine);
    the model's name when omitted."""
    gpu_memory_utilization: Annotated[StrictFloat, Field(gt=0, le=MAX_GPU_MEMORY_BUDGET)] | None = (
        Field(default=None, exclude_if=is_unset)
    )
    """Provisioned domains: this server's share of its GPU's memory (vLLM's
    ``--gpu-memory-utilization``); by default the GPU's models split 0.9 evenly."""
    extra_vllm_args: tuple[CliArg, ...] = Field(default=(), exclude_if=is_unset)
    """Provisioned domains: further ``vllm serve`` arguments, appended verbatim (Haru's own
    flags: model, served name, host, port, sleep mode and memory share are set already)."""
    api_key_env: NonEmptyStr | None = Field(default=None, exclude_if=is_unset)
    """Static domains: name of a variable of the Haru server's environment holding the serving
    credential of ``servingUrl`` (vLLM's ``--api-key``); the proxy sends it as ``Authorization:
    Bearer`` on every request it forwards there. Only the name is stored, never the value."""
    api_key_file: NonEmptyStr | None = Field(default=None, exclude_if=is_unset)
    """Static domains: path of a file on the Haru server holding that credential (trimmed),
    instead of ``apiKeyEnv``; read again whenever the fleet's routes are rebuilt."""

    @property
    def provisioning_keys(self) -> list[str]:
        """The provisioning-only keys this binding sets (none are allowed on static domains)."""
        keys = []
        if self.source is not None:
            keys.append("source")
        if self.gpu_memory_utilization is not None:
            keys.append("gpuMemoryUtilization")
        if self.extra_vllm_args:
            keys.append("extraVllmArgs")
        return keys


class InferenceSlotSpec(WireModel):
    """A GPU hosting one vLLM server per model."""

    kind: Literal[SlotKind.INFERENCE] = SlotKind.INFERENCE
    gpu_index: GpuIndex
    models: tuple[ModelBinding, ...] = Field(min_length=1)
    sleep_level: Literal[1] = 1
    """vLLM sleep level used on the standby (only level 1 is supported)."""

    @model_validator(mode="after")
    def _unique_models(self) -> InferenceSlotSpec:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique within a slot: {names!r}")
        shares = [m.gpu_memory_utilization for m in self.models]
        explicit = [s for s in shares if s is not None]
        if explicit and len(explicit) != len(shares):
            raise ValueError(
                f"GPU {self.gpu_index}: give gpuMemoryUtilization for every model of the slot "
                "or for none"
            )
        if sum(explicit) > MAX_GPU_MEMORY_BUDGET + 1e-9:
            raise ValueError(
                f"GPU {self.gpu_index}: gpuMemoryUtilization of its models adds up to "
                f"{sum(explicit):g}, more than {MAX_GPU_MEMORY_BUDGET:g}"
            )
        return self

    def memory_shares(self) -> dict[str, float]:
        """Each model's share of the GPU: the explicit values, else 0.9 split evenly."""
        even = int(DEFAULT_GPU_MEMORY_BUDGET / len(self.models) * 100) / 100
        return {
            m.name: m.gpu_memory_utilization if m.gpu_memory_utilization is not None else even
            for m in self.models
        }


class TrainingSlotSpec(WireModel):
    """A GPU that runs a preemptible training command while its domain is standby."""

    kind: Literal[SlotKind.TRAINING] = SlotKind.TRAINING
    gpu_index: GpuIndex
    command: tuple[NonEmptyStr, ...] = Field(min_length=1)
    """Argv of the trainer, run verbatim (no shell, nothing appended)."""
    checkpoint_dir: NonEmptyStr
    """Directory the trainer checkpoints into (given to it as ``HARU_CHECKPOINT_DIR``)."""


SlotSpec = Annotated[InferenceSlotSpec | TrainingSlotSpec, Field(discriminator="kind")]
"""A slot spec; ``kind`` selects the variant."""
