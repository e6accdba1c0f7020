"""The haru-server wheel is only the server: no demo, no test harness, no ``demo`` extra."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKSPACE = Path(__file__).resolve().parents[3]
UV = shutil.which("uv")


@pytest.mark.skipif(UV is None, reason="`uv` is not on PATH: cannot build the wheel")
def test_the_server_wheel_ships_no_demo_code(tmp_path: Path) -> None:
    assert UV is not None
    done = subprocess.run(
        [UV, "build", "--package", "haru-server", "--wheel", "--out-dir", str(tmp_path)],
        cwd=WORKSPACE,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (wheel,) = tmp_path.glob("haru_server-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(
            archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA")
        )
    modules = [n for n in names if n.startswith("haru_server/")]
    assert "haru_server/cli/__init__.py" in modules
    assert not [n for n in modules if "demo" in n or "localfleet" in n], modules
    assert not [n for n in names if not n.startswith(("haru_server/", "haru_server-"))], names
    assert "Provides-Extra" not in metadata
    for dependency in ("haru-sim", "haru-demo", "openai"):
        assert f"Requires-Dist: {dependency}" not in metadata
