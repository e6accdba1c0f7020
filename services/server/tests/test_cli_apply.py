"""``haru apply`` and ``haru seed`` of a changed layout, as real processes against a real
``haru serve``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from haru_protocol import ApplyResponse, example_layout_json

Haru = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def served(serve_example: Callable[..., dict[str, str]]) -> dict[str, str]:
    """The bundled example fleet seeded, a ``haru serve`` on it; the CLI's env."""
    return serve_example()


def _layout(tmp_path: Path, name: str, change: str) -> Path:
    layout = json.loads(example_layout_json())
    alpha, beta = layout["domains"]
    if change == "standby":
        beta["slots"][0]["models"].append(
            {"name": "example-embed", "servingUrl": "http://127.0.0.1:8024"}
        )
    else:
        alpha["slots"][0]["models"][0]["servingUrl"] = "http://127.0.0.1:8099"
    path = tmp_path / name
    path.write_text(json.dumps(layout), encoding="utf-8")
    return path


def test_apply_plans_asks_and_applies_and_seed_lists_what_it_does_not_add(
    haru: Haru, served: dict[str, str], tmp_path: Path
) -> None:
    path = _layout(tmp_path, "standby.json", "standby")
    seeded = haru("seed", str(path), env=served)
    assert seeded.returncode == 1, seeded.stdout
    assert "differs from the layout where seed only adds" in seeded.stderr
    assert "+ domain beta / inference gpu 0 / model example-embed" in seeded.stderr
    assert "haru apply LAYOUT" in seeded.stderr

    plan = "\n".join(
        [
            "fleet example: 1 change(s)",
            "  + domain beta / inference gpu 0 / model example-embed: servingUrl "
            "http://127.0.0.1:8024",
        ]
    )
    shown = haru("apply", str(path), "--dry-run", env=served)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == plan + "\n"

    # Not a terminal and no --yes: the plan, then nothing applied (exit 2).
    unconfirmed = haru("apply", str(path), env=served)
    assert unconfirmed.returncode == 2, unconfirmed.stderr
    assert "confirm with --yes" in unconfirmed.stderr
    assert haru("apply", str(path), "--dry-run", env=served).stdout == plan + "\n"

    applied = haru("apply", str(path), "--yes", "--json", env=served)
    assert applied.returncode == 0, applied.stderr
    answer = ApplyResponse.model_validate_json(applied.stdout)
    assert answer.applied
    assert [i.path for i in answer.plan.items] == [
        "domain beta / inference gpu 0 / model example-embed"
    ]
    again = haru("apply", str(path), "--yes", env=served)
    assert again.returncode == 0
    assert again.stdout == "fleet example: no changes\n"
    quiet = haru("seed", str(path), env=served)
    assert quiet.returncode == 0, quiet.stderr
    assert "no differences" in quiet.stdout

    events = haru("events", "example", "--json", env=served)
    changed = [
        json.loads(line)["payload"]
        for line in events.stdout.splitlines()
        if json.loads(line)["type"] == "fleet.config.changed"
    ]
    assert [(c["action"], c["path"]) for c in changed] == [
        ("+", "domain beta / inference gpu 0 / model example-embed")
    ]


def test_apply_exits_1_on_a_refused_change_and_changes_nothing(
    haru: Haru, served: dict[str, str], tmp_path: Path
) -> None:
    path = _layout(tmp_path, "active.json", "active")
    refused = haru("apply", str(path), "--yes", env=served)
    assert refused.returncode == 1
    assert "~ domain alpha / inference gpu 0 / model example-chat-small: servingUrl:" in (
        refused.stdout
    )
    assert "refused: domain 'alpha' is active and this would move its traffic: promote" in (
        refused.stdout
    )
    assert "1 change(s) refused; nothing was applied" in refused.stderr
    still = haru("apply", str(path), "--dry-run", env=served)
    assert still.returncode == 1
    assert "fleet example: 1 change(s), 1 refused" in still.stdout


def test_apply_removes_a_standby_and_the_same_slug_comes_back(
    haru: Haru, served: dict[str, str], tmp_path: Path
) -> None:
    layout = json.loads(example_layout_json())
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(layout), encoding="utf-8")
    alpha_only = tmp_path / "alpha.json"
    alpha_only.write_text(
        json.dumps({**layout, "domains": layout["domains"][:1]}), encoding="utf-8"
    )
    shown = haru("apply", str(alpha_only), "--dry-run", env=served)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == "fleet example: 1 change(s)\n  - domain beta: static\n"
    applied = haru("apply", str(alpha_only), "--yes", env=served)
    assert applied.returncode == 0, applied.stderr
    fleet = json.loads(haru("fleet", "show", "example", "--json", env=served).stdout)
    assert [d["slug"] for d in fleet["domains"]] == ["alpha"]
    # Removing the active is refused, and the removed slug can be added again.
    beta_only = tmp_path / "beta.json"
    beta_only.write_text(
        json.dumps({**layout, "activeDomainSlug": None, "domains": layout["domains"][1:]}),
        encoding="utf-8",
    )
    refused = haru("apply", str(beta_only), "--yes", env=served)
    assert refused.returncode == 1
    assert "- domain alpha: static" in refused.stdout
    assert "refused: domain 'alpha' is the active domain" in refused.stdout
    back = haru("apply", str(whole), "--yes", env=served)
    assert back.returncode == 0, back.stderr
    assert "+ domain beta: static, provisioning until its first good heartbeat" in back.stdout
    fleet = json.loads(haru("fleet", "show", "example", "--json", env=served).stdout)
    assert [d["slug"] for d in fleet["domains"]] == ["alpha", "beta"]
