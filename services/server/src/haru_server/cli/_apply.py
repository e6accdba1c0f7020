"""``haru apply``: show the plan that brings a stored fleet to a layout, then apply it.

Registered by :func:`haru_server.cli._register`; it talks to a running server's control API
(``POST /v1/fleets/{ref}/apply``) as every fleet command does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from haru_server.cli._common import (
    DEFAULT_URL,
    EXIT_USAGE,
    CliFailure,
    JsonOption,
    TokenOption,
    UrlOption,
    _client,
    _guard,
    _run,
)
from haru_server.cli._db import _load_layout
from haru_server.cli._render import _console, _print_json

if TYPE_CHECKING:
    from haru_protocol import ApplyResponse


def apply(
    layout: Annotated[Path, typer.Argument(help="Fleet layout JSON.", show_default=False)],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Apply without asking.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only show the plan; change nothing.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Compare a layout with the stored fleet, show the plan, and apply it once confirmed.

    Plan lines: ``+`` added, ``~`` changed, ``-`` removed. A refused change (with its reason)
    makes the command exit 1 without changing anything. The apply carries the plan's
    revisions: when the fleet changed since the plan was shown, it is refused (409
    plan_stale) and nothing more is applied; plan again.
    """
    import json

    from haru_protocol import render_plan

    def show(answer: ApplyResponse) -> None:
        if as_json:
            _print_json(answer.model_dump_json())
        else:
            _console().print(render_plan(answer.plan), markup=False)

    def body() -> None:
        document = _load_layout(layout)
        raw = json.loads(layout.read_text(encoding="utf-8"))

        async def plan() -> ApplyResponse:
            async with _client(url, token) as client:
                return await client.apply(document.slug, raw, dry_run=True)

        planned = _run(plan())
        refused = planned.plan.refused
        if dry_run or refused or not planned.plan.items:
            show(planned)
            if refused:
                raise CliFailure(f"{len(refused)} change(s) refused; nothing was applied")
            return
        if not as_json:
            show(planned)
        if not yes:
            if not sys.stdin.isatty():
                raise CliFailure(
                    "nothing was applied: confirm with --yes (stdin is not a terminal)",
                    code=EXIT_USAGE,
                )
            if not typer.confirm("Apply these changes?", default=False):
                raise CliFailure("nothing was applied")
        revisions = [r.model_dump(mode="json", by_alias=True) for r in planned.plan.revisions]

        async def go() -> ApplyResponse:
            async with _client(url, token) as client:
                return await client.apply(document.slug, raw, dry_run=False, revisions=revisions)

        applied = _run(go())
        if as_json:
            _print_json(applied.model_dump_json())
        else:
            _console().print(
                f"fleet {document.slug}: {len(applied.plan.items)} change(s) applied",
                markup=False,
            )

    _guard(body)
