"""The ``haru`` command line: run the server, prepare the store, and drive fleets over HTTP.

Every command that talks to a fleet does so through a running server's control API (``--url``
/ ``HARU_URL``; the token from ``HARU_API_TOKEN`` or a file, ``--token-file`` /
``HARU_API_TOKEN_FILE``, never from the command line, which ``ps`` shows to every user); only
``haru serve``, ``haru db upgrade`` and
``haru seed`` open the state store (``DATABASE_URL``). Adding a command is one registration in
:func:`_register`; installed packages add commands under the ``haru.commands`` entry-point group
(haru-demo registers ``demo``).

Exit codes (stable, for scripts): 0 success; 1 the server refused the request or another
failure; 2 usage (bad argument, unknown domain, invalid layout, invalid environment); 3 the
operation ended without succeeding (``--wait``); 4 ``--wait`` timed out with the operation still
running; 5 the server could not be reached (connection refused, unresolvable, no answer in time).

Output: read commands take ``--json`` (one JSON document on stdout, events as JSON lines);
tables use the terminal's width, and the whole width they need when stdout is not a terminal
(piped output is never truncated).

Cold start: building the CLI (``haru --help``) imports neither the state store (SQLAlchemy,
Alembic), nor aiohttp, nor the wire models: every command imports what it needs in its body,
and a registered command's module is imported only when that command runs.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import cache, cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    from datetime import datetime
    from uuid import UUID

    from haru_protocol import (
        DomainSnapshot,
        Event,
        FleetLayout,
        FleetSnapshot,
        Operation,
        OperationKind,
        Policy,
    )
    from rich.console import Console
    from rich.table import Table

    from haru_server.control_client import ControlClient

_T = TypeVar("_T")

DEFAULT_URL = "http://127.0.0.1:8700"

COMMAND_GROUP: Final = "haru.commands"
"""Entry-point group whose entries ``haru`` mounts as commands (name: the command's name;
object: a ``typer.Typer`` with one command, or a function typer turns into one)."""

OPTIONAL_COMMANDS: Final[Mapping[str, tuple[str, str]]] = {
    "demo": ("haru-demo", "Run a whole local fleet (no GPU needed)."),
}
"""Commands that come with another distribution: name -> (distribution, what it does)."""


EXIT_OK: Final = 0
EXIT_ERROR: Final = 1
"""The server refused the request (an error answer), or another failure."""
EXIT_USAGE: Final = 2
"""A bad argument, an unknown domain, an invalid layout or environment."""
EXIT_OPERATION_FAILED: Final = 3
"""``--wait``: the operation ended failed or cancelled."""
EXIT_WAIT_TIMEOUT: Final = 4
"""``--wait``: the operation was still running when ``--timeout`` ran out."""
EXIT_UNREACHABLE: Final = 5
"""The server could not be reached (refused, unresolvable, no answer in time)."""

PIPED_WIDTH: Final = 100_000
"""Console width when stdout is not a terminal: tables are never truncated or wrapped."""


# No emoji codes either: a server's ":warning:" prints as typed.
@cache
def _console() -> Console:
    from rich.console import Console

    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(highlight=False, emoji=False, width=PIPED_WIDTH, soft_wrap=True)
    return console


def _table(*headers: str, **options: Any) -> Table:
    """A Rich table in plain ASCII when stdout is not a terminal (piped output stays 7-bit)."""
    from rich import box
    from rich.table import Table

    return Table(*headers, box=box.HEAVY_HEAD if _console().is_terminal else box.ASCII, **options)


def _escape(value: object) -> str:
    """``value`` as text that Rich prints verbatim (a server's ``[red]`` is not markup)."""
    from rich.markup import escape

    return escape(str(value))


def _cells(*values: object) -> list[str]:
    """Table cells that print verbatim (a table cell is Rich markup otherwise)."""
    return [_escape(value) for value in values]


def _print_json(document: str) -> None:
    # Straight to stdout: no console markup, highlighting or wrapping of the JSON text.
    sys.stdout.write(document + "\n")
    sys.stdout.flush()


@cache
def _err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False)


UrlOption = Annotated[
    str,
    typer.Option("--url", envvar="HARU_URL", help="Base URL of a running haru server."),
]
TOKEN_VAR: Final = "HARU_API_TOKEN"  # noqa: S105  (a variable name, not a secret)
TOKEN_FILE_VAR: Final = "HARU_API_TOKEN_FILE"  # noqa: S105
REFUSED_TOKEN_FLAG: Final = "--token"  # noqa: S105


