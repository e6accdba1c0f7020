"""Workspace rules no linter checks: licence, lockstep versions, public API, private modules.

Each member is found from the root ``pyproject.toml``'s workspace globs, so a new member is
checked without editing this file.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shutil
import subprocess
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")


@dataclass(frozen=True)
class Member:
    path: Path
    name: str
    version: str
    import_name: str
    dependencies: tuple[str, ...]

    @property
    def src(self) -> Path:
        return self.path / "src" / self.import_name


def _members() -> list[Member]:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found = []
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        for path in sorted(ROOT.glob(pattern)):
            if not (path / "pyproject.toml").is_file():
                continue
            project = tomllib.loads((path / "pyproject.toml").read_text(encoding="utf-8"))
            meta = project["project"]
            optional = [
                dep for deps in meta.get("optional-dependencies", {}).values() for dep in deps
            ]
            found.append(
                Member(
                    path=path,
                    name=meta["name"],
                    version=meta["version"],
                    import_name=meta["name"].replace("-", "_"),
                    dependencies=(*meta.get("dependencies", ()), *optional),
                )
            )
    return found


MEMBERS = _members()
NAMES = {m.name for m in MEMBERS}
IMPORT_NAMES = {m.import_name for m in MEMBERS}


def _ids(members: list[Member]) -> list[str]:
    return [m.name for m in members]


def test_the_workspace_has_every_member() -> None:
    assert {"haru-protocol", "haru-core", "haru-db", "haru-server", "haru-supervisor"} <= NAMES
    for member in MEMBERS:
        assert member.src.is_dir(), f"{member.name}: no src/{member.import_name}"


@pytest.mark.parametrize("member", MEMBERS, ids=_ids(MEMBERS))
def test_every_member_ships_the_licence(member: Member) -> None:
    licence = member.path / "LICENSE"
    assert licence.is_file(), f"{member.name}: no LICENSE (hatchling puts it in the wheel)"
    assert licence.read_bytes() == (ROOT / "LICENSE").read_bytes()


def test_members_are_versioned_in_lockstep() -> None:
    assert len({m.version for m in MEMBERS}) == 1, {m.name: m.version for m in MEMBERS}


@pytest.mark.parametrize("member", MEMBERS, ids=_ids(MEMBERS))
def test_workspace_dependencies_are_pinned_to_the_workspace_version(member: Member) -> None:
    for requirement in member.dependencies:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
        if name in NAMES:
            assert requirement == f"{name}=={member.version}", (
                f"{member.name} depends on {requirement!r}: pin workspace members to "
                f"=={member.version} so a published package never accepts a future sibling"
            )


def _documented(obj: object) -> bool:
    if inspect.isclass(obj):
        return bool(vars(obj).get("__doc__"))
    if inspect.isfunction(obj):
        return bool(obj.__doc__)
    return False


def _public_modules(member: Member) -> list[str]:
    """The package module, and its ``api`` module where the package itself exports nothing."""
    found = [member.import_name]
    if (member.src / "api.py").is_file():
        found.append(f"{member.import_name}.api")
    return found


@pytest.mark.parametrize("member", MEMBERS, ids=_ids(MEMBERS))
def test_every_exported_name_exists_and_is_documented(member: Member) -> None:
    readme = (member.path / "README.md").read_text(encoding="utf-8")
    undocumented = []
    for public in _public_modules(member):
        module = importlib.import_module(public)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{public} has no __all__"
        assert len(set(exported)) == len(exported), f"duplicate names in {public}.__all__"
        for name in exported:
            assert hasattr(module, name), f"{public}.__all__ names missing {name!r}"
            obj = getattr(module, name)
            # Classes and functions carry their own docstring; constants and type aliases
            # cannot, so the package README must name them.
            if not _documented(obj) and name not in readme:
                undocumented.append(f"{public}.{name}")
    assert not undocumented, f"{member.name}: undocumented exports {undocumented}"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def test_no_member_imports_another_members_private_modules() -> None:
    offences = []
    for member in MEMBERS:
        for path in sorted(member.src.rglob("*.py")):
            for line, module in _imported_modules(path):
                parts = module.split(".")
                if parts[0] not in IMPORT_NAMES or parts[0] == member.import_name:
                    continue
                if any(part.startswith("_") and not part.startswith("__") for part in parts[1:]):
                    offences.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offences, "\n".join(offences)


@pytest.mark.slow
@pytest.mark.skipif(UV is None, reason="`uv` is not on PATH: cannot build the distributions")
def test_every_wheel_and_sdist_carries_the_licence(tmp_path: Path) -> None:
    assert UV is not None
    subprocess.run(
        [UV, "build", "--all-packages", "--out-dir", str(tmp_path), "--quiet"],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    for member in MEMBERS:
        stem = f"{member.import_name}-{member.version}"
        wheel = tmp_path / f"{stem}-py3-none-any.whl"
        with zipfile.ZipFile(wheel) as archive:
            assert f"{stem}.dist-info/licenses/LICENSE" in archive.namelist(), member.name
        with tarfile.open(tmp_path / f"{stem}.tar.gz") as archive:
            assert f"{stem}/LICENSE" in archive.getnames(), member.name
