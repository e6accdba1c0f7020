"""A provisioned domain's task: the supervisor config, ``run`` (really run), and its secrets."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from haru_driver_skypilot import (
    SERVING_TOKEN_SECRET,
    TLS_CERT_SECRET,
    TLS_KEY_SECRET,
    TOKEN_SECRET,
    SkyPilotDriver,
    SkyRunner,
    domain_task,
    example_domain_layout,
    example_domain_task,
    model_ports,
    render_task_yaml,
    serving_path,
    supervisor_config,
)
from haru_protocol import SupervisorConfig

FAKE_SKY = """\
#!{python}
import json, os, pathlib, sys
state = pathlib.Path({state!r})  # baked in: `sky` gets no test variables
args = sys.argv[1:]
entry = {{"argv": args, "token": os.environ.get("HARU_SUPERVISOR_TOKEN")}}
for arg in args:
    if arg.endswith(".yaml") and os.path.isfile(arg):
        entry["yaml"] = pathlib.Path(arg).read_text()
with (state / "calls.jsonl").open("a") as log:
    log.write(json.dumps(entry) + "\\n")
if args[:1] == ["launch"]:
    (state / "up").write_text(args[2])
elif args[:2] == ["status", "--ip"]:
    up = state / "up"
    if up.exists() and up.read_text() == args[2]:
        print("\\x1b[0m10.1.2.3")
    else:
        print(f"Cluster(s) not found: {{args[2]}}.")
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
    monkeypatch.delenv(TOKEN_SECRET, raising=False)
    return state


def test_supervisor_config_matches_the_slots() -> None:
    task = example_domain_task(start_asleep=False)
    assert task.ports == (8701, 8000)
    config = yaml.safe_load(render_task_yaml(task))
    run = config["run"]
    start = run.index("<<'HARU_CONFIG_EOF'\n") + len("<<'HARU_CONFIG_EOF'\n")
    embedded = SupervisorConfig.model_validate_json(run[start : run.index("\nHARU_CONFIG_EOF")])
    assert [(s.kind.value, s.gpu_index) for s in embedded.slots] == [
        ("inference", 0),
        ("inference", 1),
        ("training", 0),
        ("training", 1),
    ]
    ports = {m.name: m.port for s in embedded.inference_slots for m in s.models}
    assert ports == {
        "example-chat-small": 8100,
        "example-chat-medium": 8101,
        "example-chat-large": 8102,
    }
    assert embedded.training_slots[0].command == ("python", "train.py", "--lora")


def test_the_script_never_puts_a_server_to_sleep_behind_the_supervisors_back() -> None:
    # A late sleep from the script raced a promotion that had woken the domain (CI, the
    # SkyPilot end-to-end test): only the supervisor, driven by the reconciler, sleeps vLLM.
    asleep = example_domain_task(start_asleep=True).run
    awake = example_domain_task(start_asleep=False).run
    assert asleep == awake
    assert "sleep-when-ready" not in asleep
    assert "/sleep" not in asleep
    for run in (asleep, awake):
        assert "export VLLM_SERVER_DEV_MODE=1" in run
        assert run.rstrip().endswith('exec "$SUPERVISOR"')


def test_the_token_is_a_secret_never_a_value() -> None:
    task = example_domain_task(start_asleep=True)
    config = yaml.safe_load(render_task_yaml(task))
    assert config["secrets"] == {
        TOKEN_SECRET: None,
        SERVING_TOKEN_SECRET: None,
        TLS_CERT_SECRET: None,
        TLS_KEY_SECRET: None,
    }
    assert TOKEN_SECRET not in config["envs"]
    assert SERVING_TOKEN_SECRET not in config["envs"]


def test_a_serving_credential_hook_declares_further_secrets() -> None:
    layout = example_domain_layout()
    task = domain_task(
        "haru-f--d",
        layout.placement,
        layout.slots,
        layout.settings,
        start_asleep=False,
        extra_secrets=("HARU_SERVING_KEY",),
    )
    assert task.secrets[-1] == "HARU_SERVING_KEY"


BASH = shutil.which("bash") or "/bin/bash"


def _tls_prefix(run: str) -> str:
    """The run script up to the line that drops the TLS secrets from the environment."""
    lines = run.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("unset HARU_NODE_TLS"))
    return "\n".join(lines[: end + 1])