def _token_from_file(path: str) -> str:
    import os
    import stat

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            content = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise _fail(
            CliFailure(f"cannot read the token file {path}: {reason}", code=EXIT_USAGE)
        ) from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        # Still used (the operator asked for it), but another user may already have read it.
        _err_console().print(
            f"[bold yellow]warning:[/] the token file {_escape(path)} is readable by other "
            f"users (mode {stat.S_IMODE(mode):04o}); make it private: chmod 600 {_escape(path)}",
            soft_wrap=True,
        )
    token = content.strip()
    if not token:
        raise _fail(CliFailure(f"the token file {path} is empty", code=EXIT_USAGE))
    return token


def _resolve_token(token_file: str | None) -> str | None:
    """The API token: from ``--token-file`` / ``HARU_API_TOKEN_FILE``, else ``HARU_API_TOKEN``."""
    import os

    if token_file is not None and token_file.strip():
        return _token_from_file(token_file.strip())
    return os.environ.get(TOKEN_VAR, "").strip() or None


TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token-file",
        envvar=TOKEN_FILE_VAR,
        metavar="PATH",
        callback=_resolve_token,
        help=(
            "File holding the bearer token of the server's API (HARU_API_TOKEN_FILE); "
            "without it the token is read from HARU_API_TOKEN. There is no --token: a "
            "command line is visible to every user (ps)."
        ),
        show_default=False,
    ),
]
"""The API token, resolved (the parameter holds the token, not the file's name)."""


def refuse_token_argument(args: Sequence[str]) -> None:
    """Refuse ``--token VALUE`` anywhere before ``--`` (exit 2), naming the alternatives."""
    for arg in args:
        if arg == "--":
            return
        if arg == REFUSED_TOKEN_FLAG or arg.startswith(REFUSED_TOKEN_FLAG + "="):
            raise _fail(
                CliFailure(
                    "--token is not accepted: a token on the command line is visible to every "
                    f"user of this machine (ps). Set {TOKEN_VAR} in the environment, or put the "
                    f"token in a file only you can read and pass --token-file PATH (or set "
                    f"{TOKEN_FILE_VAR}).",
                    code=EXIT_USAGE,
                )
            )


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
    float,
    typer.Option("--timeout", min=1.0, help="Seconds to wait before giving up (exit 4)."),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print JSON (the server's documents) instead of tables.")
]


