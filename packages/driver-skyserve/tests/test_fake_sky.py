"""The SkyServe driver against a fake ``sky`` executable on a temp PATH (real run_exec)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from haru_driver_skypilot import SkyRunner, TaskSpec
from haru_driver_skyserve import ServiceSpec, ServiceStatus, SkyServeDriver
from haru_protocol import Placement

FAKE_SKY = """\
#!{python}
# Fake `sky serve`: records argv and YAML, answers in SkyPilot 0.14.1's shapes.
import json, os, pathlib, sys

state = pathlib.Path(os.environ["FAKE_SKY_STATE"])
args = sys.argv[1:]
entry = {{"argv": args}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")

up = state / "up"
if args[:2] == ["serve", "up"]:
    up.write_text(args[3])
elif args[:2] == ["serve", "status"]:
    print("\\x1b[36m\\x1b[1mServices\\x1b[0m")
    if up.exists() and up.read_text() == args[2]:
        name = args[2]
        print("NAME" + " " * (len(name) - 2) + "VERSION  UPTIME  STATUS  REPLICAS  ENDPOINT  ")
        print(name + "  1        1m 5s   \\x1b[32mREADY\\x1b[0m   1/1       1.2.3.4:30001  ")
    else:
        print("No live services.")
elif args[:2] == ["serve", "down"]:
    up.unlink(missing_ok=True)
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
    script.write_text(FAKE_SKY.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_SKY_STATE", str(state))
    return state


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
    driver = SkyServeDriver(SkyRunner())
    assert await driver.get_service_status("haru-demo-alpha") is None
    await driver.launch_service(spec)
    info = await driver.get_service_status("haru-demo-alpha")
    assert info is not None
    assert info.status is ServiceStatus.READY
    assert info.endpoint == "1.2.3.4:30001"
    await driver.teardown_service("haru-demo-alpha")
    assert await driver.get_service_status("haru-demo-alpha") is None

    recorded = calls(fake_sky)
    commands = [c["argv"][:2] for c in recorded]  # type: ignore[index]
    assert commands == [
        ["serve", "status"],
        ["serve", "up"],
        ["serve", "status"],
        ["serve", "down"],
        ["serve", "status"],
    ]
    assert "readiness_probe: /health" in str(recorded[1]["yaml"])
