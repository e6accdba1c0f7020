"""The fleet layout document: its domains, their placement and provisioning (DESIGN 3.2-3.4).

A domain's slots are :mod:`haru_protocol._slots`; the fleet's policy is
:mod:`haru_protocol._policy`.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, StrictInt, model_validator

from haru_protocol._base import Flag, HttpUrl, NonEmptyStr, Port, Slug, WireModel
from haru_protocol._enums import Cloud, Provider, SlotKind
from haru_protocol._policy import PolicyPatch
from haru_protocol._slots import InferenceSlotSpec, SlotSpec, TrainingSlotSpec, is_unset


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

_VERSION_RE = re.compile(r"[0-9]+(\.[0-9A-Za-z]+)*([.+-][0-9A-Za-z.]+)?")


def _check_version(value: str) -> str:
    if _VERSION_RE.fullmatch(value) is None:
        raise ValueError(f"{value!r} is not a release version such as '0.33.0'")
    return value


ReleaseVersion = Annotated[str, AfterValidator(_check_version)]
"""A package release version (digits, dots, and a PEP 440 or local suffix)."""


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
    provisioning: Provisioning | None = Field(default=None, exclude_if=is_unset)
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
