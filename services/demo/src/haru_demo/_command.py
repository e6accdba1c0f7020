"""The ``haru demo`` command, registered under the ``haru.commands`` entry-point group.

The ``haru`` CLI of haru-server lists the commands of that group and loads this module only
when ``haru demo`` runs (``haru --help`` does not import it).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from haru_demo._options import DEFAULT_DEMO_PORT
from haru_demo._run import DemoRun, run_demo


def demo(
    scenario_only: Annotated[
        bool,
        typer.Option(
            "--scenario-only",
            help="Exit after the scenario with a summary (status 0 on success).",
        ),
    ] = False,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            min=1.0,
            help="After the scenario, serve this many seconds and stop (default: until Ctrl-C).",
            show_default=False,
        ),
    ] = None,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir",
            help="Folder for the database, configs, logs and checkpoints (default: a temp dir).",
            show_default=False,
        ),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the workdir (a given --workdir is always kept).")
    ] = False,
    port: Annotated[
        int,
        typer.Option(
            "--port", min=0, max=65535, help="Server port; taken = a free one (0: any free one)."
        ),
    ] = DEFAULT_DEMO_PORT,
    no_scenario: Annotated[
        bool,
        typer.Option("--no-scenario", help="Start the fleet and serve, without the scenario."),
    ] = False,
) -> None:
    """Run a whole local fleet (no GPU needed): a scenario, then serve until Ctrl-C."""
    if scenario_only and no_scenario:
        sys.stderr.write("--scenario-only and --no-scenario exclude each other\n")
        raise typer.Exit(2)
    owned = workdir is None
    folder = Path(tempfile.mkdtemp(prefix="haru-demo-")) if workdir is None else workdir
    run = DemoRun(
        workdir=folder,
        port=port,
        scenario=not no_scenario,
        scenario_only=scenario_only,
        duration_s=duration,
    )
    try:
        status = run_demo(run)
    finally:
        if owned and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            sys.stderr.write(f"workdir kept: {folder}\n")
    raise typer.Exit(status)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
"""The ``haru.commands`` entry point ``demo``: one command, mounted as ``haru demo``."""
app.command("demo")(demo)
