"""Operator-authored documents: placement, slots, policy and the fleet layout (DESIGN 3.2-3.5)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictFloat, StrictInt, model_validator

from haru_protocol._base import (
    DurationMs,
    Flag,
    GpuIndex,
    HttpUrl,
    ModelName,
    NonEmptyStr,
    Port,
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


DEFAULT_VLLM_VERSION = "0.33.0"
"""vLLM release a provisioned domain installs unless its layout pins another."""

DEFAULT_GPU_MEMORY_BUDGET = 0.9
"""Share of a GPU's memory the vLLM servers on it get together by default (vLLM's own
default for one server); split evenly between the models of the GPU."""

MAX_GPU_MEMORY_BUDGET = 0.95
"""The most the explicit shares of one GPU's models may add up to."""

_VERSION_RE = re.compile(r"[0-9]+(\.[0-9A-Za-z]+)*([.+-][0-9A-Za-z.]+)?")
_ARG_RE = re.compile(r"[^\x00-\x1f\x7f]+")


def _check_version(value: str) -> str:
    if _VERSION_RE.fullmatch(value) is None:
        raise ValueError(f"{value!r} is not a release version such as '0.33.0'")
    return value


def _check_arg(value: str) -> str:
    if not value or _ARG_RE.fullmatch(value) is None:
        raise ValueError(f"argument {value!r} must be non-empty without control characters")
    return value


ReleaseVersion = Annotated[str, AfterValidator(_check_version)]
"""A package release version (digits, dots, and a PEP 440 or local suffix)."""

CliArg = Annotated[str, AfterValidator(_check_arg)]
"""One command-line argument (passed as one argv item, never through a shell)."""


def _is_unset(value: object) -> bool:
    # Provisioning-only keys are left out of dumps when unset, so static documents (and the
    # slot specs stored from them) keep their exact shape.
    return value is None or value == ()


class ModelBinding(WireModel):
    """One model an inference slot serves, and where the proxy reaches it."""

    name: ModelName
    """Routing key (the ``model`` field of requests); equals vLLM's ``--served-model-name``."""
    serving_url: HttpUrl | None = None
    """Base URL of the vLLM server of this model (path prefix and query are kept). Required on
    a ``static`` domain; on a provisioned domain Haru records it once the machine is up."""
    source: NonEmptyStr | None = Field(default=None, exclude_if=_is_unset)
    """Provisioned domains: what vLLM loads (a Hugging Face repo id or a path on the machine);
    the model's name when omitted."""
    gpu_memory_utilization: Annotated[StrictFloat, Field(gt=0, le=MAX_GPU_MEMORY_BUDGET)] | None = (
        Field(default=None, exclude_if=_is_unset)
    )
    """Provisioned domains: this server's share of its GPU's memory (vLLM's
    ``--gpu-memory-utilization``); by default the GPU's models split 0.9 evenly."""
    extra_vllm_args: tuple[CliArg, ...] = Field(default=(), exclude_if=_is_unset)
    """Provisioned domains: further ``vllm serve`` arguments, appended verbatim (Haru's own
    flags: model, served name, host, port, sleep mode and memory share are set already)."""
    api_key_env: NonEmptyStr | None = Field(default=None, exclude_if=_is_unset)
    """Static domains: name of a variable of the Haru server's environment holding the serving
    credential of ``servingUrl`` (vLLM's ``--api-key``); the proxy sends it as ``Authorization:
    Bearer`` on every request it forwards there. Only the name is stored, never the value."""
    api_key_file: NonEmptyStr | None = Field(default=None, exclude_if=_is_unset)
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


class ProbeSettings(WireModel):
    """The synthetic inference probe run against every model after a wake."""

    prompt: NonEmptyStr = "ping"
    max_tokens: Annotated[StrictInt, Field(ge=1, le=4096)] = 4


