"""Audit event payloads of provisioned domains: launch, address, lost cluster, teardown."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
)

from haru_protocol._enums import (
    DomainState,
    EventType,
)
from haru_protocol._event_base import EventPayload, Role, _optional


class DomainLaunchStarted(EventPayload):
    """``domain.launch.started``: the reconciler claimed launch ``attempt`` and runs it."""

    event_type = EventType.DOMAIN_LAUNCH_STARTED

    cluster: str
    """The SkyPilot cluster name."""
    attempt: StrictInt
    """The domain's launch attempt (1 for the first launch)."""
    role: Role


class DomainLaunchSucceeded(EventPayload):
    """``domain.launch.succeeded``: ``sky launch -d`` returned.

    Or, after a restart, the cluster of a claimed attempt was found UP (``observed``).
    """

    event_type = EventType.DOMAIN_LAUNCH_SUCCEEDED

    cluster: str
    attempt: StrictInt
    observed: StrictBool = False
    """True when no launch was awaited: the cluster was found UP by ``sky status``."""


ProvisioningFailure = Literal[
    "launch_failed",
    "launch_timeout",
    "launch_lost",
    "cluster_up_timeout",
    "cluster_lost",
    "supervisor_ready_timeout",
]
"""Why a provisioned domain failed before it was ready."""


class DomainProvisioningFailed(EventPayload):
    """``domain.provisioning.failed``: a provisioned domain failed before it was ready."""

    event_type = EventType.DOMAIN_PROVISIONING_FAILED

    cluster: str
    attempt: StrictInt
    reason: ProvisioningFailure
    message: str
    """One bounded line (never a secret)."""
    argv: tuple[str, ...] | None = _optional()
    """The failed ``sky`` command, when one failed."""
    exit_code: StrictInt | None = _optional()
    stderr: str | None = _optional()
    """The bounded tail of its stderr."""
    cluster_status: str | None = _optional()
    """What ``sky status`` said (``absent`` for an unknown cluster)."""


class DomainAddressRecorded(EventPayload):
    """``domain.address.recorded``: the cluster is UP (or the service READY): URLs recorded."""

    event_type = EventType.DOMAIN_ADDRESS_RECORDED

    cluster: str
    attempt: StrictInt
    supervisor_url: str | None
    """None for a ``skyserve`` domain (its replicas run no Haru supervisor)."""
    serving_base_url: str
    """The head's gateway, or a SkyServe service's endpoint."""


class DomainClusterLost(EventPayload):
    """``domain.cluster.lost``: a launched domain's cluster is stopped or gone: it failed.

    SkyPilot reports it ``STOPPED`` (preempted, stopped) or does not know it (torn down).
    """

    event_type = EventType.DOMAIN_CLUSTER_LOST

    cluster: str
    attempt: StrictInt
    cluster_status: str
    """``STOPPED``, or ``absent`` when ``sky status`` does not know the cluster."""
    from_state: DomainState = Field(alias="from")
    role: Role


class DomainRelaunch(EventPayload):
    """``domain.relaunch``: a failed provisioned domain is launched again (one per attempt).

    Or relaunching gave up (``exhausted``): the domain stays failed.
    """

    event_type = EventType.DOMAIN_RELAUNCH

    cluster: str
    relaunch: StrictInt
    """Which relaunch of the current streak (1 = the first since the domain was last ready)."""
    max_attempts: StrictInt
    backoff_ms: StrictInt
    """The pause that was waited after the failure."""
    exhausted: StrictBool = False
    """True: ``relaunchMaxAttempts`` is spent; the domain stays failed."""


class DomainUpRequested(EventPayload):
    """``domain.up.requested``: the operator asked a stopped or failed domain to launch."""

    event_type = EventType.DOMAIN_UP_REQUESTED

    from_state: DomainState = Field(alias="from")


class DomainDownRequested(EventPayload):
    """``domain.down.requested``: the operator asked a standby domain to be torn down."""

    event_type = EventType.DOMAIN_DOWN_REQUESTED

    from_state: DomainState = Field(alias="from")


class DomainTeardown(EventPayload):
    """``domain.teardown``: ``sky down`` of a stopping domain ended (``ok``) or failed (retried)."""

    event_type = EventType.DOMAIN_TEARDOWN

    cluster: str
    ok: StrictBool
    message: str | None = _optional()
    argv: tuple[str, ...] | None = _optional()
    exit_code: StrictInt | None = _optional()
    stderr: str | None = _optional()
