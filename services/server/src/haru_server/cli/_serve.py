"""``haru serve``: run the control server, configured by the environment."""

from __future__ import annotations

import sys
from typing import Annotated

import typer


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
