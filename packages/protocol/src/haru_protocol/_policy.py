"""A fleet's policy: the operator's patch, its defaults, and how the two combine (DESIGN 3.5)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, StrictInt

from haru_protocol._base import DurationMs, Flag, NonEmptyStr, WireModel


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
