"""The ``haru`` CLI: store commands on a real database, remote commands against ``haru serve``."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    AlreadyActiveResponse,
    Event,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationState,
    example_layout_json,
)
from haru_server.cli import EXIT_UNREACHABLE, EXIT_WAIT_TIMEOUT, app
from typer.testing import CliRunner, Result

MakeFleet = Callable[..., Awaitable[LocalFleet]]
HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""

WIDE = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


TOKEN = "cli-token-0123456789"
AUTH_ENV = {"HARU_API_TOKEN": TOKEN}


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    runner = CliRunner()
    return runner.invoke(app, list(args), env={**WIDE, **(env or {})}, catch_exceptions=False)


def test_db_upgrade_and_seed_the_example(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    behind = invoke_split("db", "current", "--json", "--database-url", url)
    assert behind.exit_code == 1, behind.output
    current = json.loads(behind.stdout)
    assert current["revision"] is None
    assert current["atHead"] is False
    assert current["head"]
    upgraded = invoke("db", "upgrade", env={"DATABASE_URL": url})
    assert upgraded.exit_code == 0, upgraded.output
    assert "revision" in upgraded.output
    at_head = invoke_split("db", "current", "--json", "--database-url", url)
    assert at_head.exit_code == 0, at_head.output
    assert json.loads(at_head.stdout) == {**current, "revision": current["head"], "atHead": True}
    shown = invoke("db", "current", "--database-url", url)
    assert shown.exit_code == 0
    assert "at head" in shown.output
    seeded = invoke("seed", "--database-url", url)
    assert seeded.exit_code == 0, seeded.output
    assert "fleet example" in seeded.output
    assert "created" in seeded.output
    again = invoke("seed", env={"DATABASE_URL": url})
    assert again.exit_code == 0
    assert "present, 0 domain(s) and 0 slot(s) added, no differences" in again.output
    assert "0 domain(s) and 0 slot(s) added" in again.output


def test_seed_a_layout_file_and_reject_a_bad_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    layout = json.loads(example_layout_json())
    layout["slug"] = "custom"
    good = tmp_path / "good.json"
    good.write_text(json.dumps(layout), encoding="utf-8")
    result = invoke("seed", str(good), "--database-url", url)
    assert result.exit_code == 0, result.output
    assert "fleet custom" in result.output
    layout["domains"][0]["supervisorURL"] = "http://typo"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(layout), encoding="utf-8")
    result = invoke("seed", str(bad), "--database-url", url)
    assert result.exit_code == 2
    assert "supervisorURL" in result.output
    missing = invoke("seed", str(tmp_path / "missing.json"), "--database-url", url)
    assert missing.exit_code == 2
    assert "cannot read" in missing.output


def test_remote_commands_explain_an_unreachable_server() -> None:
    result = invoke("fleets", "--url", "http://127.0.0.1:1")
    assert result.exit_code == EXIT_UNREACHABLE == 5
    assert "cannot reach the server" in result.output


@pytest.fixture
async def served(
    haru_serve: HaruServe, tmp_path: Path, make_fleet: MakeFleet
) -> AsyncIterator[tuple[str, LocalFleet]]:
    """A ``haru serve`` process on a SQLite file seeded with a local fleet, with its loop."""
    fleet = await make_fleet()
    url = f"sqlite:///{tmp_path / 'served.db'}"
    from datetime import UTC, datetime

    from haru_db import upgrade

    await upgrade(url)
    store = StateStore.open(url)
    await store.apply_fleet_layout(fleet.layout(), at=datetime.now(UTC))
    await store.close()
    env = {"DATABASE_URL": url, "PORT": "0", **AUTH_ENV, "HARU_RECONCILE_INTERVAL_MS": "100"}
    async with haru_serve(env) as server:
        yield server.url, fleet


async def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    """``haru ARGS`` with the token in the environment (``env`` replaces it)."""
    return await asyncio.to_thread(invoke, *args, env=AUTH_ENV if env is None else env)


def invoke_split(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run ``haru ARGS`` with stdout and stderr apart, as a script sees them (narrow COLUMNS)."""
    runner = CliRunner()
    return runner.invoke(
        app, list(args), env={**WIDE, "COLUMNS": "40", **(env or {})}, catch_exceptions=False
    )