def test_the_run_script_writes_the_tls_secrets_to_private_files(tmp_path: Path) -> None:
    run = example_domain_task(start_asleep=False).run
    cert, key = "-----BEGIN CERTIFICATE-----\nabc\n", "-----BEGIN PRIVATE KEY-----\nxyz\n"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        SERVING_TOKEN_SECRET: "serving-credential-value",
        TLS_CERT_SECRET: base64.b64encode(cert.encode()).decode(),
        TLS_KEY_SECRET: base64.b64encode(key.encode()).decode(),
    }
    # What the script's later children inherit: the secrets must be gone by then.
    script = _tls_prefix(run) + '\nenv > "$HARU_DIR/child-env"\n'
    subprocess.run([BASH, "-c", script], env=env, check=True, timeout=30)
    tls = tmp_path / ".haru" / "tls"
    assert (tls / "node.crt").read_text() == cert
    assert (tls / "node.key").read_text() == key
    assert stat.S_IMODE((tls / "node.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tls / "node.crt").stat().st_mode) == 0o600
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700
    inherited = (tmp_path / ".haru" / "child-env").read_text()
    assert "HARU_NODE_TLS" not in inherited
    assert "xyz" not in inherited
    # The supervisor and the gateway both serve HTTPS with them.
    assert run.count('HARU_TLS_CERT_FILE="$HOME/.haru/tls/node.crt"') == 2
    assert "HARU_TLS_CERT_FILE" in next(line for line in run.splitlines() if "$GATEWAY" in line)


def test_the_run_script_refuses_to_start_without_the_tls_secrets(tmp_path: Path) -> None:
    run = example_domain_task(start_asleep=False).run
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        SERVING_TOKEN_SECRET: "serving-credential-value",
    }
    done = subprocess.run(
        [BASH, "-c", _tls_prefix(run)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode != 0
    assert "TLS secrets of the domain are missing" in done.stderr


async def test_launch_passes_the_token_through_the_environment(fake_sky: Path) -> None:
    driver = SkyPilotDriver(SkyRunner())
    task = example_domain_task(start_asleep=True)
    token = "a-secret-token-of-sufficient-length"
    await driver.launch_domain(
        task,
        secrets={
            TOKEN_SECRET: token,
            SERVING_TOKEN_SECRET: "serving-credential-value",
            TLS_CERT_SECRET: "Y2VydA==",
            TLS_KEY_SECRET: "a2V5",
        },
    )
    assert await driver.get_head_ip(task.name) == "10.1.2.3"
    assert await driver.get_head_ip("haru-other") is None
    launch, *_ = [json.loads(line) for line in (fake_sky / "calls.jsonl").read_text().splitlines()]
    assert launch["argv"][:9] == [
        "launch",
        "-c",
        task.name,
        "-y",
        "-d",
        "--secret",
        TOKEN_SECRET,
        "--secret",
        SERVING_TOKEN_SECRET,
    ]
    assert launch["token"] == token
    assert token not in launch["yaml"]
    assert token not in " ".join(launch["argv"])


async def test_launch_without_the_secret_value_is_refused(fake_sky: Path) -> None:
    from haru_driver_skypilot import InvalidSpecError

    with pytest.raises(InvalidSpecError, match="HARU_SUPERVISOR_TOKEN"):
        await SkyPilotDriver(SkyRunner()).launch_domain(example_domain_task(start_asleep=True))
    assert not (fake_sky / "calls.jsonl").exists()


# ---- the run script, really run, with every name the layout accepts ----

RECORDER = """\
#!/bin/sh
printf '%s\\n' "$0" "$@" > "$RECORD_DIR/.$$"
mv "$RECORD_DIR/.$$" "$RECORD_DIR/$(basename "$0").$$"
"""


def _odd_names_layout() -> tuple[Any, ...]:
    domain = example_domain_layout()
    document = domain.model_dump(mode="json", by_alias=True, exclude_none=True)
    names = iter(["qwen/qwen3-8b", "café au lait 7b", "../../etc/x"])
    for slot in document["slots"]:
        for model in slot.get("models", []):
            model["name"] = next(names)
    odd = type(domain).model_validate(document)
    return odd.placement, odd.slots, odd.settings


def _run(tmp_path: Path, run: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    record = tmp_path / "record"
    record.mkdir(exist_ok=True)
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name in ("vllm", "haru-gateway", "haru-supervisor"):
        tool = tools / name
        tool.write_text(RECORDER)
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    environ = {
        "PATH": f"{tools}{os.pathsep}/usr/bin:/bin",
        "HOME": str(tmp_path),
        "RECORD_DIR": str(record),
        **env,
    }
    return subprocess.run(
        ["bash", "-c", run + "\nwait"],  # noqa: S607 -- bash from the PATH above
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _recorded(tmp_path: Path, tool: str, count: int = 1) -> list[list[str]]:
    # The script execs the supervisor last: its background starts may still be running.
    deadline = time.monotonic() + 30
    while len(calls := sorted((tmp_path / "record").glob(f"{tool}.*"))) < count:
        assert time.monotonic() < deadline, f"{tool} started {len(calls)} times, not {count}"
        await asyncio.sleep(0.01)
    return [c.read_text().splitlines()[1:] for c in calls]


async def test_the_run_script_starts_every_model_whatever_its_name(tmp_path: Path) -> None:
    placement, slots, settings = _odd_names_layout()
    task = domain_task("haru-demo-odd", placement, slots, settings, start_asleep=False)
    env = {
        TOKEN_SECRET: "supervisor-secret",
        SERVING_TOKEN_SECRET: "serving-secret",
        TLS_CERT_SECRET: base64.b64encode(b"cert").decode(),
        TLS_KEY_SECRET: base64.b64encode(b"key").decode(),
    }
    done = _run(tmp_path, task.run, env)
    assert done.returncode == 0, done.stderr
    served = sorted(
        argv[argv.index("--served-model-name") + 1] for argv in await _recorded(tmp_path, "vllm", 3)
    )
    assert served == sorted(["qwen/qwen3-8b", "café au lait 7b", "../../etc/x"])
    # Logs are named by index, never by the model's name.
    assert sorted(p.name for p in (tmp_path / ".haru").glob("vllm-*.log")) == [
        "vllm-0.log",
        "vllm-1.log",
        "vllm-2.log",
    ]
    assert not (tmp_path / "etc").exists()
    (gateway,) = await _recorded(tmp_path, "haru-gateway")
    routes = [gateway[i + 1] for i, arg in enumerate(gateway) if arg == "--route"]
    assert routes == ["qwen/qwen3-8b=8100", "café au lait 7b=8101", "../../etc/x=8102"]
    assert gateway[gateway.index("--token-env") + 1] == SERVING_TOKEN_SECRET
    assert "serving-secret" not in " ".join(gateway)


def test_the_run_script_starts_nothing_without_the_serving_credential(tmp_path: Path) -> None:
    task = example_domain_task(start_asleep=False)
    done = _run(tmp_path, task.run, {TOKEN_SECRET: "supervisor-secret"})
    assert done.returncode != 0
    assert SERVING_TOKEN_SECRET in done.stderr
    assert not list((tmp_path / "record").iterdir())


def test_serving_paths_encode_every_name_as_one_segment() -> None:
    assert serving_path("example-chat-small") == "/m/example-chat-small"
    assert serving_path("qwen/qwen3-8b") == "/m/qwen%2Fqwen3-8b"
    assert serving_path("café au lait") == "/m/caf%C3%A9%20au%20lait"


def test_model_ports_count_up_in_layout_order() -> None:
    domain = example_domain_layout()
    ports = model_ports(domain.slots, domain.settings)
    assert [(p.name, p.gpu_index, p.port) for p in ports] == [
        ("example-chat-small", 0, 8100),
        ("example-chat-medium", 0, 8101),
        ("example-chat-large", 1, 8102),
    ]
    config = supervisor_config(domain.slots, domain.settings)
    assert [m.port for s in config.inference_slots for m in s.models] == [8100, 8101, 8102]


def test_setup_installs_the_pinned_packages_unless_the_image_has_them() -> None:
    domain = example_domain_layout()
    task = example_domain_task(start_asleep=False)
    assert task.setup is not None
    assert "pip install --upgrade vllm==0.33.0 haru-supervisor==0.2.0" in task.setup
    assert "setup" in yaml.safe_load(render_task_yaml(task))
    document = domain.model_dump(mode="json", by_alias=True, exclude_none=True)
    document["provisioning"]["install"] = False
    image = type(domain).model_validate(document)
    prebuilt = domain_task(
        "haru-demo-beta", image.placement, image.slots, image.settings, start_asleep=False
    )
    assert prebuilt.setup is None
    assert "setup" not in yaml.safe_load(render_task_yaml(prebuilt))
    assert prebuilt.run == task.run
