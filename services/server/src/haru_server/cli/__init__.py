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

This module assembles the application (:func:`build_app`, :func:`main`). The rest of the
package: ``_common`` (exit codes, options, the API token, failures, the control API client),
``_render`` (tables, JSON, the views of fleets and events), ``_plugins`` (commands of other
distributions), and one module per command group: ``_serve``, ``_db`` (``db`` and ``seed``),
``_apply``, ``_keys``, ``_fleet`` (``fleets`` and ``fleet``), ``_domain``, ``_operations``
(``promote`` and ``demote``), ``_events``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Annotated

import typer

from haru_server.cli._apply import apply
from haru_server.cli._common import (
    DEFAULT_URL,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_OPERATION_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    CliFailure,
)
from haru_server.cli._db import (
    DEFAULT_RETENTION_DAYS,
    db_backup,
    db_current,
    db_downgrade,
    db_prune,
    db_upgrade,
    seed,
)
from haru_server.cli._domain import domain_down, domain_status, domain_up
from haru_server.cli._events import events
from haru_server.cli._fleet import fleet_show, fleets, policy_set
from haru_server.cli._keys import keys_app
from haru_server.cli._operations import demote, promote
from haru_server.cli._plugins import (
    COMMAND_GROUP,
    OPTIONAL_COMMANDS,
    _group_class,
    discover_commands,
)
from haru_server.cli._render import format_event
from haru_server.cli._serve import serve

__all__ = [
    "COMMAND_GROUP",
    "DEFAULT_RETENTION_DAYS",
    "DEFAULT_URL",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_OPERATION_FAILED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "EXIT_WAIT_TIMEOUT",
    "OPTIONAL_COMMANDS",
    "CliFailure",
    "app",
    "build_app",
    "discover_commands",
    "format_event",
    "main",
    "serve_main",
]


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
    app.command("apply")(apply)
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