async def run_split(*args: str) -> Result:
    return await asyncio.to_thread(invoke_split, *args, env=AUTH_ENV)


async def test_remote_commands_against_a_running_server(served: tuple[str, LocalFleet]) -> None:
    base, _fleet = served
    auth = ("--url", base)
    denied = await run_cli("fleets", "--url", base, env={"HARU_API_TOKEN": "wrong"})
    assert denied.exit_code == 1
    assert "401" in denied.output
    assert TOKEN not in denied.output

    listing = await run_cli("fleets", *auth)
    assert listing.exit_code == 0, listing.output
    assert "local" in listing.output

    shown = await run_cli("fleet", "show", "local", *auth)
    assert shown.exit_code == 0, shown.output
    for text in ("alpha", "beta", "active", "standby", "serving", "sleeping", "example-chat-large"):
        assert text in shown.output

    unknown = await run_cli("promote", "local", "gamma", *auth)
    assert unknown.exit_code == 2
    assert "no domain 'gamma'" in unknown.output
    active = await run_cli("promote", "local", "alpha", *auth)
    assert active.exit_code == 0
    assert "already active" in active.output
    refused = await run_cli("demote", "local", "alpha", *auth)
    assert refused.exit_code == 1
    assert "422" in refused.output

    promoted = await run_cli("promote", "local", "beta", "--wait", "--timeout", "60", *auth)
    assert promoted.exit_code == 0, promoted.output
    assert "accepted" in promoted.output
    for step in ("stop_training", "wake_vllm", "probe", "switch_active", "demote_old_train"):
        assert step in promoted.output
    assert "promote succeeded" in promoted.output

    shown = await run_cli("fleet", "show", "local", *auth)
    beta_line = next(line for line in shown.output.splitlines() if " beta " in line)
    assert "active" in beta_line

    events = await run_cli("events", "local", *auth)
    assert events.exit_code == 0
    assert "routing.switched" in events.output
    # Each event's domain by slug, in a column of its own.
    switched = next(line for line in events.output.splitlines() if "routing.switched" in line)
    assert switched.split()[2] == "beta", switched
    assert "operation.succeeded" in events.output
    later = await run_cli("events", "local", "--after", "100000", *auth)
    assert later.exit_code == 0
    assert later.output.strip() == ""


