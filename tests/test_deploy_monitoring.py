"""deploy/prometheus and deploy/grafana: promtool checks the rules and runs their unit tests; the
dashboard's structure is checked here (that its queries name only exported metrics is checked
against a live scrape in services/server/tests/test_observability.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "haru-fleet.json"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("CI"),
    reason="promtool is missing (Debian's prometheus package; .ci/run installs it)",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is missing: .ci/run installs Debian's prometheus"
    return subprocess.run(
        [PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
    )


@needs_promtool
def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", "haru-rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_every_alert_has_a_passing_unit_test() -> None:
    result = promtool("test", "rules", "haru-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    rules = yaml.safe_load((PROMETHEUS / "haru-rules.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tests = yaml.safe_load((PROMETHEUS / "haru-rules.test.yml").read_text())
    tested = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert alerts == tested, sorted(alerts ^ tested)


@needs_promtool
def test_a_broken_expectation_fails_promtool(tmp_path: Path) -> None:
    # The unit tests can fail: the same file with one expected label changed does.
    text = (PROMETHEUS / "haru-rules.test.yml").read_text()
    broken = text.replace(
        "{severity: critical, fleet: prod}", "{severity: critical, fleet: lab}", 1
    )
    assert broken != text
    (tmp_path / "haru-rules.yml").write_text((PROMETHEUS / "haru-rules.yml").read_text())
    (tmp_path / "broken.test.yml").write_text(broken)
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "broken.test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "HaruNoStandbyReady" in result.stdout + result.stderr


def test_every_alert_says_what_to_do_in_the_operations_guide() -> None:
    rules = yaml.safe_load((PROMETHEUS / "haru-rules.yml").read_text())
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]
            assert f"### {rule['alert']}" in guide, rule["alert"]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "haru-fleet"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Promotions", "Proxy", "Supervisors", "Processes"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in _panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            for name in ("fleet", "job", "datasource"):
                if f"${name}" in target["expr"]:
                    assert name in variables
    titles = {p["title"] for p in _panels(dashboard)}
    # The rows the operator needs first: who serves, whether a standby can take over, whether
    # promotions work, whether the proxy fails requests.
    for needed in ("Active domain", "Standbys ready", "Step duration p95", "5xx ratio"):
        assert needed in titles
