"""The SkyServe driver against a fake ``sky`` executable on a temp PATH (real run_exec)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from haru_driver_skypilot import SkyCliError, SkyRunner, TaskSpec
from haru_driver_skyserve import ServiceSpec, ServiceStatus, SkyServeDriver
from haru_protocol import Placement

FAKE_SKY = """\
#!{python}
# Fake `sky serve`: records argv and YAML, answers in SkyPilot 0.14.1's shapes and, row by
# row of issue 28, as unkindly:
# - `serve up` of a service still listed fails: "Service N already exists."
#   (sky/serve/service.py: the controller refuses a second service of one name).
# - `serve down` only schedules the termination: the service shows SHUTTING_DOWN for two
#   more status reads, then is gone (sky/serve/serve_utils.py terminate_services).
#   Without --purge a FAILED/CONTROLLER_FAILED/FAILED_CLEANUP service is skipped with exit 0
#   ("Skipping its termination"); with no serve controller at all `down` exits 1 with
#   "No live services." (sky/utils/controller_utils.py).
import json, os, pathlib, sys

state = pathlib.Path({state!r})  # baked in: `sky` gets no test variables
args = sys.argv[1:]
entry = {{"argv": args}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")

controller = state / "controller"
def path(name):
    return state / f"service-{{name}}.json"
def load(name):
    return json.loads(path(name).read_text()) if path(name).exists() else None
def save(name, row):
    path(name).write_text(json.dumps(row))

FAILED = ("FAILED", "CONTROLLER_FAILED", "FAILED_CLEANUP")
if args[:2] == ["serve", "up"]:
    name = args[args.index("-n") + 1]
    controller.touch()
    if load(name) is not None:
        print(f"ValueError: Service {{name}} already exists.", file=sys.stderr)
        sys.exit(1)
    save(name, {{"status": "READY", "left": None}})
elif args[:2] == ["serve", "status"]:
    print("\\x1b[36m\\x1b[1mServices\\x1b[0m")
    name = args[2]
    row = load(name)
    if row is None:
        print("No live services.")
        sys.exit(0)
    if row["left"] is not None:
        if row["left"] == 0:
            path(name).unlink()
            print("No live services.")
            sys.exit(0)
        row["left"] -= 1
        save(name, row)
    ready = "1/1" if row["status"] == "READY" else "0/1"
    # sky.serve.serve_utils.format_service_table: left-aligned, two spaces after each column.
    header = ["NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT"]
    cells = [name, "1", "1m 5s", row["status"], ready, "1.2.3.4:30001"]
    widths = [max(len(h), len(c)) for h, c in zip(header, cells)]
    print("".join(h.ljust(w) + "  " for h, w in zip(header, widths)))
    print("".join(c.ljust(w) + "  " for c, w in zip(cells, widths)))
elif args[:2] == ["serve", "down"]:
    name = args[2]
    if not controller.exists():
        print("No live services.", file=sys.stderr)
        sys.exit(1)
    row = load(name)
    if row is None:
        print("No service to terminate.")
    elif row["status"] in FAILED and "--purge" not in args:
        print(f"Service {{name!r}} is in failed status ({{row['status']}}). Skipping its "
              "termination as it could lead to a resource leak.")
    else:
        save(name, {{"status": "SHUTTING_DOWN", "left": 2}})
        print(f"Service {{name!r}} is scheduled to be terminated.")
else:
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


async def no_sleep(_delay: float) -> None:
    return None


def calls(state: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


async def test_service_lifecycle_through_real_processes(fake_sky: Path) -> None:
    spec = ServiceSpec(
        task=TaskSpec(
            name="haru-demo-alpha",
            placement=Placement.model_validate(
                {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"}
            ),
            ports=(8000,),
            run="vllm serve m",
        ),
        readiness_path="/health",
    )
    driver = SkyServeDriver(SkyRunner(), sleep=no_sleep)
    assert await driver.get_service_status("haru-demo-alpha") is None
    await driver.teardown_service("haru-demo-alpha")  # no controller: "No live services."
    await driver.launch_service(spec)
    info = await driver.get_service_status("haru-demo-alpha")
    assert info is not None
    assert info.status is ServiceStatus.READY
    assert info.endpoint == "1.2.3.4:30001"
    with pytest.raises(SkyCliError, match="already exists"):
        await driver.launch_service(spec)
    # `down` schedules the termination; the driver returns once it is no longer listed.
    await driver.teardown_service("haru-demo-alpha")
    assert await driver.get_service_status("haru-demo-alpha") is None
    await driver.launch_service(spec)

    recorded = calls(fake_sky)
    commands: list[list[str]] = [c["argv"] for c in recorded]  # type: ignore[misc]
    assert commands[1] == ["serve", "down", "haru-demo-alpha", "-y", "--purge"]
    assert [c[:2] for c in commands[5:]] == [
        ["serve", "down"],
        ["serve", "status"],
        ["serve", "status"],
        ["serve", "status"],
        ["serve", "status"],
        ["serve", "up"],
    ]
    assert "readiness_probe:" in str(recorded[2]["yaml"])


async def test_a_failed_service_is_purged(fake_sky: Path) -> None:
    driver = SkyServeDriver(SkyRunner(), sleep=no_sleep)
    (fake_sky / "controller").touch()
    (fake_sky / "service-haru-demo-alpha.json").write_text(
        json.dumps({"status": "CONTROLLER_FAILED", "left": None})
    )
    await driver.teardown_service("haru-demo-alpha")
    assert await driver.get_service_status("haru-demo-alpha") is None