class Policy(WireModel):
    """A fleet's resolved policy: the operator's patch over the current defaults (DESIGN 3.5)."""

    auto_failover: Flag = False
    """Promote a standby automatically when the active fails or goes stale."""
    heartbeat_stale_ms: DurationMs = 30_000
    """An active heartbeat older than this is stale."""
    degraded_grace_ms: DurationMs = 60_000
    """How long the active may stay degraded before escalating to failed."""
    dead_confirm_ms: DurationMs = 1_000
    """How long the active's vLLM servers must stay proven dead (connection refused on every
    model the active serves, its supervisor answering) before the active fails without
    waiting for ``degradedGraceMs``: a second heartbeat this long after the first must still
    prove it."""
    training_stop_grace_ms: DurationMs = 30_000
    """SIGTERM to SIGKILL grace for training (a planned promotion: room for a checkpoint)."""
    failover_training_stop_grace_ms: DurationMs = 5_000
    """SIGTERM to SIGKILL grace for training when the promotion is an automatic failover:
    while the active is down every second is failed traffic, so the trainer gets less time."""
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
    launch_timeout_ms: DurationMs = 1_800_000
    """Provisioned domains: budget of ``sky launch`` / ``sky serve up`` (provisioning, setup)."""
    cluster_up_timeout_ms: DurationMs = 1_800_000
    """Provisioned domains: how long after its launch started a cluster may take to be UP (a
    service to have a READY replica) before the domain fails."""
    supervisor_ready_timeout_ms: DurationMs = 1_800_000
    """Provisioned domains: how long after its address was recorded the domain may take to send
    its first good heartbeat (vLLM install and model load happen in this window)."""
    relaunch_max_attempts: Annotated[StrictInt, Field(ge=0, le=1000)] = 3
    """Provisioned domains: automatic relaunches of a lost cluster before giving up (0: never);
    the count restarts once the domain is ready again."""
    relaunch_backoff_base_ms: DurationMs = 60_000
    """Pause before the first relaunch of a lost cluster; it doubles with every further one."""
    relaunch_backoff_max_ms: DurationMs = 900_000
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
    dead_confirm_ms: DurationMs | None = None
    training_stop_grace_ms: DurationMs | None = None
    failover_training_stop_grace_ms: DurationMs | None = None
    stop_training_timeout_ms: DurationMs | None = None
    verify_gpu_timeout_ms: DurationMs | None = None
    wake_timeout_ms: DurationMs | None = None
    probe_timeout_ms: DurationMs | None = None
    switch_active_timeout_ms: DurationMs | None = None
    sleep_timeout_ms: DurationMs | None = None
    start_training_timeout_ms: DurationMs | None = None
    promotion_backoff_base_ms: DurationMs | None = None
    promotion_backoff_max_ms: DurationMs | None = None
    launch_timeout_ms: DurationMs | None = None
    cluster_up_timeout_ms: DurationMs | None = None
    supervisor_ready_timeout_ms: DurationMs | None = None
    relaunch_max_attempts: Annotated[StrictInt, Field(ge=0, le=1000)] | None = None
    relaunch_backoff_base_ms: DurationMs | None = None
    relaunch_backoff_max_ms: DurationMs | None = None
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


def merge_policy_patch(stored: Mapping[str, Any], update: WireModel) -> dict[str, Any]:
    """``stored`` (an operator's policy values, camelCase) with ``update`` merged in.

    JSON Merge Patch (RFC 7396) over the keys ``update`` was given: a value replaces the
    operator's, null removes it (the key follows the current default again), an object
    (``probe``) is merged key by key; keys ``update`` was not given are kept.
    """
    merged = dict(stored)
    for name in update.model_fields_set:
        field = type(update).model_fields[name]
        key = field.alias or name
        value = getattr(update, name)
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, WireModel):
            inner = merged.get(key)
            nested = merge_policy_patch(inner if isinstance(inner, Mapping) else {}, value)
            if nested:
                merged[key] = nested
            else:
                merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def policy_differences(left: Policy, right: Policy) -> list[tuple[str, object, object]]:
    """Each resolved key whose value differs, as ``(key, left value, right value)``.

    Keys are camelCase (``probe.prompt`` for a probe key), in the model's order.
    """
    first = left.model_dump(mode="json")
    second = right.model_dump(mode="json")
    differences: list[tuple[str, object, object]] = []
    for key, value in first.items():
        other = second.get(key)
        if isinstance(value, dict) and isinstance(other, dict):
            differences.extend(
                (f"{key}.{inner}", value[inner], other.get(inner))
                for inner in value
                if value[inner] != other.get(inner)
            )
        elif value != other:
            differences.append((key, value, other))
    return differences


