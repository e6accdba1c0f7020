"""What every ``haru`` command shares: exit codes, options, the API token, failures, the client.

A command body runs under :func:`_guard`, which turns a :class:`CliFailure` into a message on
stderr and its exit code; :func:`_run` runs a coroutine against the control API
(:func:`_client`), :func:`_run_db` one against the state store.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Final, TypeVar

import typer

from haru_server.cli._render import _err_console, _escape

if TYPE_CHECKING:
    from haru_server.control_client import ControlClient

_T = TypeVar("_T")

DEFAULT_URL = "http://127.0.0.1:8700"


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
