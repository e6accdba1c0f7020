"""haru-protocol and haru-core build as wheels that install alone into a clean virtualenv.

This is the promise of DESIGN 2 ("each package builds its own wheel and installs alone with pip
into a clean virtualenv"): it catches a missing runtime dependency, a module left out of the
wheel, package data that is not shipped, or an import of a workspace-only package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKSPACE = Path(__file__).resolve().parents[3]
UV = shutil.which("uv")

PROTOCOL_CHECK = """
import importlib.util, json
import haru_protocol as p
layout = p.load_example_layout()
assert [d.slug for d in layout.domains] == ["alpha", "beta"], layout
assert set(p.render_json_schemas()) == {
    "event.schema.json", "fleet-layout.schema.json", "supervisor-config.schema.json"
}
assert p.join_url("http://h/x", "/v1") == "http://h/x/v1"
assert importlib.util.find_spec("haru_core") is None, "protocol must not pull in core"
print("protocol-ok")
"""

CORE_CHECK = """
import importlib.util, sys
import haru_core as c
from haru_protocol import OperationKind, OperationStep, Policy
assert c.first_step(OperationKind.PROMOTE) is OperationStep.STOP_TRAINING
assert c.step_budget_ms(Policy(), OperationStep.WAKE_VLLM) == 120000
assert c.can_transition("domain", "ready", "degraded")
for absent in ("sqlalchemy", "aiohttp"):
    assert importlib.util.find_spec(absent) is None, absent + " leaked into the venv"
from importlib.metadata import version
assert version("haru-protocol") == version("haru-core") == "0.4.0"
print("core-ok")
"""


def clean_env() -> dict[str, str]:
    """The environment minus anything that would leak the workspace into the fresh venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT"}
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(argv: list[str], *, cwd: Path) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
        f"{done.stderr[-4000:]}"
    )
    return done.stdout


def build_wheel(package: str, out_dir: Path) -> Path:
    assert UV is not None
    run([UV, "build", "--package", package, "--wheel", "--out-dir", str(out_dir)], cwd=WORKSPACE)
    wheels = list(out_dir.glob(f"{package.replace('-', '_')}-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def base_pip() -> list[str] | None:
    """The base interpreter's pip, if it can install into another environment (``--python``)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists():
        return None
    probe = subprocess.run(
        [str(base), "-m", "pip", "install", "--help"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    return [str(base), "-m", "pip"] if "--python" in probe.stdout else None


def fresh_venv(path: Path, pip: list[str] | None) -> tuple[Path, list[str]]:
    """Create a clean venv; return its interpreter and the pip command that installs into it."""
    # Seeding pip into each venv (ensurepip) costs seconds; an outside pip installs just as
    # cleanly, so seed only when there is none.
    run(
        [sys.executable, "-m", "venv", *(["--without-pip"] if pip else []), str(path)],
        cwd=path.parent,
    )
    python = path / "bin" / "python"
    assert python.exists()
    installer = [*pip, "--python", str(python)] if pip else [str(python), "-m", "pip"]
    return python, [*installer, "install", "--quiet"]


@pytest.mark.skipif(UV is None, reason="`uv` is not on PATH: cannot build the wheels")
def test_protocol_and_core_wheels_install_alone(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    protocol_wheel = build_wheel("haru-protocol", dist)
    core_wheel = build_wheel("haru-core", dist)
    pip = base_pip()

    protocol_python, install = fresh_venv(tmp_path / "venv-protocol", pip)
    run([*install, str(protocol_wheel)], cwd=tmp_path)
    # -I: isolated mode, so neither the working directory nor PYTHONPATH can supply a module.
    out = run([str(protocol_python), "-I", "-c", PROTOCOL_CHECK], cwd=tmp_path)
    assert out.strip() == "protocol-ok"

    core_python, install = fresh_venv(tmp_path / "venv-core", pip)
    # haru-protocol comes from the local build (--find-links), never from an index; naming its
    # wheel too pins it even if an index ever published a same-named distribution.
    run([*install, "--find-links", str(dist), str(core_wheel), str(protocol_wheel)], cwd=tmp_path)
    out = run([str(core_python), "-I", "-c", CORE_CHECK], cwd=tmp_path)
    assert out.strip() == "core-ok"
