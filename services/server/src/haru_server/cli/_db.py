"""``haru db ...`` and ``haru seed``: the commands that open the state store (``DATABASE_URL``).

Each imports the state store (SQLAlchemy, Alembic) in its body, so the other commands start
without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Final

import typer

from haru_server.cli._common import (
    EXIT_ERROR,
    CliFailure,
    DatabaseOption,
    JsonOption,
    _guard,
    _run_db,
)
from haru_server.cli._render import _console, _escape, _print_json

if TYPE_CHECKING:
    from haru_protocol import FleetLayout


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