class Provisioning(WireModel):
    """How Haru sets up the machine of a ``skypilot`` or ``skyserve`` domain."""

    vllm_version: ReleaseVersion = DEFAULT_VLLM_VERSION
    """The vLLM release ``setup`` installs (``pip install vllm==<version>``)."""
    supervisor_package: NonEmptyStr = "haru-supervisor"
    """What ``setup`` installs for the supervisor and the serving gateway (``haru-gateway``):
    a requirement (``haru-supervisor==0.2.0``), a wheel URL or a path on the machine."""
    supervisor_port: Port = 8701
    """Public port of the supervisor."""
    gateway_port: Port = 8000
    """Public port of the serving gateway (``haru-gateway``): behind the server's
    ``HARU_SERVING_TOKEN``, it forwards only the inference routes (``/v1/chat/completions``,
    ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``) of ``/m/<model>/...`` (the name
    percent-encoded) to that model's vLLM server, so vLLM's admin routes stay on 127.0.0.1."""
    vllm_base_port: Port = 8100
    """The vLLM servers listen on 127.0.0.1, ports counted up from this one."""
    install: Flag = True
    """``setup`` installs vLLM (``vllmVersion``) and ``supervisorPackage`` with pip; ``false``
    when the machine image already has ``vllm`` and ``haru-supervisor`` on its ``PATH`` (the
    task then has no ``setup`` and fetches nothing)."""
    relaunch: Flag = True
    """Relaunch the cluster when SkyPilot reports it lost (preempted, stopped, gone)."""
    replicas: Annotated[StrictInt, Field(ge=1, le=100)] = 1
    """``skyserve`` only: the fixed number of replicas."""
    readiness_initial_delay_s: Annotated[StrictInt, Field(ge=0, le=86_400)] = 3_600
    """``skyserve`` only: seconds SkyServe's readiness probe waits before a failed probe
    counts (``initial_delay_seconds``). SkyServe's own default, 1,200 s, can be shorter than
    installing vLLM plus loading a large model, and a replica failed then is replaced."""


