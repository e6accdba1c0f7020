"""Operator-authored documents: placement, slots, policy and the fleet layout (SPEC 3.2-3.5)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, model_validator

from haru_protocol._base import (
    DurationMs,
    Flag,
    GpuIndex,
    HttpUrl,
    ModelName,
    NonEmptyStr,
    Slug,
    WireModel,
)
from haru_protocol._enums import Cloud, Provider, SlotKind


class Placement(WireModel):
    """Where a domain's machines live (SkyPilot vocabulary; Haru never calls a cloud API)."""

    cloud: Cloud
    """Cloud name, as SkyPilot's ``infra`` key spells it."""
    region: NonEmptyStr
    """Region within the cloud."""
    accelerator: NonEmptyStr
    """SkyPilot accelerator name; required because Haru hard-codes no GPU model."""
    accelerator_count: Annotated[StrictInt, Field(ge=1)] = 1
    """Accelerators per machine."""
    use_spot: Flag = False
    """Whether to ask for spot (preemptible) machines."""


class ModelBinding(WireModel):
    """One model an inference slot serves, and where the proxy reaches it."""

    name: ModelName
    """Routing key (the ``model`` field of requests); equals vLLM's ``--served-model-name``."""
    serving_url: HttpUrl
    """Base URL of the vLLM server of this model (path prefix and query are kept)."""


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
        return self


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


class ProbeSettings(WireModel):
    """The synthetic inference probe run against every model after a wake."""

    prompt: NonEmptyStr = "ping"
    max_tokens: Annotated[StrictInt, Field(ge=1, le=4096)] = 4


class Policy(WireModel):
    """A fleet's resolved policy: the operator's patch over the current defaults (SPEC 3.5)."""

    auto_failover: Flag = False
    """Promote a standby automatically when the active fails or goes stale."""
    heartbeat_stale_ms: DurationMs = 30_000
    """An active heartbeat older than this is stale."""
    degraded_grace_ms: DurationMs = 60_000
    """How long the active may stay degraded before escalating to failed."""
    training_stop_grace_ms: DurationMs = 30_000
    """SIGTERM to SIGKILL grace for training."""
    stop_training_timeout_ms: DurationMs = 90_000
    verify_gpu_timeout_ms: DurationMs = 30_000
    wake_timeout_ms: DurationMs = 120_000
    probe_timeout_ms: DurationMs = 60_000
    switch_active_timeout_ms: DurationMs = 10_000
    sleep_timeout_ms: DurationMs = 60_000
    """Budget of demote_old_sleep and sleep_vllm."""
    start_training_timeout_ms: DurationMs = 30_000
    """Budget of demote_old_train and start_training."""
    promotion_backoff_base_ms: DurationMs = 30_000
    """Pause before an automatic promotion retries a target whose last promotion failed; it
    doubles with every further consecutive failure of that target."""
    promotion_backoff_max_ms: DurationMs = 900_000
    """Upper bound of that pause."""
    probe: ProbeSettings = ProbeSettings()


class ProbePatch(WireModel):
    """The probe keys an operator wrote."""

    prompt: NonEmptyStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None


class PolicyPatch(WireModel):
    """Only the policy keys an operator wrote; everything else follows the current defaults."""

    auto_failover: Flag | None = None
    heartbeat_stale_ms: DurationMs | None = None
    degraded_grace_ms: DurationMs | None = None
    training_stop_grace_ms: DurationMs | None = None
    stop_training_timeout_ms: DurationMs | None = None
    verify_gpu_timeout_ms: DurationMs | None = None
    wake_timeout_ms: DurationMs | None = None
    probe_timeout_ms: DurationMs | None = None
    switch_active_timeout_ms: DurationMs | None = None
    sleep_timeout_ms: DurationMs | None = None
    start_training_timeout_ms: DurationMs | None = None
    promotion_backoff_base_ms: DurationMs | None = None
    promotion_backoff_max_ms: DurationMs | None = None
    probe: ProbePatch | None = None

    def stored(self) -> dict[str, Any]:
        """The JSON object to store: only the keys that carry a value (camelCase)."""
        return self.model_dump(mode="json", exclude_none=True)

    def resolve(self) -> Policy:
        """Resolve this patch against the CURRENT defaults."""
        return resolve_policy(self)


def resolve_policy(patch: PolicyPatch | None) -> Policy:
    """Resolve an operator's policy patch (or none) against the current defaults."""
    if patch is None:
        return Policy()
    values = patch.model_dump(exclude_none=True, by_alias=False)
    probe_values = values.pop("probe", None)
    if probe_values is not None:
        values["probe"] = ProbeSettings(**probe_values)
    return Policy(**values)


class DomainLayout(WireModel):
    """One failure domain of a layout."""

    slug: Slug
    provider: Provider = Provider.STATIC
    placement: Placement
    supervisor_url: HttpUrl | None = None
    """Base URL of the domain's supervisor; without it Haru cannot drive the domain."""
    serving_base_url: HttpUrl | None = None
    """Public endpoint of the domain's inference servers (published in the route intent)."""
    slots: tuple[SlotSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_slots(self) -> DomainLayout:
        seen: set[tuple[int, SlotKind]] = set()
        for slot in self.slots:
            key = (slot.gpu_index, slot.kind)
            if key in seen:
                raise ValueError(
                    f"domain {self.slug!r}: duplicate {slot.kind.value} slot "
                    f"on GPU {slot.gpu_index}"
                )
            seen.add(key)
        names = [m.name for s in self.slots if isinstance(s, InferenceSlotSpec) for m in s.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"domain {self.slug!r}: model names bound twice: {duplicates!r}")
        return self

    @property
    def inference_slots(self) -> tuple[InferenceSlotSpec, ...]:
        """The inference slots of this domain."""
        return tuple(s for s in self.slots if isinstance(s, InferenceSlotSpec))


class FleetLayout(WireModel):
    """Declarative seed document of a fleet (SPEC 3.4); applying it is additive and idempotent."""

    schema_uri: str | None = Field(default=None, alias="$schema")
    """Optional JSON Schema reference for editors; ignored by Haru."""
    slug: Slug
    display_name: NonEmptyStr | None = None
    active_domain_slug: Slug | None = None
    """The domain that serves first (it must have an inference slot)."""
    policy: PolicyPatch | None = None
    domains: tuple[DomainLayout, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_domains(self) -> FleetLayout:
        slugs = [d.slug for d in self.domains]
        duplicates = sorted({s for s in slugs if slugs.count(s) > 1})
        if duplicates:
            raise ValueError(f"duplicate domain slugs: {duplicates!r}")
        if self.active_domain_slug is not None:
            active = next((d for d in self.domains if d.slug == self.active_domain_slug), None)
            if active is None:
                raise ValueError(
                    f"activeDomainSlug {self.active_domain_slug!r} is not a listed domain"
                )
            if not active.inference_slots:
                raise ValueError(
                    f"activeDomainSlug {self.active_domain_slug!r} has no inference slot"
                )
        return self