class CliFailure(Exception):  # noqa: N818  # a message for the operator, not a bug
    """Ends the command with a message on stderr and a non-zero status."""

    def __init__(self, message: str, *, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _run(coro: Awaitable[_T]) -> _T:
    import asyncio

    from haru_server.control_client import ControlApiError

    async def main() -> _T:
        return await coro

    try:
        return asyncio.run(main())
    except ControlApiError as exc:
        raise CliFailure(
            str(exc), code=EXIT_UNREACHABLE if exc.unreachable else EXIT_ERROR
        ) from exc


def _run_db(coro: Awaitable[_T]) -> _T:
    # The state store (SQLAlchemy, Alembic) is imported only by the commands that open it:
    # the remote commands start faster without it.
    from haru_db import HaruDbError

    try:
        return _run(coro)
    except HaruDbError as exc:
        raise CliFailure(f"state store: {exc}") from exc


def _fail(exc: CliFailure) -> typer.Exit:
    _err_console().print(f"[bold red]error:[/] {_escape(exc)}")
    return typer.Exit(exc.code)


def _guard(func: Callable[[], None]) -> None:
    try:
        func()
    except CliFailure as exc:
        raise _fail(exc) from None


# ---- serve -----------------------------------------------------------------------------------


def serve(
    create_db: Annotated[
        bool,
        typer.Option(
            "--create-db",
            help="Create the SQLite file DATABASE_URL names when it does not exist "
            "(HARU_CREATE_DATABASE=1); without it a missing file is refused.",
        ),
    ] = False,
) -> None:
    """Run the control server (configured by the environment, see the README)."""
    import os

    from haru_db import HaruDbError
    from haru_web import configure_logging, configure_startup_logging

    from haru_server._eventloop import run
    from haru_server._serve import run_server
    from haru_server._settings import Settings, SettingsError
    from haru_server._workers import serve_workers

    try:
        settings = Settings.from_env(
            {**os.environ, "HARU_CREATE_DATABASE": "1"} if create_db else os.environ
        )
    except SettingsError as exc:
        configure_startup_logging(os.environ)
        raise _fatal(f"invalid environment: {exc}", code=2) from None
    configure_logging(log_format=settings.log_format, level=settings.log_level, stream=sys.stderr)
    try:
        if settings.workers > 1:
            code = serve_workers(settings)
            if code:
                raise typer.Exit(code)
        else:
            run(run_server(settings))
    except SettingsError as exc:  # a TLS file that does not load
        raise _fatal(f"invalid environment: {exc}", code=2) from None
    except HaruDbError as exc:
        raise _fatal(f"cannot start: state store: {exc}", code=1) from None
    except OSError as exc:
        raise _fatal(f"cannot start: {exc}", code=1) from None


def _fatal(message: str, *, code: int) -> typer.Exit:
    # Through the configured log handler, not the console: one line (a JSON one in JSON mode)
    # that a log collector parses, never wrapped at the terminal's width.
    import logging

    logging.getLogger("haru_server").critical("%s", message)
    return typer.Exit(code)


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
        _console().print(f"{_escape(where)}: schema at revision [bold]{_escape(revision)}[/]")

    _guard(body)


def db_current(database_url: DatabaseOption = None, as_json: JsonOption = False) -> None:
    """Show the state store's schema revision and this code's head (exit 1 when behind)."""
    import json

    from haru_db import current_revision, head_revision, redact_database_url, resolve_database_url

    def body() -> None:
        revision = _run_db(current_revision(database_url))
        head = head_revision()
        where = redact_database_url(resolve_database_url(database_url))
        if as_json:
            document = {"database": where, "revision": revision, "head": head}
            _print_json(json.dumps({**document, "atHead": revision == head}))
        else:
            state = "at head" if revision == head else f"head is {head}"
            shown = "none (never migrated)" if revision is None else revision
            _console().print(
                f"{_escape(where)}: schema at revision [bold]{_escape(shown)}[/] ({_escape(state)})"
            )
        if revision != head:
            raise typer.Exit(EXIT_ERROR)

    _guard(body)


def db_backup(
    destination: Annotated[
        Path, typer.Argument(help="The backup's file (must not exist).", show_default=False)
    ],
    database_url: DatabaseOption = None,
) -> None:
    """Back up the SQLite store online, while servers run (PostgreSQL: use pg_dump).

    Never copy the database file instead: it holds only what the last checkpoint wrote.
    """
    from haru_db import backup_sqlite

    def body() -> None:
        result = _run_db(backup_sqlite(database_url, destination))
        _console().print(
            f"backed up {result.source} to {result.destination} "
            f"({result.size_bytes} bytes, schema at revision {result.revision})",
            markup=False,
        )

    _guard(body)


DEFAULT_RETENTION_DAYS: Final = 30
"""``haru db prune``'s default age, the server's ``HARU_RETENTION_DAYS`` default."""


def db_prune(
    older_than: Annotated[
        int,
        typer.Option(
            "--older-than",
            envvar="HARU_RETENTION_DAYS",
            min=1,
            metavar="DAYS",
            help="Prune finished operations and events older than this many days "
            "(default: HARU_RETENTION_DAYS, else 30).",
        ),
    ] = DEFAULT_RETENTION_DAYS,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only count what would be deleted.")
    ] = False,
    database_url: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete finished operations and events older than the retention (see the server README).

    In-flight operations, each fleet's newest 64 operations and their events always stay.
    """
    import json
    from datetime import UTC, datetime, timedelta

    from haru_db import (
        KEEP_RECENT_OPERATIONS,
        PruneCounts,
        StateStore,
        check_schema,
        redact_database_url,
        resolve_database_url,
    )

    before = datetime.now(UTC) - timedelta(days=older_than)

    async def go() -> PruneCounts:
        await check_schema(database_url)
        store = StateStore.open(database_url)
        try:
            if dry_run:
                return await store.count_prunable(before=before)
            return await store.prune_history(before=before)
        finally:
            await store.close()

    def body() -> None:
        counts = _run_db(go())
        where = redact_database_url(resolve_database_url(database_url))
        if as_json:
            document = {
                "database": where,
                "olderThanDays": older_than,
                "before": before.isoformat(),
                "dryRun": dry_run,
                "keptPerFleet": KEEP_RECENT_OPERATIONS,
                "events": counts.events,
                "operations": counts.operations,
            }
            _print_json(json.dumps(document))
            return
        verb = "would delete" if dry_run else "deleted"
        _console().print(
            f"{where}: {verb} {counts.events} event(s) and {counts.operations} finished "
            f"operation(s) older than {older_than} day(s) (before {before:%Y-%m-%d %H:%M} UTC)",
            markup=False,
        )

    _guard(body)


def db_downgrade(
    revision: Annotated[
        str, typer.Argument(help="The revision to go back to (`base`: an empty schema).")
    ],
    database_url: DatabaseOption = None,
    yes: Annotated[
        bool, typer.Option("--yes", help="Confirm: a downgrade drops what newer revisions added.")
    ] = False,
) -> None:
    """Migrate the state store back to REVISION (for rolling back a release; back up first)."""
    from haru_db import current_revision, downgrade, redact_database_url, resolve_database_url

    def body() -> None:
        if not yes:
            raise CliFailure(
                "a downgrade drops the columns and rows newer revisions added: take a backup "
                "(`haru db backup`, or pg_dump), stop every server of the newer release, then "
                "run again with --yes",
                code=2,
            )

        async def go() -> str | None:
            await downgrade(database_url, revision=revision)
            return await current_revision(database_url)

        now = _run_db(go())
        where = redact_database_url(resolve_database_url(database_url))
        _console().print(f"{where}: schema at revision {now}", markup=False)

    _guard(body)


def _load_layout(path: Path | None) -> FleetLayout:
    from haru_protocol import FleetLayout, load_example_layout
    from pydantic import ValidationError

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
    print_example: Annotated[
        bool,
        typer.Option(
            "--print-example",
            help="Print the bundled example layout (JSON) and exit; opens no database.",
        ),
    ] = False,
) -> None:
    """Apply a fleet layout to the state store (idempotent, additive; migrates first).

    Seed only adds: a fleet already present keeps its stored policy, domains, slots and models.
    When they differ from the layout, the differences are listed (the policy's with the
    ``haru fleet policy set`` command, the rest as ``haru apply`` would plan them) and the
    command exits 1.
    """
    import shlex

    if print_example:
        from haru_protocol import example_layout_json

        if layout is not None:
            raise typer.BadParameter("--print-example takes no layout file")
        sys.stdout.write(example_layout_json())
        sys.stdout.flush()
        return

    from haru_core import plan_layout
    from haru_db import StateStore, upgrade
    from haru_protocol import PlanItem, policy_differences, resolve_policy

    async def go(
        document: FleetLayout,
    ) -> tuple[str, list[tuple[str, object, object]], list[PlanItem]]:
        await upgrade(database_url)
        store = StateStore.open(database_url)
        try:
            # Stored times are the database's clock, not this machine's.
            result = await store.apply_fleet_layout(document, at=await store.database_now())
            stored = None if result.fleet_created else await store.get_fleet_snapshot(document.slug)
            rest: list[PlanItem] = []
            if stored is not None:
                policy = await store.get_fleet_policy(stored.id)
                plan = plan_layout(
                    stored,
                    document,
                    stored_policy=None if policy is None else policy.patch,
                    in_flight=await store.get_in_flight_operation(stored.id),
                    revisions={},
                ).plan
                # The policy has its own message below.
                rest = [i for i in plan.items if i.subject != "policy"]
        finally:
            await store.close()
        differences = (
            []
            if stored is None
            else policy_differences(stored.policy, resolve_policy(document.policy))
        )
        added = f"{result.domains_created} domain(s) and {result.slots_created} slot(s) added"
        return (
            f"fleet [bold]{_escape(document.slug)}[/] ({result.fleet_id}): "
            + ("created, " if result.fleet_created else "present, ")
            + added
            + (", routing pointer set" if result.pointer_set else "")
            + ("" if differences or rest else ", no differences"),
            differences,
            rest,
        )

    def body() -> None:
        document = _load_layout(layout)
        summary, differences, rest = _run_db(go(document))
        _console().print(summary)
        problems: list[str] = []
        if differences:
            listed = "\n".join(
                f"  {key}: stored {stored}, layout {wanted}" for key, stored, wanted in differences
            )
            command = " ".join(
                shlex.quote(f"{key}={'default' if wanted is None else wanted}")
                for key, _, wanted in differences
            )
            problems.append(
                f"the stored policy of fleet {document.slug} differs from the layout's "
                f"(seed never changes a stored policy):\n{listed}\n"
                f"to apply the layout's values: haru fleet policy set {document.slug} {command}"
            )
        if rest:
            listed = "\n".join(
                f"  {i.action} {i.path}" + (f": {i.detail}" if i.detail else "") for i in rest
            )
            problems.append(
                f"fleet {document.slug} differs from the layout where seed only adds "
                f"(plan and apply them with `haru apply LAYOUT`):\n{listed}"
            )
        if problems:
            raise CliFailure("\n".join(problems))

    _guard(body)


# ---- fleets ----------------------------------------------------------------------------------


def _client(url: str, token: str | None) -> ControlClient:
    import os
    import ssl
    from pathlib import Path

    from haru_supervisor_client import client_ssl_context

    from haru_server.control_client import ControlClient

    # HARU_CA_FILE: the CA of an https:// server (default: the system trust store);
    # HARU_CLIENT_CERT_FILE / HARU_CLIENT_KEY_FILE: a client certificate (mutual TLS).
    def path(name: str) -> Path | None:
        value = os.environ.get(name, "").strip()
        return Path(value) if value else None

    try:
        context = client_ssl_context(
            path("HARU_CA_FILE"),
            cert_file=path("HARU_CLIENT_CERT_FILE"),
            key_file=path("HARU_CLIENT_KEY_FILE"),
        )
    except (OSError, ssl.SSLError) as exc:
        raise CliFailure(
            f"invalid environment: HARU_CA_FILE / HARU_CLIENT_CERT_FILE: {exc}", code=2
        ) from None
    allow_plaintext = os.environ.get("HARU_ALLOW_PLAINTEXT", "").strip().lower() in (
        "1",
        "true",
        "yes",
    )
    return ControlClient(url, token=token, ssl_context=context, allow_plaintext=allow_plaintext)


def fleets(
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """List the fleets of the server with their active domain (by slug)."""
    import json

    async def go() -> None:
        async with _client(url, token) as client:
            listing = await client.fleets()
            slugs: dict[str, str | None] = {}
            for pointer in listing.fleets:
                active = None
                if pointer.active_domain_id is not None:
                    snapshot = await client.fleet(str(pointer.id))
                    domain = snapshot.domain(pointer.active_domain_id)
                    active = None if domain is None else domain.slug
                slugs[str(pointer.id)] = active
        if as_json:
            document = listing.model_dump(mode="json")
            for entry in document["fleets"]:
                entry["activeDomainSlug"] = slugs[entry["id"]]
            _print_json(json.dumps(document))
            return
        table = _table("slug", "id", "active domain", "route revision")
        for fleet in listing.fleets:
            table.add_row(
                *_cells(
                    fleet.slug,
                    fleet.id,
                    slugs[str(fleet.id)] or "-",
                    fleet.route_revision,
                )
            )
        _console().print(table)

    _guard(lambda: _run(go()))


def _ago(at: datetime | None) -> str:
    import datetime as dt

    if at is None:
        return "never"
    seconds = (dt.datetime.now(dt.UTC) - at).total_seconds()
    return f"{seconds:.1f}s ago" if seconds < 120 else at.isoformat(timespec="seconds")


def render_fleet(fleet: FleetSnapshot) -> list[Table]:
    """The fleet as two tables: its domains, then their slots."""
    from haru_core import is_active
    from rich.text import Text

    shown = fleet.slug if fleet.display_name is None else f"{fleet.slug} ({fleet.display_name})"
    domains = _table(
        "domain",
        "role",
        "state",
        "provider",
        "supervisor",
        "last seen",
        title=Text(f"fleet {shown}"),
    )
    slots = _table("domain", "gpu", "kind", "state", "models / command")
    for domain in fleet.domains:
        role = "[bold green]active[/]" if is_active(fleet, domain) else "standby"
        domains.add_row(
            _escape(domain.slug),
            role,
            *_cells(
                domain.state.value,
                domain.provider.value,
                domain.supervisor_url or "-",
                _ago(domain.last_seen_at),
            ),
        )
        for slot in domain.slots:
            spec = slot.inference_spec
            detail = (
                ", ".join(m.name for m in spec.models)
                if spec is not None
                else " ".join(slot.training_spec.command if slot.training_spec else ())
            )
            slots.add_row(
                *_cells(domain.slug, slot.gpu_index, slot.kind.value, slot.state.value, detail)
            )
    active = fleet.active_domain
    domains.caption = Text(
        f"id {fleet.id}  active domain {active.slug if active is not None else '-'}  "
        f"route revision {fleet.route_revision}  "
        f"autoFailover {'on' if fleet.policy.auto_failover else 'off'}"
    )
    return [domains, slots, render_policy(fleet.policy)]


def render_policy(policy: Policy) -> Table:
    """The resolved policy, one key a line, with the default where the value differs."""
    from haru_protocol import Policy, policy_differences

    defaults = {key: value for key, _, value in policy_differences(policy, Policy())}
    table = _table("policy key", "value", "default", title="policy (resolved)")
    for key, value in policy.model_dump(mode="json").items():
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for inner, shown in entries:
            name = key if inner is None else f"{key}.{inner}"
            default = defaults.get(name)
            table.add_row(name, str(shown), "" if name not in defaults else str(default))
    return table


def parse_policy_assignment(text: str) -> tuple[list[str], object]:
    """Parse ``key=value`` into (key path, JSON value).

    ``true``/``false`` and integers are typed, ``default`` clears the operator's value (null),
    anything else is a string.

    Raises:
        CliFailure: No ``=``, an empty key or an empty value (exit 2).
    """
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise CliFailure(f"{text!r}: expected key=value (camelCase key)", code=EXIT_USAGE)
    if raw == "":
        raise CliFailure(
            f"{text!r} has no value; use {key}=default to follow the default again",
            code=EXIT_USAGE,
        )
    value: object
    if raw == "default":
        value = None
    elif raw in ("true", "false"):
        value = raw == "true"
    elif raw.isascii() and raw.isdigit():
        value = int(raw)
    else:
        value = raw
    return path, value


def policy_set(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    assignments: Annotated[
        list[str],
        typer.Argument(
            help="key=value (camelCase, e.g. degradedGraceMs=5000 autoFailover=true "
            "probe.prompt=hi); key=default follows the default again.",
            show_default=False,
        ),
    ],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change a fleet's policy (validated by the server; the next reconcile tick uses it)."""
    patch: dict[str, object] = {}

    async def go() -> None:
        async with _client(url, token) as client:
            answer = await client.set_policy(ref, patch)
        if as_json:
            _print_json(answer.model_dump_json())
            return
        changed = ", ".join(answer.changed) if answer.changed else "nothing (already so)"
        _console().print(f"fleet {ref} policy changed: {changed}")
        _console().print(render_policy(answer.policy))

    def body() -> None:
        if not assignments:
            raise CliFailure("give at least one key=value", code=EXIT_USAGE)
        for text in assignments:
            path, value = parse_policy_assignment(text)
            target = patch
            for part in path[:-1]:
                nested = target.setdefault(part, {})
                if not isinstance(nested, dict):
                    raise CliFailure(f"{text!r} conflicts with another assignment", code=EXIT_USAGE)
                target = nested
            target[path[-1]] = value
        _run(go())

    _guard(body)


def fleet_show(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a fleet's domains and slots with their states."""

    async def go() -> None:
        async with _client(url, token) as client:
            fleet = await client.fleet(ref)
        if as_json:
            _print_json(fleet.model_dump_json())
            return
        for table in render_fleet(fleet):
            _console().print(table)

    _guard(lambda: _run(go()))


# ---- promote / demote ------------------------------------------------------------------------


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


def promote(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Domain slug or id to make active.")],
    wait: WaitOption = False,
    drive: DriveOption = False,
    timeout: TimeoutOption = 600.0,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Promote a standby domain to active."""
    from haru_protocol import OperationKind

    _request(
        OperationKind.PROMOTE,
        ref,
        domain,
        url=url,
        token=token,
        wait=wait,
        drive=drive,
        timeout_s=timeout,
        as_json=as_json,
    )


def demote(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Standby domain slug or id.")],
    wait: WaitOption = False,
    drive: DriveOption = False,
    timeout: TimeoutOption = 600.0,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Put a standby domain to sleep and start its training."""
    from haru_protocol import OperationKind

    _request(
        OperationKind.DEMOTE,
        ref,
        domain,
        url=url,
        token=token,
        wait=wait,
        drive=drive,
        timeout_s=timeout,
        as_json=as_json,
    )


# ---- provisioned domains ---------------------------------------------------------------------


def domain_status(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Domain slug or id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a domain's row, its SkyPilot cluster status and its last provisioning events."""
    console = _console()

    async def go() -> None:
        async with _client(url, token) as client:
            answer = await client.domain_status(ref, domain)
        if as_json:
            _print_json(answer.model_dump_json())
            return
        row = answer.domain
        console.print(
            f"domain [bold]{_escape(row.slug)}[/] "
            + _escape(
                f"({row.provider.value}, {answer.role}): "
                f"{row.state.value}, launch attempt {row.launch_attempt}"
            )
        )
        console.print(f"supervisor: {row.supervisor_url or '-'}", markup=False)
        if answer.cluster_name is not None:
            shown = answer.cluster_status or f"unknown ({answer.cluster_error})"
            console.print(f"cluster {answer.cluster_name}: {shown}", markup=False)
        for event in answer.events:
            console.print(format_event(event), markup=False, highlight=False)

    _guard(lambda: _run(go()))


def _domain_action(
    action: str, ref: str, domain: str, url: str, token: str | None, as_json: bool
) -> None:
    console = _console()

    async def go() -> None:
        async with _client(url, token) as client:
            answer = await client.domain_action(ref, domain, action)
        if as_json:
            _print_json(answer.model_dump_json())
            return
        console.print(
            f"domain [bold]{_escape(answer.domain.slug)}[/] {action} accepted: "
            + _escape(answer.domain.state.value)
        )

    _guard(lambda: _run(go()))


def domain_up(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Stopped or failed skypilot domain.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Launch a stopped or failed skypilot domain again (the reconciler runs `sky launch`)."""
    _domain_action("up", ref, domain, url, token, as_json)


def domain_down(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Standby skypilot domain.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Tear a standby skypilot domain down (`sky down`); refused for the active domain."""
    _domain_action("down", ref, domain, url, token, as_json)


# ---- events ----------------------------------------------------------------------------------


def event_domain(event: Event, domains: Mapping[UUID, str]) -> str:
    """The event's domain by slug (its id when the fleet no longer has it; ``-`` for none)."""
    if event.domain_id is None:
        return "-"
    return domains.get(event.domain_id, str(event.domain_id))


def format_event(event: Event, domains: Mapping[UUID, str] | None = None) -> str:
    """One event as one line (its domain by slug, from ``domains``)."""
    import json
    from datetime import UTC

    from haru_protocol import UntypedEventPayload

    data = event.data
    if isinstance(data, UntypedEventPayload):
        # A type this CLI does not know, or a payload that does not fit its model: as stored.
        payload = json.dumps(data.data, separators=(",", ":"), sort_keys=True)
        if data.error is not None:
            payload += f"  (malformed {event.type} payload: {data.error})"
    else:
        payload = json.dumps(data.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)
    stamp = event.created_at.astimezone(UTC).isoformat(timespec="milliseconds")
    domain = event_domain(event, domains or {})
    return f"{event.id:>6}  {stamp}  {domain:<12} {event.type:<36} {payload}"


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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print each event as one JSON line (JSON Lines).")
    ] = False,
) -> None:
    """Print a fleet's audit trail, oldest first, each event's domain by slug.

    JSON lines carry ``domainSlug`` beside ``domainId`` (null for an event of no domain, or of
    a domain the fleet no longer has).
    """
    import asyncio
    import json

    async def go() -> None:
        cursor = after
        async with _client(url, token) as client:
            domains: dict[UUID, str] = {}

            async def learn() -> None:
                snapshot = await client.fleet(ref)
                domains.update({domain.id: domain.slug for domain in snapshot.domains})

            await learn()
            while True:
                page = await client.events(ref, after=cursor, limit=500)
                if any(e.domain_id is not None and e.domain_id not in domains for e in page.events):
                    await learn()  # a domain added since (with --follow)
                for event in page.events:
                    if as_json:
                        document = json.loads(event.model_dump_json(by_alias=True))
                        document["domainSlug"] = (
                            None if event.domain_id is None else domains.get(event.domain_id)
                        )
                        _print_json(json.dumps(document, separators=(",", ":")))
                    else:
                        _console().print(format_event(event, domains), markup=False)
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


# ---- commands of other distributions ---------------------------------------------------------


def discover_commands() -> list[metadata.EntryPoint]:
    """The entry points of :data:`COMMAND_GROUP` in the installed distributions."""
    return list(metadata.entry_points(group=COMMAND_GROUP))


def _load_command(entry: metadata.EntryPoint) -> TyperCommand | TyperGroup:
    try:
        target = entry.load()
    except Exception as exc:  # any failure while importing a plugin is reported
        raise _fail(
            CliFailure(f"cannot load command {entry.name!r} ({entry.value}): {exc!r}")
        ) from exc
    if not isinstance(target, typer.Typer):
        if not callable(target):
            raise _fail(
                CliFailure(f"command {entry.name!r} ({entry.value}) is not a Typer app or function")
            )
        function = target
        target = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        target.command(entry.name)(function)
    command = typer.main.get_command(target)
    assert isinstance(command, TyperCommand | TyperGroup)  # noqa: S101 -- typer's own classes
    return command


def _summary(entry: metadata.EntryPoint) -> str:
    dist = entry.dist
    # Parentheses, not brackets: the help is rich markup.
    if dist is None:
        return f"({entry.value})"
    summary = dist.metadata["Summary"]
    return f"{summary} ({dist.name})" if summary else f"({dist.name})"


class _Listed(TyperCommand):
    """A registered command as ``haru --help`` lists it, without importing its module."""

    def __init__(self, entry: metadata.EntryPoint) -> None:
        super().__init__(entry.name, help=_summary(entry))
        self.entry = entry


def _missing_command(name: str, distribution: str, what: str) -> TyperCommand:
    def explain() -> None:
        _err_console().print(
            f"[bold red]error:[/] haru {name} comes with the {distribution} package, which is "
            "not installed.\n"
            f"  {what}\n"
            f"  Install it with:  pip install {distribution}\n"
            f"  In a checkout of the Haru repository:  pip install uv && uv run haru {name}",
            soft_wrap=True,
        )
        raise typer.Exit(2)

    return TyperCommand(
        name,
        callback=explain,
        help=f"{what} (not installed: pip install {distribution})",
        # Whatever follows (options of the real command, --help) gets the same explanation.
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


def _group_class(
    provide: Callable[[], Sequence[metadata.EntryPoint]],
) -> type[TyperGroup]:
    class HaruGroup(TyperGroup):
        """The ``haru`` group: built-in commands, then the registered and the missing ones."""

        @cached_property
        def _registered(self) -> dict[str, metadata.EntryPoint]:
            # A package cannot replace a built-in command; the first entry of a name wins.
            found: dict[str, metadata.EntryPoint] = {}
            for entry in provide():
                if entry.name not in self.commands:
                    found.setdefault(entry.name, entry)
            return found

        def _missing(self) -> list[str]:
            return [
                name
                for name in OPTIONAL_COMMANDS
                if name not in self._registered and name not in self.commands
            ]

        # ``ctx`` is typer's (or click's) Context; ``Any`` keeps these overrides independent of
        # which click typer is built on.
        def list_commands(self, ctx: Any) -> list[str]:
            extra = sorted({*self._registered, *self._missing()})
            return [*super().list_commands(ctx), *extra]

        def get_command(self, ctx: Any, cmd_name: str) -> Any:
            found = super().get_command(ctx, cmd_name)
            if found is not None:
                return found
            if cmd_name in self._registered:
                return _Listed(self._registered[cmd_name])
            if cmd_name in self._missing():
                distribution, what = OPTIONAL_COMMANDS[cmd_name]
                return _missing_command(cmd_name, distribution, what)
            return None

        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            refuse_token_argument(args)
            result: list[str] = super().parse_args(ctx, args)
            return result

        def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
            name, command, rest = super().resolve_command(ctx, args)
            if isinstance(command, _Listed):
                command = _load_command(command.entry)
            return name, command, rest

    return HaruGroup


# ---- registration ----------------------------------------------------------------------------


def _version(value: bool) -> None:
    if value:
        typer.echo(f"haru (haru-server) {metadata.version('haru-server')}")
        raise typer.Exit


def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the installed haru-server version and exit.",
        ),
    ] = False,
) -> None:
    """Haru: hot Active/Standby failover for self-hosted LLM inference."""


def build_app(entries: Sequence[metadata.EntryPoint] | None = None) -> typer.Typer:
    """The ``haru`` application.

    Args:
        entries: The registered commands to mount; default: :func:`discover_commands`, read
            when the app runs (and only for a name that is not a built-in command).
    """
    app = typer.Typer(
        name="haru",
        help="Haru: hot Active/Standby failover for self-hosted LLM inference.",
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        cls=_group_class(discover_commands if entries is None else lambda: entries),
    )
    app.callback()(_root)
    _register(app)
    return app


def _register(app: typer.Typer) -> None:
    db_app = typer.Typer(help="State store maintenance (uses DATABASE_URL).", no_args_is_help=True)
    fleet_app = typer.Typer(help="Inspect or change one fleet.", no_args_is_help=True)
    app.command("serve")(serve)
    app.add_typer(db_app, name="db")
    db_app.command("upgrade")(db_upgrade)
    db_app.command("current")(db_current)
    db_app.command("backup")(db_backup)
    db_app.command("downgrade")(db_downgrade)
    db_app.command("prune")(db_prune)
    app.command("seed")(seed)
    from haru_server._cli_apply import apply

    app.command("apply")(apply)
    from haru_server._cli_keys import keys_app

    app.add_typer(keys_app, name="keys", no_args_is_help=True)
    app.command("fleets")(fleets)
    app.add_typer(fleet_app, name="fleet")
    fleet_app.command("show")(fleet_show)
    policy_app = typer.Typer(help="A fleet's policy.", no_args_is_help=True)
    fleet_app.add_typer(policy_app, name="policy")
    policy_app.command("set")(policy_set)
    domain_app = typer.Typer(help="Provisioned (skypilot) domains.", no_args_is_help=True)
    app.add_typer(domain_app, name="domain")
    domain_app.command("status")(domain_status)
    domain_app.command("up")(domain_up)
    domain_app.command("down")(domain_down)
    app.command("promote")(promote)
    app.command("demote")(demote)
    app.command("events")(events)


app = build_app()
"""The ``haru`` application with the installed distributions' commands."""


def main() -> None:
    """Entry point of ``haru``."""
    app()


def serve_main() -> None:
    """Entry point of ``haru-server`` (the same as ``haru serve``)."""
    app(args=["serve", *sys.argv[1:]], prog_name="haru-server")