class DomainLayout(WireModel):
    """One failure domain of a layout."""

    slug: Slug
    provider: Provider = Provider.STATIC
    placement: Placement
    supervisor_url: HttpUrl | None = None
    """Base URL of the domain's supervisor; without it Haru cannot drive the domain."""
    serving_base_url: HttpUrl | None = None
    """Public endpoint of the domain's inference servers (published in the route intent)."""
    provisioning: Provisioning | None = Field(default=None, exclude_if=_is_unset)
    """Provisioned domains: installation and ports (defaults apply when omitted)."""
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
        if self.provider is Provider.STATIC:
            self._check_static()
        else:
            self._check_provisioned()
        return self

    def _check_static(self) -> None:
        for slot in self.inference_slots:
            for model in slot.models:
                if model.api_key_env is not None and model.api_key_file is not None:
                    raise ValueError(
                        f"domain {self.slug!r}: model {model.name!r} sets both apiKeyEnv and "
                        "apiKeyFile; keep one"
                    )
        if self.provisioning is not None:
            raise ValueError(f"domain {self.slug!r}: `provisioning` needs a provisioned provider")
        for slot in self.inference_slots:
            for model in slot.models:
                if model.serving_url is None:
                    raise ValueError(
                        f"domain {self.slug!r}: model {model.name!r} needs a servingUrl "
                        "(static domains are not provisioned by Haru)"
                    )
                if model.provisioning_keys:
                    raise ValueError(
                        f"domain {self.slug!r}: model {model.name!r} sets "
                        f"{model.provisioning_keys!r}, which only provisioned domains use"
                    )

    def _check_provisioned(self) -> None:
        given = [
            key
            for key, value in (
                ("supervisorUrl", self.supervisor_url),
                ("servingBaseUrl", self.serving_base_url),
            )
            if value is not None
        ]
        given += [
            f"servingUrl of {m.name!r}"
            for s in self.inference_slots
            for m in s.models
            if m.serving_url is not None
        ]
        keyed = [
            m.name
            for s in self.inference_slots
            for m in s.models
            if m.api_key_env is not None or m.api_key_file is not None
        ]
        if keyed:
            raise ValueError(
                f"domain {self.slug!r} ({self.provider.value}): apiKeyEnv/apiKeyFile of "
                f"{keyed!r} apply to static domains only; a provisioned domain's gateway takes "
                "the server's HARU_SERVING_TOKEN"
            )
        if given:
            raise ValueError(
                f"domain {self.slug!r} ({self.provider.value}): Haru records its URLs once the "
                f"machine is up; remove {', '.join(given)}"
            )
        if self.provider is Provider.SKYSERVE:
            self._check_skyserve()
        elif self.provisioning is not None and self.provisioning.replicas != 1:
            raise ValueError(f"domain {self.slug!r}: `replicas` applies to skyserve domains only")
        settings = self.settings
        ports = [settings.supervisor_port, settings.gateway_port]
        count = sum(len(s.models) for s in self.inference_slots)
        vllm_ports = range(settings.vllm_base_port, settings.vllm_base_port + count)
        if vllm_ports and vllm_ports[-1] > 65535:
            raise ValueError(
                f"domain {self.slug!r}: vllmBasePort leaves no room for {count} models"
            )
        if len(set(ports)) != len(ports) or any(p in vllm_ports for p in ports):
            raise ValueError(
                f"domain {self.slug!r}: supervisorPort, gatewayPort and the vLLM ports "
                f"({settings.vllm_base_port}..{settings.vllm_base_port + count - 1}) must differ"
            )

    def _check_skyserve(self) -> None:
        # What Haru's promotion needs that a SkyServe service cannot give (driver-skyserve
        # README, "What a SkyServe domain supports"): its replicas sit behind one load
        # balancer, run no Haru supervisor, and can neither sleep nor train one by one.
        where = f"domain {self.slug!r} (skyserve)"
        if any(isinstance(s, TrainingSlotSpec) for s in self.slots):
            raise ValueError(
                f"{where}: a SkyServe service cannot train (its replicas sit behind one load "
                "balancer and cannot be put to sleep one by one); use provider `skypilot` for "
                "a standby that trains"
            )
        count = self.placement.accelerator_count
        pinned = sorted({s.gpu_index for s in self.slots if s.gpu_index >= count})
        if pinned:
            raise ValueError(
                f"{where}: gpuIndex {pinned!r} does not exist on a replica with "
                f"acceleratorCount {count} (every replica pins its models to GPUs 0.."
                f"{count - 1})"
            )
        asked = (
            []
            if self.provisioning is None
            else sorted({"supervisor_port"} & self.provisioning.model_fields_set)
        )
        if asked:
            raise ValueError(
                f"{where}: supervisorPort asks for a Haru supervisor, and SkyServe replicas run "
                "none (the load balancer exposes only the serving gateway)"
            )

    @property
    def settings(self) -> Provisioning:
        """The provisioning settings, defaults filled in."""
        return self.provisioning if self.provisioning is not None else Provisioning()

    @property
    def inference_slots(self) -> tuple[InferenceSlotSpec, ...]:
        """The inference slots of this domain."""
        return tuple(s for s in self.slots if isinstance(s, InferenceSlotSpec))


class FleetLayout(WireModel):
    """Declarative seed document of a fleet (DESIGN 3.4); applying it is additive and idempotent."""

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
        standbys = [
            d.slug
            for d in self.domains
            if d.provider is Provider.SKYSERVE and d.slug != self.active_domain_slug
        ]
        if standbys:
            raise ValueError(
                f"skyserve domain(s) {standbys!r} would be standbys: a standby is put to sleep "
                "(and trains) and is promoted by waking and probing it through its supervisor, "
                "and a SkyServe service can do none of that; a skyserve domain can only be the "
                "activeDomainSlug (use provider `skypilot` for standbys)"
            )
        return self
