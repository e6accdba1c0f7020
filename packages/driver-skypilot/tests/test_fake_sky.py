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
    SkyPreflightError,
    SkyRunner,
    SkyTimeoutError,
    SkyTimeouts,
    SkyUnavailableError,
    SkyVersionMismatchError,
    TaskSpec,
)
from haru_protocol import Placement

FAKE_SKY = """\
#!{python}
# Fake `sky`: records each argv (and any YAML it was given) and answers like SkyPilot 0.14.1,
# as unkindly as it, row by row of issue 28 (source files of SkyPilot 0.14.1):
# - row 6: `status --endpoint PORT N` prints the port's endpoint, which is not the head IP
#   with PORT (RunPod/Vast map ports, Kubernetes goes through a LoadBalancer): here
#   10.1.2.3:<PORT + 30000>; exit 1 for an unknown cluster or one not UP
#   (sky/client/cli/command.py `_show_endpoint`).
# - row 7: `status --ip`: exit 1 `ValueError ... not found` / `... is not in UP status`.
# - row 10: without --refresh, `status` answers from the API server's cache, which its
#   refresh daemon updates every 60 s: a preemption (`preempted`) shows only after that or
#   with --refresh (sky/server/server.py status refresh daemon, sky/backends/backend_utils.py).
# - rows 12/13: the first command other than `--version`/`api info` finds no API server and
#   starts one (`Failed to connect ... Starting a local server.`), which keeps the command's
#   whole environment (sky/server/common.py: `server_env = os.environ.copy()`); here it is
#   written to server.json. `api info -o json` never starts one (command.py `api_info`).
#   A server of another version fails every command with APIVersionMismatchError
#   (sky/server/common.py `check_server_healthy`).
import json, os, pathlib, sys, time

state = pathlib.Path({state!r})  # baked in: `sky` gets no test variables
args = sys.argv[1:]
entry = {{"argv": args}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")

version_file = state / "version"
client_version = version_file.read_text() if version_file.exists() else "0.14.1"
server_file = state / "server.json"
if args == ["--version"]:
    print(f"skypilot, version {{client_version}}")
    sys.exit(0)
if args[:2] == ["api", "info"]:
    if not server_file.exists():
        print("No SkyPilot API server is connected")
        print("├── To connect to an existing API server: sky api login")
        print("└── To start a local API server: sky api start")
        sys.exit(0)
    server = json.loads(server_file.read_text())
    print(json.dumps({{"client": {{"version": client_version, "commit": "abc"}},
                       "server": {{"url": "http://127.0.0.1:46580", "status": "healthy",
                                  "version": server["version"], "commit": "abc",
                                  "api_version": "29"}}, "user": "haru"}}, indent=2))
    sys.exit(0)

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

def start_server():
    server_file.write_text(json.dumps({{"version": client_version, "env": dict(os.environ),
                                        "refreshed": time.time()}}))

if args[:2] == ["api", "start"]:
    start_server()
    print("SkyPilot API server started.")
    sys.exit(0)
if not server_file.exists():
    print("Failed to connect to SkyPilot API server at http://127.0.0.1:46580. "
          "Starting a local server.")
    start_server()
server = json.loads(server_file.read_text())
if server["version"] != client_version:
    print("sky.exceptions.APIVersionMismatchError: SkyPilot API server is not compatible with "
          "the client. Restart the local API server: sky api stop; sky api start",
          file=sys.stderr)
    sys.exit(1)

up = state / "up"
preempted = state / "preempted"
def listed(name):
    return up.exists() and up.read_text() == name

if args[:1] == ["launch"]:
    up.write_text(args[2])
    print("Job submitted, ID: 1")
elif args[:2] in (["status", "--ip"], ["status", "--endpoint"]):
    # SkyPilot 0.14.1 (sky/client/cli/command.py `status --ip/--endpoint`): exit 1 for an
    # unknown cluster (ValueError ... not found) and for one that is not UP.
    name = args[-1]
    if (state / "init").exists():
        print(f"ValueError: Cluster {{name!r}} is not in UP status.", file=sys.stderr)
        sys.exit(1)
    if not listed(name):
        print(f"ValueError: Cluster {{name!r}} not found.", file=sys.stderr)
        sys.exit(1)
    if args[1] == "--ip":
        print("10.1.2.3")
    else:
        print(f"10.1.2.3:{{int(args[2]) + 30000}}")
elif args[:1] == ["status"]:
    names = [a for a in args[1:] if not a.startswith("-") and a != "json"]
    if preempted.exists() and ("--refresh" in args or time.time() - server["refreshed"] >= 60):
        # The refresh (forced, or the daemon's) finally sees what the cloud did.
        if listed(preempted.read_text()):
            up.unlink()
        preempted.unlink()
        server["refreshed"] = time.time()
        server_file.write_text(json.dumps(server))
    rows = [{{"name": n, "status": "UP", "nodes": 1, "autostop": -1,
              "launched_at": 1764460800}} for n in names if listed(n)]
    missing = [n for n in names if not listed(n)]
    if missing:
        print(f"Cluster(s) not found: \\x1b[1m{{', '.join(missing)}}\\x1b[0m.")
    print(json.dumps(rows, indent=2))
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
    script.write_text(FAKE_SKY.format(python=sys.executable, state=str(state)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
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


def server_env(state: Path) -> dict[str, str]:
    env: dict[str, str] = json.loads((state / "server.json").read_text())["env"]
    return env


async def test_the_address_is_the_ports_endpoint_not_the_head_ip(fake_sky: Path) -> None:
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    assert await driver.get_endpoint("haru-demo-alpha", 8000) is None  # unknown: exit 1
    await driver.launch_domain(SPEC)
    (fake_sky / "init").touch()
    assert await driver.get_endpoint("haru-demo-alpha", 8000) is None  # not UP: exit 1
    (fake_sky / "init").unlink()
    # The port is mapped (RunPod, Vast, a Kubernetes LoadBalancer): the IP with 8000 is wrong.
    assert await driver.get_endpoint("haru-demo-alpha", 8000) == "http://10.1.2.3:38000"
    assert calls(fake_sky)[-1]["argv"] == ["status", "--endpoint", "8000", "haru-demo-alpha"]


async def test_one_status_call_reads_every_cluster_and_refresh_sees_a_preemption(
    fake_sky: Path,
) -> None:
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    await driver.launch_domain(SPEC)
    names = ["haru-demo-alpha", "haru-demo-beta"]
    found = await driver.get_domain_statuses(names)
    assert set(found) == {"haru-demo-alpha"}
    assert found["haru-demo-alpha"].status is ClusterStatus.UP
    assert calls(fake_sky)[-1]["argv"] == ["status", *names, "-o", "json"]
    (fake_sky / "preempted").write_text("haru-demo-alpha")
    # The API server's cache still says UP (its refresh daemon runs once a minute) ...
    assert set(await driver.get_domain_statuses(names)) == {"haru-demo-alpha"}
    # ... a refreshed read asks the cloud.
    assert await driver.get_domain_statuses(names, refresh=True) == {}
    assert calls(fake_sky)[-1]["argv"] == ["status", *names, "--refresh", "-o", "json"]


async def test_preflight_starts_a_server_without_harus_environment(
    fake_sky: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARU_SUPERVISOR_TOKEN", "tok-must-not-reach-the-server")
    monkeypatch.setenv("HARU_DATABASE_URL", "postgresql://haru:pw@db/haru")
    monkeypatch.setenv("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    info = await driver.preflight()
    assert (info.client_version, info.server_version, info.started) == ("0.14.1", "0.14.1", True)
    assert [c["argv"] for c in calls(fake_sky)] == [
        ["--version"],
        ["api", "info", "-o", "json"],
        ["api", "start"],
        ["api", "info", "-o", "json"],
    ]
    env = server_env(fake_sky)
    assert not [name for name in env if name.startswith("HARU_")]
    assert env["SKYPILOT_DISABLE_USAGE_COLLECTION"] == "1"
    assert env["PATH"] == os.environ["PATH"]
    # A launch's secret goes to that `sky launch` only, never into the server started before.
    spec = TaskSpec(name=SPEC.name, placement=SPEC.placement, run="x", secrets=("HARU_TOKEN",))
    await driver.launch_domain(spec, secrets={"HARU_TOKEN": "tok-launch"})
    assert "HARU_TOKEN" not in server_env(fake_sky)
    assert (await driver.preflight()).started is False


async def test_a_server_auto_started_by_a_status_read_gets_no_haru_variable(
    fake_sky: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARU_SUPERVISOR_TOKEN", "tok-must-not-reach-the-server")
    await SkyPilotDriver(SkyRunner(sleep=no_sleep)).get_domain_statuses(["haru-demo-alpha"])
    assert "HARU_SUPERVISOR_TOKEN" not in server_env(fake_sky)


async def test_preflight_refuses_a_sky_older_than_the_minimum(fake_sky: Path) -> None:
    (fake_sky / "version").write_text("0.11.2")
    with pytest.raises(SkyPreflightError, match=r"0\.11\.2 is older than 0\.12\.0"):
        await SkyPilotDriver(SkyRunner(sleep=no_sleep)).preflight()


async def test_a_client_server_version_mismatch_is_its_own_error(fake_sky: Path) -> None:
    driver = SkyPilotDriver(SkyRunner(sleep=no_sleep))
    await driver.preflight()
    (fake_sky / "version").write_text("0.14.2")  # the client was upgraded, the server not
    with pytest.raises(SkyVersionMismatchError, match="sky api stop"):
        await driver.get_domain_statuses(["haru-demo-alpha"])
