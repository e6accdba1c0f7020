"""Whether a promote or demote request may create an operation (DESIGN 7.2)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from uuid import UUID

from haru_protocol import DomainSnapshot, FleetSnapshot, OperationKind

from haru_core._bindings import has_inference_bindings, is_active
from haru_core._states import PROMOTABLE_DOMAIN_STATES


@dataclass(frozen=True, slots=True)
class AlreadyActive:
    """The promotion target already serves: nothing to do (200 ``already_active``)."""

    route_revision: int
    """The fleet's current routing revision."""


class TargetProblem(StrEnum):
    """Why a target cannot be promoted or demoted."""

    NOT_IN_FLEET = "not_in_fleet"
    NOT_PROMOTABLE = "not_promotable"
    NO_INFERENCE_BINDINGS = "no_inference_bindings"
    NO_SUPERVISOR = "no_supervisor"
    TARGET_IS_ACTIVE = "target_is_active"


@dataclass(frozen=True, slots=True)
class InvalidTarget:
    """The request names a target that cannot be acted on (422 ``invalid_target``)."""

    problem: TargetProblem
    message: str
    """Operator-facing explanation naming the target and the reason (its state, ...)."""


@dataclass(frozen=True, slots=True)
class CreateOperation:
    """The request is valid: create (or join) an operation of ``kind`` on the target."""

    kind: OperationKind
    target_domain_id: UUID


def _target_problem(domain: DomainSnapshot, verb: str) -> InvalidTarget | None:
    if domain.state not in PROMOTABLE_DOMAIN_STATES:
        allowed = " or ".join(sorted(s.value for s in PROMOTABLE_DOMAIN_STATES))
        return InvalidTarget(
            TargetProblem.NOT_PROMOTABLE,
            f"domain {domain.slug!r} is {domain.state.value}; only a {allowed} domain can be "
            f"{verb}",
        )
    if not has_inference_bindings(domain):
        return InvalidTarget(
            TargetProblem.NO_INFERENCE_BINDINGS,
            f"domain {domain.slug!r} has no inference slot with a model binding",
        )
    if domain.supervisor_url is None:
        return InvalidTarget(
            TargetProblem.NO_SUPERVISOR,
            f"domain {domain.slug!r} has no supervisor URL, so nothing could drive it",
        )
    return None


def _not_in_fleet(fleet: FleetSnapshot, target_domain_id: UUID) -> InvalidTarget:
    return InvalidTarget(
        TargetProblem.NOT_IN_FLEET,
        f"domain {str(target_domain_id)!r} is not part of fleet {fleet.slug!r}",
    )


def decide_promotion(
    fleet: FleetSnapshot, target_domain_id: UUID
) -> AlreadyActive | InvalidTarget | CreateOperation:
    """Decide a promote request for ``target_domain_id``.

    Returns:
        :class:`AlreadyActive` when the routing pointer already targets the domain;
        :class:`InvalidTarget` when it is not in the fleet, not ready or degraded, has no
        inference bindings, or has no supervisor URL; else :class:`CreateOperation`.
    """
    domain = fleet.domain(target_domain_id)
    if domain is None:
        return _not_in_fleet(fleet, target_domain_id)
    if is_active(fleet, domain):
        return AlreadyActive(route_revision=fleet.route_revision)
    problem = _target_problem(domain, "promoted")
    if problem is not None:
        return problem
    return CreateOperation(kind=OperationKind.PROMOTE, target_domain_id=domain.id)


def decide_demotion(
    fleet: FleetSnapshot, target_domain_id: UUID
) -> InvalidTarget | CreateOperation:
    """Decide a demote request (sleep a standby and start its training).

    Returns:
        :class:`InvalidTarget` when the domain is the active one (the active can never be
        demoted) or fails the same rules as a promotion target; else :class:`CreateOperation`.
    """
    domain = fleet.domain(target_domain_id)
    if domain is None:
        return _not_in_fleet(fleet, target_domain_id)
    if is_active(fleet, domain):
        return InvalidTarget(
            TargetProblem.TARGET_IS_ACTIVE,
            f"domain {domain.slug!r} is the active domain and cannot be demoted; promote "
            "another domain first",
        )
    problem = _target_problem(domain, "demoted")
    if problem is not None:
        return problem
    return CreateOperation(kind=OperationKind.DEMOTE, target_domain_id=domain.id)
