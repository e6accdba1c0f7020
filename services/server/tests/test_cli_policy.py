"""``haru fleet policy set``, the policy in ``haru fleet show`` and ``haru seed`` of a changed
policy, as real processes against a real ``haru serve``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from haru_protocol import FleetPolicyResponse, example_layout_json

Haru = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def served(serve_example: Callable[..., dict[str, str]]) -> dict[str, str]:
    """The bundled example fleet seeded, a ``haru serve`` on it; the CLI's env."""
    return serve_example()


def _row(table: str, key: str) -> list[str]:
    """The cells after ``key`` in its row of a rendered table."""
    line = next(line for line in table.splitlines() if f" {key} " in line)
    cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
    assert cells[0] == key
    return cells[1:]


def test_policy_set_changes_the_policy_and_fleet_show_shows_it(
    haru: Haru, served: dict[str, str]
) -> None:
    changed = haru(
        "fleet", "policy", "set", "example", "degradedGraceMs=1500", "autoFailover=false",
        "probe.prompt=hello there", env=served,
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    assert "autoFailover, degradedGraceMs, probe" in changed.stdout

    shown = haru("fleet", "show", "example", env=served)
    assert shown.returncode == 0, shown.stderr
    assert _row(shown.stdout, "degradedGraceMs") == ["1500", "60000"]
    assert _row(shown.stdout, "probe.prompt") == ["hello there", "ping"]
    assert _row(shown.stdout, "heartbeatStaleMs") == ["15000", "30000"]  # set by the layout
    assert _row(shown.stdout, "sleepTimeoutMs") == ["60000", ""]  # the default: not repeated

    # key=default follows the default again; --json prints the server's answer.
    cleared = haru(
        "fleet", "policy", "set", "example", "degradedGraceMs=default", "--json", env=served
    )
    assert cleared.returncode == 0, cleared.stderr
    answer = FleetPolicyResponse.model_validate_json(cleared.stdout)
    assert answer.changed == ("degradedGraceMs",)
    assert answer.policy.degraded_grace_ms == 60_000
    assert answer.patch == {
        "autoFailover": False,
        "heartbeatStaleMs": 15_000,
        "probe": {"prompt": "hello there"},
    }

    events = haru("events", "example", "--json", env=served)
    changes = [
        json.loads(line)
        for line in events.stdout.splitlines()
        if json.loads(line)["type"] == "fleet.policy.changed"
    ]
    assert [c["payload"]["changed"] for c in changes] == [
        ["autoFailover", "degradedGraceMs", "probe"],
        ["degradedGraceMs"],
    ]


def test_policy_set_refuses_bad_input(haru: Haru, served: dict[str, str]) -> None:
    unknown = haru("fleet", "policy", "set", "example", "degradedGraceMS=5", env=served)
    assert unknown.returncode == 1
    assert "400 invalid_request" in unknown.stderr
    assert "degradedGraceMS" in unknown.stderr
    zero = haru("fleet", "policy", "set", "example", "wakeTimeoutMs=0", env=served)
    assert zero.returncode == 1
    assert "wakeTimeoutMs" in zero.stderr
    for bad in ("degradedGraceMs=", "=5", "degradedGraceMs"):
        usage = haru("fleet", "policy", "set", "example", bad, env=served)
        assert usage.returncode == 2, (bad, usage.stderr)
    missing = haru("fleet", "policy", "set", "nope", "autoFailover=true", env=served)
    assert missing.returncode == 1
    assert "404 fleet_not_found" in missing.stderr
    shown = haru("fleet", "show", "example", "--json", env=served)
    assert json.loads(shown.stdout)["policy"]["degradedGraceMs"] == 60_000


def test_seed_says_when_the_stored_policy_differs_from_the_layout(
    haru: Haru, served: dict[str, str], tmp_path: Path
) -> None:
    same = haru("seed", env=served)
    assert same.returncode == 0, same.stderr
    assert "present, 0 domain(s) and 0 slot(s) added, no differences" in same.stdout

    layout = json.loads(example_layout_json())
    layout["policy"] = {**layout.get("policy", {}), "degradedGraceMs": 1000}
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(layout), encoding="utf-8")
    differs = haru("seed", str(path), env=served)
    assert differs.returncode == 1, differs.stdout
    assert "present, 0 domain(s) and 0 slot(s) added" in differs.stdout
    assert "no differences" not in differs.stdout
    assert "degradedGraceMs: stored 60000, layout 1000" in differs.stderr
    assert "haru fleet policy set example degradedGraceMs=1000" in differs.stderr

    # Applying the suggestion brings them in line: the seed is quiet again.
    applied = haru("fleet", "policy", "set", "example", "degradedGraceMs=1000", env=served)
    assert applied.returncode == 0, applied.stderr
    again = haru("seed", str(path), env=served)
    assert again.returncode == 0, again.stderr
