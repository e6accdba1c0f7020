"""The haru-protocol wheel carries the committed JSON Schemas as package data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300)]

PROTOCOL = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")

READ_SCHEMAS = """
import json, sys
from importlib import resources
import haru_protocol
assert haru_protocol.__file__.startswith(sys.argv[1]), haru_protocol.__file__
folder = resources.files("haru_protocol") / "json-schemas"
print(json.dumps({item.name: json.loads(item.read_text("utf-8")) for item in folder.iterdir()}))
"""


@pytest.mark.skipif(UV is None, reason="needs uv")
def test_the_wheel_ships_every_committed_schema(tmp_path: Path) -> None:
    assert UV is not None
    subprocess.run(
        [UV, "build", "--wheel", str(PROTOCOL), "-o", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = tmp_path.glob("haru_protocol-*.whl")
    committed = {path.name: path for path in (PROTOCOL / "schemas").glob("*.json")}
    assert committed  # the fleet layout, the supervisor config and the event
    with zipfile.ZipFile(wheel) as archive:
        shipped = {
            name.rsplit("/", 1)[1]: archive.read(name)
            for name in archive.namelist()
            if name.startswith("haru_protocol/json-schemas/")
        }
    assert shipped == {name: path.read_bytes() for name, path in committed.items()}
    # Read back with importlib.resources from the wheel itself (zip import; pydantic from here).
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(wheel)!r})\n" + READ_SCHEMAS,
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        name: json.loads(path.read_text(encoding="utf-8")) for name, path in committed.items()
    }
