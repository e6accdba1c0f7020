"""Heartbeat verdicts: what a supervisor's status report means for slot and domain state.

DESIGN 7.3 step 1. Everything is judged against the LAYOUT (the models the fleet binds), never
against the supervisor's own ``ready`` flag: a supervisor configured with fewer models than the
layout binds must not make its domain look healthy. The reconciler applies each change with its
own compare-and-swap, so one dead GPU never drags its siblings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, assert_never
from uuid import UUID

from haru_protocol import (
    DomainSnapshot,
    DomainState,
    EventType,
    FleetSnapshot,
    InferenceSlotState,
    SlotKind,
    SlotSnapshot,
    SlotState,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotState,
    TrainingStatus,
)

from haru_core._bindings import has_inference_bindings, inference_bindings, is_active, slot_bindings
from haru_core._states import assert_transition, can_transition, machine_for

_I = InferenceSlotState
_T = TrainingSlotState
_D = DomainState


@dataclass(frozen=True, slots=True)
class SlotChange:
    """Move one slot from ``from_state`` (the CAS guard) to ``to_state``."""

    slot_id: UUID
    kind: SlotKind
    from_state: SlotState
    to_state: SlotState


@dataclass(frozen=True, slots=True)
class HeartbeatVerdict:
    """The verdicts behind a domain change (None: not judged for this change).

    Attributes:
        role: The domain's role in its fleet.
        reachable: Whether the supervisor answered.
        supervisor_ready: The supervisor's own ``ready`` flag.
        active_ready: The active domain only: every model the layout binds is awake.
        models_not_awake: The active domain only, when not active-ready.
    """

    role: Literal["active", "standby"] | None = None
    reachable: bool | None = None
    supervisor_ready: bool | None = None
    active_ready: bool | None = None
    models_not_awake: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class DomainChange:
    """Move a domain from ``from_state`` (the CAS guard) to ``to_state``.

    ``event`` names a dedicated audit event (``domain.not_ready``, ``domain.heartbeat.failed``);
    None means an ordinary state change. ``detail`` holds the verdicts behind the change (the
    event payload's facts).
    """

    from_state: DomainState
    to_state: DomainState
    event: EventType | None = None
    detail: HeartbeatVerdict = field(default_factory=HeartbeatVerdict, hash=False)


def model_sleep_states(status: SupervisorStatus) -> dict[str, bool | None]:
    """Sleep state of every model the supervisor reports, by model name.

    ``True`` is asleep, ``False`` awake, ``None`` unproven (the server did not answer). A name
    reported twice with different answers counts as unproven.
    """
    states: dict[str, bool | None] = {}
    for slot in status.slots:
        for model in slot.models or ():
            if model.name in states and states[model.name] != model.sleeping:
                states[model.name] = None
            else:
                states[model.name] = model.sleeping
    return states


def _all_report(
    names: tuple[str, ...], sleeping: Mapping[str, bool | None], *, asleep: bool
) -> bool:
    # An omitted model reads as None, which equals neither True nor False: never proof.
    return bool(names) and all(sleeping.get(name) == asleep for name in names)


def _training_status(status: SupervisorStatus, gpu_index: int) -> TrainingStatus | None:
    for slot in status.slots:
        if slot.kind is SlotKind.TRAINING and slot.gpu_index == gpu_index:
            return slot.training
    return None


def _training_target(slot: SlotSnapshot, status: SupervisorStatus) -> TrainingSlotState | None:
    run = _training_status(status, slot.gpu_index)
    if run is None:
        return None
    if slot.state is _T.TRAINING and run.state is TrainingRunState.IDLE:
        return _T.IDLE
    if slot.state is _T.IDLE and run.state is TrainingRunState.RUNNING and run.pids:
        return _T.TRAINING
    return None


def models_busy(status: SupervisorStatus) -> frozenset[str]:
    """Models whose server is in a sleep or wake the supervisor sent (``action`` set).

    vLLM does not answer ``/is_sleeping`` meanwhile, so their ``sleeping`` is null: that means
    "busy", not "down", and no verdict is drawn from it.
    """
    return frozenset(
        model.name
        for slot in status.slots
        for model in slot.models or ()
        if model.action is not None
    )


_IN_BETWEEN = frozenset({_I.STARTING, _I.SERVING, _I.SLEEPING, _I.WAKING, _I.PROBING})
"""Inference states a heartbeat reconciles towards the role's posture when no operation
drives the domain (a crash mid-operation can leave any of them behind)."""


def _inference_target(
    slot: SlotSnapshot,
    sleeping: Mapping[str, bool | None],
    *,
    active: bool,
    busy: bool,
    in_flux: frozenset[str] = frozenset(),
) -> InferenceSlotState | None:
    names = tuple(b.name for b in slot_bindings(slot))
    if in_flux.intersection(names):
        return None  # a sleep or wake is under way: its end is the verdict
    # The active must be awake; a standby must be asleep. Anything else is a failed slot.
    healthy_state = _I.SERVING if active else _I.SLEEPING
    healthy = _all_report(names, sleeping, asleep=not active)
    if slot.state is healthy_state:
        return None if healthy else _I.FAILED
    if slot.state is _I.FAILED:
        return healthy_state if healthy else None
    if busy or slot.state not in _IN_BETWEEN:
        # An in-flight operation owns the states of the domains it drives.
        return None
    if healthy and can_transition("inference", slot.state, healthy_state):
        return healthy_state
    if slot.state is _I.STARTING:
        # Still loading: not proven either way, and never routable while starting.
        return None
    # Recorded in a posture the supervisor contradicts (serving on a standby whose vLLM
    # sleeps, sleeping on the active, ...): failed, so the next proof restores the posture.
    return _I.FAILED


def slot_health_changes(
    fleet: FleetSnapshot,
    domain: DomainSnapshot,
    status: SupervisorStatus,
    *,
    busy: bool = False,
) -> tuple[SlotChange, ...]:
    """The slot changes a supervisor's answer calls for, one per slot that must move.

    - training slot (any role): ``training`` to ``idle`` when the supervisor reports the run
      idle; ``idle`` to ``training`` when it reports it running WITH a pid. ``stopping``,
      ``failed`` and ``stopped`` are never touched. Supervisor slots match by
      ``(gpu_index, kind)``.
    - active domain, inference slot: ``serving`` to ``failed`` unless every model the layout
      binds to the slot reports awake; ``failed`` to ``serving`` when they all do.
    - standby domain, inference slot: ``sleeping`` to ``failed`` unless every layout-bound
      model reports asleep (unreachable, omitted and awake all count as not asleep);
      ``failed`` to ``sleeping`` when they all do.
    - either role, an inference slot in any other state (``starting``, ``waking``,
      ``probing``, or the other role's posture) while no operation drives the domain
      (``busy`` False): to the role's posture when the supervisor proves it and the state
      table allows the edge, else ``failed`` (a later proof repairs it); a ``starting`` slot
      that is not proven yet stays ``starting``. So a standby recorded ``serving`` whose
      supervisor says asleep goes back to ``sleeping``, in every direction.
    - an inference slot with a model in a sleep or wake (:func:`models_busy`) is left as is.

    Models the supervisor reports but the layout does not bind are ignored.
    """
    active = is_active(fleet, domain)
    sleeping = model_sleep_states(status)
    in_flux = models_busy(status)
    changes: list[SlotChange] = []
    for slot in domain.slots:
        target: SlotState | None
        match slot.kind:
            case SlotKind.TRAINING:
                target = _training_target(slot, status)
            case SlotKind.INFERENCE:
                target = _inference_target(
                    slot, sleeping, active=active, busy=busy, in_flux=in_flux
                )
            case _:
                assert_never(slot.kind)
        if target is not None:
            assert_transition(machine_for(slot.kind), slot.state, target)
            changes.append(SlotChange(slot.id, slot.kind, slot.state, target))
    return tuple(changes)


def _awake_verdict(domain: DomainSnapshot, status: SupervisorStatus) -> tuple[bool, list[str]]:
    sleeping = model_sleep_states(status)
    not_awake = [b.name for b in inference_bindings(domain) if sleeping.get(b.name) is not False]
    return has_inference_bindings(domain) and not not_awake, not_awake


def active_ready(domain: DomainSnapshot, status: SupervisorStatus) -> bool:
    """Whether ``domain`` could serve: it has inference bindings and every one reports awake."""
    ready, _ = _awake_verdict(domain, status)
    return ready


def _answered_target(state: DomainState, *, active: bool, ready: bool) -> DomainState | None:
    match state:
        case _D.PROVISIONING:
            return _D.DEGRADED if active and not ready else _D.READY
        case _D.FAILED:
            return _D.DEGRADED if ready or not active else None
        case _D.READY:
            return _D.DEGRADED if active and not ready else None
        case _D.DEGRADED:
            return _D.READY if ready or not active else None
        case _D.STOPPING | _D.STOPPED:
            # Teardown belongs to the operator and the drivers, not to heartbeats.
            return None
        case _:
            assert_never(state)


def domain_change_on_heartbeat(
    fleet: FleetSnapshot,
    domain: DomainSnapshot,
    status: SupervisorStatus | None,
    *,
    unauthorized: bool = False,
) -> DomainChange | None:
    """The domain change one heartbeat calls for (``status`` None: the supervisor did not answer).

    ``unauthorized``: the supervisor refused the server's token (401/403). That is a
    configuration error, never evidence about the domain's health: no change at all (the
    caller reports it loudly instead).

    Unanswered: ``ready`` goes to ``degraded`` (event ``domain.heartbeat.failed``). Answered,
    with ``active_ready`` judged against the layout: ``provisioning`` goes to ``degraded`` (the
    active, not ready) else ``ready``; ``failed`` goes to ``degraded`` (the active only when
    ready); an active that is ``ready`` but not active-ready goes to ``degraded`` (event
    ``domain.not_ready`` with both verdicts); ``degraded`` recovers to ``ready`` (a standby
    that answered, or an active-ready active). A verdict that rests only on models in a sleep
    or wake (:func:`models_busy`) changes nothing.
    """
    role: Literal["active", "standby"] = "active" if is_active(fleet, domain) else "standby"
    if unauthorized:
        return None
    if status is None:
        if domain.state is not _D.READY:
            return None
        change = DomainChange(
            _D.READY,
            _D.DEGRADED,
            EventType.DOMAIN_HEARTBEAT_FAILED,
            HeartbeatVerdict(role=role, reachable=False),
        )
    else:
        ready, not_awake = _awake_verdict(domain, status)
        if not ready and not_awake and models_busy(status).issuperset(not_awake):
            return None  # only models in a sleep or wake are not awake: busy, not degraded
        target = _answered_target(domain.state, active=role == "active", ready=ready)
        if target is None:
            return None
        event = (
            EventType.DOMAIN_NOT_READY
            if role == "active" and domain.state is _D.READY and target is _D.DEGRADED
            else None
        )
        detail = HeartbeatVerdict(role=role, reachable=True, supervisor_ready=status.ready)
        if role == "active":
            detail = replace(
                detail,
                active_ready=ready,
                models_not_awake=None if ready else tuple(not_awake),
            )
        change = DomainChange(domain.state, target, event, detail)
    assert_transition("domain", change.from_state, change.to_state)
    return change
