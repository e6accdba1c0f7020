"""The runner and driver against a fake ``sky`` executable on a temp PATH (real run_exec)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from haru_driver_skypilot import (
    ClusterStatus,
    SkyCliError,
    SkyPilotDriver,
    SkyRunner,
    SkyTimeoutError,
    SkyTimeouts,
    SkyUnavailableError,
    TaskSpec,
)
from haru_protocol import Placement

FAKE_SKY = """\
#!{python}
# Fake `sky`: records each argv (and any YAML it was given) and answers like SkyPilot 0.14.1.
import json, os, pathlib, sys, time

state = pathlib.Path(os.environ["FAKE_SKY_STATE"])
args = sys.argv[1:]
entry = {{"argv": args}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")

cold = state / "cold"
if cold.exists():
    cold.unlink()
    print("Failed to connect to SkyPilot API server at http://127.0.0.1:46580. "
          "Starting a local server.")
    print("ConnectionRefusedError: [Errno 111] Connection refused", file=sys.stderr)
    sys.exit(1)

started = state / "started"
if started.exists():
    # The client started a local server, reached it, and then the command failed on its own.
    started.unlink()
    print("Failed to connect to SkyPilot API server at http://127.0.0.1:46580. "
          "Starting a local server.")
    print("sky.exceptions.ResourcesUnavailableError: Failed to provision all possible "
          "launchable resources.", file=sys.stderr)
    sys.exit(1)

if args[:1] == ["launch"]:
    (state / "up").write_text(args[2])
    print("Job submitted, ID: 1")
elif args[:2] == ["status", "--ip"]:
    # SkyPilot 0.14.1 (sky/client/cli/command.py `status --ip`): exit 1 for an unknown
    # cluster (ValueError ... not found) and for one that is not UP.
    name = args[2]
    up = state / "up"
    if (state / "init").exists():
        print(f"ValueError: Cluster {{name!r}} is not in UP status.", file=sys.stderr)
        sys.exit(1)
    if up.exists() and up.read_text() == name:
        print("10.1.2.3")
    else:
        print(f"ValueError: Cluster {{name!r}} not found.", file=sys.stderr)
        sys.exit(1)
elif args[:1] == ["status"]:
    name = args[1]
    up = state / "up"
    if up.exists() and up.read_text() == name:
        print(json.dumps([{{"name": name, "status": "UP", "nodes": 1, "autostop": -1,
                           "launched_at": 1764460800}}], indent=2))
    else:
        print(f"Cluster(s) not found: \\x1b[1m{{name}}\\x1b[0m.")
        print("[]")
elif args[:1] == ["down"]:
    (state / "up").unlink(missing_ok=True)
elif args[:1] == ["hang"]:
    time.sleep(30)
else:
    print(f"Error: No such command '{{args[0]}}'.", file=sys.stderr)
    sys.exit(2)
"""


@pytest.fixture
def fake_sky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    state = tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    script = bin_dir / "sky"
    script.write_text(FAKE_SKY.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_SKY_STATE", str(state))
    return state


def calls(state: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def exists(path: str) -> bool:
    return Path(path).exists()


async def no_sleep(_delay: float) -> None:
    return None


SPEC = TaskSpec(
    name="haru-demo-alpha",
    placement=Placement.model_validate(
        {"cloud": "gcp", "region": "us-central1", "accelerator": "L4"}
    ),
    ports=(8000,),
    run="vllm serve m",
)


async def test_driver_lifecycle_through_real_processes(fake_sky: Path) -> None:
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    assert await driver.get_domain_status("haru-demo-alpha") is None
    await driver.launch_domain(SPEC)
    info = await driver.get_domain_status("haru-demo-alpha")
    assert info is not None
    assert info.status is ClusterStatus.UP
    await driver.teardown_domain("haru-demo-alpha")
    assert await driver.get_domain_status("haru-demo-alpha") is None

    recorded = calls(fake_sky)
    assert [c["argv"][:2] for c in recorded] == [  # type: ignore[index]
        ["status", "haru-demo-alpha"],
        ["launch", "-c"],
        ["status", "haru-demo-alpha"],
        ["down", "haru-demo-alpha"],
        ["status", "haru-demo-alpha"],
    ]
    launch = recorded[1]
    assert "infra: gcp/us-central1" in str(launch["yaml"])
    assert not exists(str(launch["argv"][-1]))  # type: ignore[index]


async def test_cold_server_retry_through_real_processes(fake_sky: Path) -> None:
    (fake_sky / "cold").touch()
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    assert await driver.get_domain_status("haru-demo-alpha") is None
    assert len(calls(fake_sky)) == 2


async def test_no_address_is_a_non_zero_exit_like_skypilot(fake_sky: Path) -> None:
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    assert await driver.get_head_ip("haru-demo-alpha") is None
    await driver.launch_domain(SPEC)
    (fake_sky / "init").touch()
    assert await driver.get_head_ip("haru-demo-alpha") is None
    (fake_sky / "init").unlink()
    assert await driver.get_head_ip("haru-demo-alpha") == "10.1.2.3"
    # Exit 1 with a ValueError is the cluster's answer, not a cold server: asked once each.
    assert [c["argv"][:2] for c in calls(fake_sky)].count(["status", "--ip"]) == 3  # type: ignore[index]


async def test_a_failed_launch_after_the_server_start_line_runs_once(fake_sky: Path) -> None:
    (fake_sky / "started").touch()
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    with pytest.raises(SkyCliError, match="ResourcesUnavailableError"):
        await driver.launch_domain(SPEC)
    assert [c["argv"][0] for c in calls(fake_sky)] == ["launch"]  # type: ignore[index]


async def test_cli_error_through_real_processes(fake_sky: Path) -> None:
    with pytest.raises(SkyCliError) as info:
        await SkyRunner().run(["bogus"], timeout=10)
    assert info.value.returncode == 2
    assert "No such command" in info.value.stderr


async def test_timeout_kills_the_real_process(fake_sky: Path) -> None:
    with pytest.raises(SkyTimeoutError) as info:
        await SkyRunner().run(["hang"], timeout=0.5)
    assert info.value.timeout == 0.5
    assert info.value.argv == ("sky", "hang")


async def test_missing_sky_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    driver = SkyPilotDriver(timeouts=SkyTimeouts(status=5))
    with pytest.raises(SkyUnavailableError):
        await driver.get_domain_status("c")
