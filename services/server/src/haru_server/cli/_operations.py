"""``haru promote`` and ``haru demote``: request an operation on a domain and follow it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from haru_server.cli._common import (
    DEFAULT_URL,
    EXIT_OPERATION_FAILED,
    EXIT_WAIT_TIMEOUT,
    CliFailure,
    DriveOption,
    JsonOption,
    TimeoutOption,
    TokenOption,
    UrlOption,
    WaitOption,
    _client,
    _guard,
    _run,
)
from haru_server.cli._render import _console, _escape, _print_json

if TYPE_CHECKING:
    from haru_protocol import DomainSnapshot, FleetSnapshot, Operation, OperationKind

    from haru_server.control_client import ControlClient


def resolve_domain(fleet: FleetSnapshot, domain: str) -> DomainSnapshot:
    """The fleet's domain named by slug or id (any case)."""
    for candidate in fleet.domains:
        if candidate.slug == domain or str(candidate.id) == domain.lower():
            return candidate
    known = ", ".join(d.slug for d in fleet.domains)
    raise CliFailure(f"fleet {fleet.slug!r} has no domain {domain!r} (domains: {known})", code=2)


class _WaitTimedOut(CliFailure):
    """``--wait`` ran out with the operation still in flight (exit 4)."""

    def __init__(self, operation: Operation, timeout_s: float) -> None:
        super().__init__(
            f"operation {operation.id} still {operation.state.value} after {timeout_s}s",
            code=EXIT_WAIT_TIMEOUT,
        )
        self.operation = operation


async def _follow_operation(
    client: ControlClient,
    ref: str,
    operation: Operation,
    *,
    drive: bool,
    timeout_s: float,
    quiet: bool = False,
) -> Operation:
    import asyncio
    import contextlib
    import time

    from haru_core import plan_for
    from haru_protocol import OperationState

    console = _console()
    plan = plan_for(operation.kind)
    shown = 0
    deadline = time.monotonic() + timeout_s
    status = None if quiet else console.status(_escape(f"{operation.kind.value}: waiting"))
    with status if status is not None else contextlib.nullcontext():
        while True:
            if operation.current_step is not None and status is not None:
                reached = plan.index(operation.current_step)
                succeeded = operation.state is OperationState.SUCCEEDED
                upto = reached + 1 if succeeded else reached
                for step in plan[shown:upto]:
                    console.print(f"  [green]done[/]  {_escape(step.value)}")
                shown = max(shown, upto)
                status.update(_escape(f"{operation.kind.value}: {operation.current_step.value}"))
            if operation.state not in (OperationState.PENDING, OperationState.RUNNING):
                return operation
            if time.monotonic() >= deadline:
                raise _WaitTimedOut(operation, timeout_s)
            if drive:
                await client.reconcile(ref)
            else:
                await asyncio.sleep(0.2)
            operation = await client.operation(ref, operation.id)


def _request(
    kind: OperationKind,
    ref: str,
    domain: str,
    *,
    url: str,
    token: str | None,
    wait: bool,
    drive: bool,
    timeout_s: float,
    as_json: bool = False,
) -> None:
    from haru_protocol import AcceptedResponse, AlreadyActiveResponse, OperationState

    console = _console()

    async def go() -> Operation | None:
        async with _client(url, token) as client:
            fleet = await client.fleet(ref)
            target = resolve_domain(fleet, domain)
            answer = await client.request_operation(ref, kind, target.id)
            if as_json and not (wait and isinstance(answer, AcceptedResponse)):
                _print_json(answer.model_dump_json())
                return None
            if isinstance(answer, AlreadyActiveResponse):
                console.print(
                    f"domain [bold]{_escape(target.slug)}[/] is already active "
                    f"(route revision {answer.route_revision})"
                )
                return None
            operation = answer.operation
            if not as_json:
                console.print(
                    f"{kind.value} of [bold]{_escape(target.slug)}[/] accepted: "
                    f"operation {operation.id} ({_escape(operation.state.value)})"
                )
            if not wait:
                return None
            return await _follow_operation(
                client, ref, operation, drive=drive, timeout_s=timeout_s, quiet=as_json
            )

    def body() -> None:
        try:
            final = _run(go())
        except _WaitTimedOut as exc:
            if as_json:
                _print_json(exc.operation.model_dump_json())
            raise
        if final is None:
            return
        if as_json:
            _print_json(final.model_dump_json())
        if final.state is OperationState.SUCCEEDED:
            if not as_json:
                console.print(f"[bold green]{_escape(kind.value)} succeeded[/]")
            return
        error = final.error
        reason = (
            f"{error.code} at {error.step.value if error.step else '?'}: {error.message}"
            if error is not None
            else final.state.value
        )
        raise CliFailure(f"{kind.value} {final.state.value}: {reason}", code=EXIT_OPERATION_FAILED)

    _guard(body)


def _operation_command(kind: str, domain_help: str, summary: str) -> Callable[..., None]:
    """The command that requests a ``kind`` operation (``promote``, ``demote``) on one domain."""

    def command(
        ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
        domain: str,
        wait: WaitOption = False,
        drive: DriveOption = False,
        timeout: TimeoutOption = 600.0,
        url: UrlOption = DEFAULT_URL,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        from haru_protocol import OperationKind

        _request(
            OperationKind(kind),
            ref,
            domain,
            url=url,
            token=token,
            wait=wait,
            drive=drive,
            timeout_s=timeout,
            as_json=as_json,
        )

    # The one difference between the commands is the domain's help: an annotation object here,
    # which typer takes as it is (the other annotations are strings it evaluates in this module).
    command.__annotations__["domain"] = Annotated[str, typer.Argument(help=domain_help)]
    command.__doc__ = summary
    command.__name__ = command.__qualname__ = kind
    return command


promote = _operation_command(
    "promote", "Domain slug or id to make active.", "Promote a standby domain to active."
)
demote = _operation_command(
    "demote", "Standby domain slug or id.", "Put a standby domain to sleep and start its training."
)
