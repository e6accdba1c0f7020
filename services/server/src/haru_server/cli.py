"""The ``haru`` command line: run the server, prepare the store, and drive fleets over HTTP.

Every command that talks to a fleet does so through a running server's control API (``--url``
/ ``HARU_URL``, ``--token`` / ``HARU_API_TOKEN``); only ``haru db upgrade`` and ``haru seed``
open the state store directly (``DATABASE_URL``). Adding a command is one registration in
:func:`_register` (``haru demo`` will live in its own module).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from haru_core import is_active, plan_for
from haru_protocol import (
    AlreadyActiveResponse,
    DomainSnapshot,
    Event,
    FleetLayout,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationState,
    load_example_layout,
)
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from haru_server._control_client import ControlApiError, ControlClient
from haru_server._demo import demo as demo_command
from haru_server._settings import Settings, SettingsError

_T = TypeVar("_T")

DEFAULT_URL = "http://127.0.0.1:8700"

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

UrlOption = Annotated[
    str,
    typer.Option("--url", envvar="HARU_URL", help="Base URL of a running haru server."),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="HARU_API_TOKEN",
        help="Bearer token of the server's API (HARU_API_TOKEN).",
        show_default=False,
    ),
]
DatabaseOption = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="DATABASE_URL",
        help="PostgreSQL URL or SQLite URL/path; unset = the embedded SQLite default.",
        show_default=False,
    ),
]
WaitOption = Annotated[
    bool, typer.Option("--wait", help="Follow the operation through its steps until it ends.")
]
DriveOption = Annotated[
    bool,
    typer.Option(
        "--drive",
        help="While waiting, ask the server for reconcile ticks (for servers without a loop).",
    ),
]
TimeoutOption = Annotated[
    float, typer.Option("--timeout", min=1.0, help="Seconds to wait before giving up.")
]


class CliFailure(Exception):  # noqa: N818  # a message for the operator, not a bug
    """Ends the command with a message on stderr and a non-zero status."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _run(coro: Awaitable[_T]) -> _T:
    async def main() -> _T:
        return await coro

    try:
        return asyncio.run(main())
    except ControlApiError as exc:
        raise CliFailure(str(exc)) from exc


def _run_db(coro: Awaitable[_T]) -> _T:
    # The state store (SQLAlchemy, Alembic) is imported only by the commands that open it:
    # the remote commands start faster without it.
    from haru_db import HaruDbError

    try:
        return _run(coro)
    except HaruDbError as exc:
        raise CliFailure(f"state store: {exc}") from exc


def _fail(exc: CliFailure) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {exc}")
    return typer.Exit(exc.code)


def _guard(func: Callable[[], None]) -> None:
    try:
        func()
    except CliFailure as exc:
        raise _fail(exc) from None


# ---- serve -----------------------------------------------------------------------------------


def serve() -> None:
    """Run the control server (configured by the environment, see the README)."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = Settings.from_env(os.environ)
    except SettingsError as exc:
        raise _fail(CliFailure(f"invalid environment: {exc}", code=2)) from None
    from haru_db import HaruDbError

    from haru_server._eventloop import run
    from haru_server._serve import run_server
    from haru_server._workers import serve_workers

    try:
        if settings.workers > 1:
            code = serve_workers(settings)
            if code:
                raise typer.Exit(code)
        else:
            run(run_server(settings))
    except HaruDbError as exc:
        raise _fail(CliFailure(f"cannot start: state store: {exc}", code=1)) from None
    except OSError as exc:
        raise _fail(CliFailure(f"cannot start: {exc}", code=1)) from None


# ---- db and seed -----------------------------------------------------------------------------


def db_upgrade(database_url: DatabaseOption = None) -> None:
    """Apply the state store's migrations (refused when the schema is newer than this code)."""
    from haru_db import current_revision, redact_database_url, resolve_database_url, upgrade

    async def go() -> str | None:
        await upgrade(database_url)
        return await current_revision(database_url)

    def body() -> None:
        revision = _run_db(go())
        where = redact_database_url(resolve_database_url(database_url))
        console.print(f"{where}: schema at revision [bold]{revision}[/]")

    _guard(body)


def _load_layout(path: Path | None) -> FleetLayout:
    if path is None:
        return load_example_layout()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CliFailure(f"cannot read {path}: {exc}", code=2) from exc
    try:
        return FleetLayout.model_validate_json(text)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        ]
        raise CliFailure(
            f"{path} is not a valid fleet layout:\n" + "\n".join(lines), code=2
        ) from exc


