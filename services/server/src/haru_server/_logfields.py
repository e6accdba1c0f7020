"""The fields of a reconciler log line: which fleet, domain, operation and step it is about.

Passed as ``extra``: JSON logs carry them as keys, text logs append them as ``key=value``, so
a log search needs no parsing of the message text.
"""

from __future__ import annotations

from uuid import UUID

from haru_protocol import DomainSnapshot, FleetSnapshot, Operation, OperationStep


def log_fields(
    fleet: FleetSnapshot,
    *,
    domain: DomainSnapshot | UUID | None = None,
    operation: Operation | None = None,
    step: OperationStep | None = None,
) -> dict[str, str]:
    """The ``extra`` of a line about ``fleet`` (and a domain, an operation, a step).

    Keys: ``fleet``, ``fleet_id``, ``domain``, ``domain_id``, ``operation_id``,
    ``operation_kind`` and ``step``, each where known.

    The domain defaults to the operation's target, the step to the operation's current one; a
    domain given by id is named by its slug when the fleet holds it.
    """
    fields = {"fleet": fleet.slug, "fleet_id": str(fleet.id)}
    if domain is None and operation is not None:
        domain = operation.target_domain_id
    if isinstance(domain, DomainSnapshot):
        fields["domain"] = domain.slug
        fields["domain_id"] = str(domain.id)
    elif domain is not None:
        slug = next((d.slug for d in fleet.domains if d.id == domain), None)
        if slug is not None:
            fields["domain"] = slug
        fields["domain_id"] = str(domain)
    if operation is not None:
        fields["operation_id"] = str(operation.id)
        fields["operation_kind"] = operation.kind.value
        step = step or operation.current_step
    if step is not None:
        fields["step"] = step.value
    return fields