async def test_json_output_for_scripts_and_the_wait_exit_codes(
    served: tuple[str, LocalFleet],
) -> None:
    base, fleet = served
    auth = ("--url", base)

    listing = await run_split("fleets", "--json", *auth)
    assert listing.exit_code == 0, listing.output
    [entry] = json.loads(listing.stdout)["fleets"]
    assert entry["slug"] == "local"
    assert entry["activeDomainSlug"] == "alpha"
    table = await run_split("fleets", *auth)
    line = next(line for line in table.stdout.splitlines() if "local" in line)
    assert "alpha" in line  # the active domain by slug, not by id
    assert entry["activeDomainId"] not in line

    shown = await run_split("fleet", "show", "local", "--json", *auth)
    assert shown.exit_code == 0, shown.output
    snapshot = FleetSnapshot.model_validate_json(shown.stdout)
    assert {d.slug for d in snapshot.domains} == {"alpha", "beta"}
    assert shown.stdout.count("\n") == 1  # one document, never hard-wrapped

    # Piped output uses the width it needs (COLUMNS is 40 here): the whole command on one line.
    plain = await run_split("fleet", "show", "local", *auth)
    assert " ".join(fleet.training_command) in plain.stdout

    already = await run_split("promote", "local", "alpha", "--json", *auth)
    assert already.exit_code == 0, already.output
    assert AlreadyActiveResponse.model_validate_json(already.stdout).route_revision >= 1

    promoted = await run_split("promote", "local", "beta", "--wait", "--json", *auth)
    assert promoted.exit_code == 0, promoted.output
    operation = Operation.model_validate_json(promoted.stdout)
    assert operation.state is OperationState.SUCCEEDED
    assert operation.kind is OperationKind.PROMOTE

    events = await run_split("events", "local", "--json", *auth)
    assert events.exit_code == 0, events.output
    parsed = [Event.model_validate_json(line) for line in events.stdout.splitlines()]
    documents = [json.loads(line) for line in events.stdout.splitlines()]
    slugs = {d["domainId"]: d["domainSlug"] for d in documents if d["domainId"] is not None}
    assert set(slugs.values()) == {"alpha", "beta"}
    assert {UUID(i): slug for i, slug in slugs.items()} == {d.id: d.slug for d in snapshot.domains}
    assert [e.id for e in parsed] == sorted(e.id for e in parsed)
    assert "routing.switched" in {str(e.type) for e in parsed}

    # A wake that keeps failing: the operation stays in flight and --wait runs out (exit 4),
    # still printing the operation as it stands.
    for sim in fleet.domain("alpha").sims.values():
        await sim.set_faults(wake_fails=True)
    timed_out = await run_split(
        "promote", "local", "alpha", "--wait", "--timeout", "1", "--json", *auth
    )
    assert timed_out.exit_code == EXIT_WAIT_TIMEOUT == 4, timed_out.output
    pending = Operation.model_validate_json(timed_out.stdout)
    assert pending.state in (OperationState.PENDING, OperationState.RUNNING)
    assert "still" in timed_out.stderr


def test_a_token_on_the_command_line_is_refused_naming_the_alternatives() -> None:
    import subprocess

    for argv in (["fleets", "--token", TOKEN], ["fleets", f"--token={TOKEN}"], ["--token", TOKEN]):
        done = subprocess.run(
            [sys.executable, "-m", "haru_server", *argv, "--url", "http://127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "NO_COLOR": "1"},
            check=False,
        )
        assert done.returncode == 2, done
        assert "visible to every user" in done.stderr
        assert "HARU_API_TOKEN" in done.stderr
        assert "--token-file" in done.stderr
        assert TOKEN not in done.stdout + done.stderr
        assert "Traceback" not in done.stderr


async def test_the_token_comes_from_a_file_with_a_warning_when_others_can_read_it(
    served: tuple[str, LocalFleet], tmp_path: Path
) -> None:
    base, _fleet = served
    private = tmp_path / "private-token"
    private.write_text(f"  {TOKEN}\n", encoding="utf-8")
    private.chmod(0o600)
    shared = tmp_path / "shared-token"
    shared.write_text(TOKEN, encoding="utf-8")
    shared.chmod(0o644)

    quiet = await run_cli("fleets", "--url", base, "--token-file", str(private), env={})
    assert quiet.exit_code == 0, quiet.output
    assert "local" in quiet.stdout
    assert "warning" not in quiet.output

    loose = await asyncio.to_thread(
        invoke_split, "fleets", "--url", base, "--token-file", str(shared)
    )
    assert loose.exit_code == 0, loose.output
    assert "local" in loose.stdout
    assert "readable by other users" in loose.stderr
    assert "chmod 600" in loose.stderr
    assert TOKEN not in loose.stderr

    # HARU_API_TOKEN_FILE is the same; a file that cannot be read is a usage error.
    by_env = await run_cli("fleets", "--url", base, env={"HARU_API_TOKEN_FILE": str(private)})
    assert by_env.exit_code == 0, by_env.output
    missing = await run_cli("fleets", "--url", base, "--token-file", str(tmp_path / "none"))
    assert missing.exit_code == 2
    assert "cannot read the token file" in missing.output


MARKUP = "[red]x[/red] [link=http://evil.example]y[/link] [bold]z"


async def test_server_and_layout_text_is_printed_verbatim_not_as_markup(
    haru_serve: HaruServe, tmp_path: Path
) -> None:
    from haru_db import upgrade

    url = f"sqlite:///{tmp_path / 'markup.db'}"
    await upgrade(url)
    layout = json.loads(example_layout_json())
    layout["displayName"] = MARKUP
    for domain in layout["domains"]:
        for slot in domain["slots"]:
            if slot["kind"] == "training":
                slot["command"] = ["train", "[red]arg[/red]", ":warning:"]
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(layout), encoding="utf-8")
    seeded = await asyncio.to_thread(invoke, "seed", str(path), "--database-url", url)
    assert seeded.exit_code == 0, seeded.output
    async with haru_serve({"DATABASE_URL": url, "PORT": "0", **AUTH_ENV}) as server:
        shown = await run_cli("fleet", "show", "example", "--url", server.url)
        missing = await run_cli("promote", "example", "[red]gamma[/red]", "--url", server.url)
    assert shown.exit_code == 0, shown.output
    assert MARKUP in shown.output
    assert "train [red]arg[/red] :warning:" in shown.output
    assert missing.exit_code == 2
    assert "no domain '[red]gamma[/red]'" in " ".join(missing.output.split())