def seed(
    layout: Annotated[
        Path | None,
        typer.Argument(
            help="Fleet layout JSON; default: the bundled two-domain example.", show_default=False
        ),
    ] = None,
    database_url: DatabaseOption = None,
) -> None:
    """Apply a fleet layout to the state store (idempotent, additive; migrates first)."""
    from haru_db import StateStore, upgrade

    async def go(document: FleetLayout) -> str:
        await upgrade(database_url)
        store = StateStore.open(database_url)
        try:
            result = await store.apply_fleet_layout(document, at=datetime.now(UTC))
        finally:
            await store.close()
        return (
            f"fleet [bold]{document.slug}[/] ({result.fleet_id}): "
            f"{'created' if result.fleet_created else 'already present'}, "
            f"{result.domains_created} domain(s) and {result.slots_created} slot(s) added"
            + (", routing pointer set" if result.pointer_set else "")
        )

    def body() -> None:
        document = _load_layout(layout)
        console.print(_run_db(go(document)))

    _guard(body)


# ---- fleets ----------------------------------------------------------------------------------


def _client(url: str, token: str | None) -> ControlClient:
    return ControlClient(url, token=token)


def fleets(url: UrlOption = DEFAULT_URL, token: TokenOption = None) -> None:
    """List the fleets of the server."""

    async def go() -> None:
        async with _client(url, token) as client:
            listing = await client.fleets()
        table = Table("slug", "id", "active domain", "route revision")
        for fleet in listing.fleets:
            table.add_row(
                fleet.slug,
                str(fleet.id),
                "-" if fleet.active_domain_id is None else str(fleet.active_domain_id),
                str(fleet.route_revision),
            )
        console.print(table)

    _guard(lambda: _run(go()))


def _ago(at: datetime | None) -> str:
    if at is None:
        return "never"
    seconds = (datetime.now(UTC) - at).total_seconds()
    return f"{seconds:.1f}s ago" if seconds < 120 else at.isoformat(timespec="seconds")


def render_fleet(fleet: FleetSnapshot) -> list[Table]:
    """The fleet as two tables: its domains, then their slots."""
    domains = Table(
        "domain",
        "role",
        "state",
        "provider",
        "supervisor",
        "last seen",
        title=f"fleet {fleet.slug}",
    )
    slots = Table("domain", "gpu", "kind", "state", "models / command")
    for domain in fleet.domains:
        role = "[bold green]active[/]" if is_active(fleet, domain) else "standby"
        domains.add_row(
            domain.slug,
            role,
            domain.state.value,
            domain.provider.value,
            domain.supervisor_url or "-",
            _ago(domain.last_seen_at),
        )
        for slot in domain.slots:
            spec = slot.inference_spec
            detail = (
                ", ".join(m.name for m in spec.models)
                if spec is not None
                else " ".join(slot.training_spec.command if slot.training_spec else ())
            )
            slots.add_row(
                domain.slug, str(slot.gpu_index), slot.kind.value, slot.state.value, detail
            )
    domains.caption = (
        f"id {fleet.id}  route revision {fleet.route_revision}  "
        f"autoFailover {'on' if fleet.policy.auto_failover else 'off'}"
    )
    return [domains, slots]