def _haru_piped(
    *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``haru ARGV`` as a real process with stdout a pipe (as in ``haru ... | less``)."""
    return subprocess.run(
        [sys.executable, "-m", "haru_server", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        check=False,
    )


BOX_DRAWING = re.compile("[\u2500-\u257f]")


async def test_piped_tables_are_plain_ascii(served: tuple[str, LocalFleet]) -> None:
    base, _fleet = served
    for argv in (["fleets"], ["fleet", "show", "local"]):
        done = await asyncio.to_thread(_haru_piped, *argv, "--url", base, env=AUTH_ENV)
        assert done.returncode == 0, done
        assert "local" in done.stdout
        assert "+--" in done.stdout  # the tables are there, drawn in ASCII
        assert not BOX_DRAWING.search(done.stdout), done.stdout
        assert done.stdout.isascii(), done.stdout


def test_seed_print_example_prints_the_layout_and_opens_no_database(tmp_path: Path) -> None:
    store = tmp_path / "never.db"
    done = _haru_piped(
        "seed", "--print-example", cwd=tmp_path, env={"DATABASE_URL": f"sqlite:///{store}"}
    )
    assert done.returncode == 0, done
    assert json.loads(done.stdout) == json.loads(example_layout_json())
    assert list(tmp_path.iterdir()) == []  # nothing created, not even the default store
    refused = _haru_piped("seed", "--print-example", "layout.json", cwd=tmp_path)
    assert refused.returncode == 2, refused
    assert list(tmp_path.iterdir()) == []


def test_shell_completion_covers_builtin_and_registered_commands() -> None:
    haru = str(Path(sys.executable).with_name("haru"))  # the installed console script
    shown = subprocess.run(
        [haru, "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        # Typer otherwise ignores "bash" and detects the shell from the parent processes,
        # which a run started without a shell among them (a detached job) does not have.
        env={"PATH": "/usr/bin:/bin", "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
        check=False,
    )
    assert shown.returncode == 0, shown
    assert "complete -o default -F _haru_completion haru" in shown.stdout
    # What the installed script asks at each <TAB>: a registered command (demo) is offered too.
    done = subprocess.run(
        [haru],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "_HARU_COMPLETE": "complete_bash",
            "COMP_WORDS": "haru de",
            "COMP_CWORD": "1",
        },
        check=False,
    )
    assert done.returncode == 0, done
    assert sorted(done.stdout.split()) == ["demo", "demote"]