def fleet_show(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Show a fleet's domains and slots with their states."""

    async def go() -> None:
        async with _client(url, token) as client:
            fleet = await client.fleet(ref)
        for table in render_fleet(fleet):
            console.print(table)

    _guard(lambda: _run(go()))


# ---- promote / demote ------------------------------------------------------------------------


def resolve_domain(fleet: FleetSnapshot, domain: str) -> DomainSnapshot:
    """The fleet's domain named by slug or id (any case)."""
    for candidate in fleet.domains:
        if candidate.slug == domain or str(candidate.id) == domain.lower():
            return candidate
    known = ", ".join(d.slug for d in fleet.domains)
    raise CliFailure(f"fleet {fleet.slug!r} has no domain {domain!r} (domains: {known})", code=2)


async def _follow_operation(
    client: ControlClient,
    ref: str,
    operation: Operation,
    *,
    drive: bool,
    timeout_s: float,
) -> Operation:
    plan = plan_for(operation.kind)
    shown = 0
    deadline = time.monotonic() + timeout_s
    with console.status(f"{operation.kind.value}: waiting") as status:
        while True:
            if operation.current_step is not None:
                reached = plan.index(operation.current_step)
                succeeded = operation.state is OperationState.SUCCEEDED
                upto = reached + 1 if succeeded else reached
                for step in plan[shown:upto]:
                    console.print(f"  [green]done[/]  {step.value}")
                shown = max(shown, upto)
                status.update(f"{operation.kind.value}: {operation.current_step.value}")
            if operation.state not in (OperationState.PENDING, OperationState.RUNNING):
                return operation
            if time.monotonic() >= deadline:
                raise CliFailure(
                    f"operation {operation.id} still {operation.state.value} after {timeout_s}s"
                )
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
) -> None:
    async def go() -> Operation | None:
        async with _client(url, token) as client:
            fleet = await client.fleet(ref)
            target = resolve_domain(fleet, domain)
            answer = await client.request_operation(ref, kind, target.id)
            if isinstance(answer, AlreadyActiveResponse):
                console.print(
                    f"domain [bold]{target.slug}[/] is already active "
                    f"(route revision {answer.route_revision})"
                )
                return None
            operation = answer.operation
            console.print(
                f"{kind.value} of [bold]{target.slug}[/] accepted: operation {operation.id} "
                f"({operation.state.value})"
            )
            if not wait:
                return None
            return await _follow_operation(client, ref, operation, drive=drive, timeout_s=timeout_s)

    def body() -> None:
        final = _run(go())
        if final is None:
            return
        if final.state is OperationState.SUCCEEDED:
            console.print(f"[bold green]{kind.value} succeeded[/]")
            return
        error = final.error
        reason = (
            f"{error.code} at {error.step.value if error.step else '?'}: {error.message}"
            if error is not None
            else final.state.value
        )
        raise CliFailure(f"{kind.value} {final.state.value}: {reason}")

    _guard(body)


def promote(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Domain slug or id to make active.")],
    wait: WaitOption = False,
    drive: DriveOption = False,
    timeout: TimeoutOption = 600.0,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Promote a standby domain to active."""
    _request(
        OperationKind.PROMOTE,
        ref,
        domain,
        url=url,
        token=token,
        wait=wait,
        drive=drive,
        timeout_s=timeout,
    )


def demote(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Standby domain slug or id.")],
    wait: WaitOption = False,
    drive: DriveOption = False,
    timeout: TimeoutOption = 600.0,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Put a standby domain to sleep and start its training."""
    _request(
        OperationKind.DEMOTE,
        ref,
        domain,
        url=url,
        token=token,
        wait=wait,
        drive=drive,
        timeout_s=timeout,
    )


# ---- events ----------------------------------------------------------------------------------


def format_event(event: Event) -> str:
    """One event as one line."""
    payload = json.dumps(event.payload, separators=(",", ":"), sort_keys=True)
    stamp = event.created_at.astimezone(UTC).isoformat(timespec="milliseconds")
    return f"{event.id:>6}  {stamp}  {event.type:<36} {payload}"


def events(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events.")
    ] = False,
    after: Annotated[int, typer.Option("--after", min=0, help="Start after this event id.")] = 0,
    interval: Annotated[
        float, typer.Option("--interval", min=0.05, help="Seconds between polls with --follow.")
    ] = 1.0,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Print a fleet's audit trail, oldest first."""

    async def go() -> None:
        cursor = after
        async with _client(url, token) as client:
            while True:
                page = await client.events(ref, after=cursor, limit=500)
                for event in page.events:
                    console.print(format_event(event), markup=False)
                    cursor = event.id
                if page.next_after is not None:
                    continue
                if not follow:
                    return
                await asyncio.sleep(interval)

    try:
        _guard(lambda: _run(go()))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


# ---- registration ----------------------------------------------------------------------------

app = typer.Typer(
    name="haru",
    help="Haru: hot Active/Standby failover for self-hosted LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="State store maintenance (uses DATABASE_URL).", no_args_is_help=True)
fleet_app = typer.Typer(help="Inspect one fleet.", no_args_is_help=True)


def _register() -> None:
    app.command("serve")(serve)
    app.add_typer(db_app, name="db")
    db_app.command("upgrade")(db_upgrade)
    app.command("seed")(seed)
    app.command("fleets")(fleets)
    app.add_typer(fleet_app, name="fleet")
    fleet_app.command("show")(fleet_show)
    app.command("promote")(promote)
    app.command("demote")(demote)
    app.command("events")(events)
    app.command("demo")(demo_command)


_register()


def main() -> None:
    """Entry point of ``haru``."""
    app()


def serve_main() -> None:
    """Entry point of ``haru-server`` (the same as ``haru serve``)."""
    app(args=["serve", *sys.argv[1:]], prog_name="haru-server")
