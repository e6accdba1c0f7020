"""The README's "Running Haru for real" commands work copy-paste in a fresh clone.

A clone has no ``haru`` on ``PATH`` until its environment is activated; ``uv run haru ...``
works at once, so every command of that section is written that way. Its ``sh`` blocks are run
as written, in an empty directory, except what needs what this machine lacks (GPU hosts,
certificate files): :data:`CANNOT_RUN` names each and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("haru", "haru-supervisor", "haru-server")
# A console script in command position: at the start of a code span, or after a VAR=value
# prefix (``HARU_API_TOKEN=... haru serve``).
_COMMAND = re.compile(r"(?:^|=\S*\s+)(" + "|".join(map(re.escape, SCRIPTS)) + r")(?=\s|$)")


# A fenced block, indented or not (those inside a numbered step are indented).
_FENCE = re.compile(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```", flags=re.MULTILINE | re.DOTALL)


def _blocks(section: str) -> list[tuple[str, str]]:
    """Every fenced block of ``section``: its info string (``sh``) and its text."""
    return [(match[1].strip(), match[2]) for match in _FENCE.finditer(section)]


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def test_running_haru_for_real_uses_uv_run() -> None:
    section = _section((ROOT / "README.md").read_text(encoding="utf-8"), "Running Haru for real")
    # Fenced blocks first (their triple backticks would pair the inline spans wrongly): every
    # line of them that runs a script runs it through `uv run` too.
    fenced = [body for _, body in _blocks(section)]
    assert fenced, "the section shows no command block"
    for line in (line for block in fenced for line in block.splitlines()):
        for match in _COMMAND.finditer(line.split("#", 1)[0]):
            assert line[: match.start(1)].endswith("uv run "), line
    inline = _FENCE.sub("", section)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", inline)]
    commands = [span for span in spans if _COMMAND.search(span)]
    assert commands, "the section names no command"
    bare = [
        span
        for span in commands
        for match in _COMMAND.finditer(span)
        if not span[: match.start(1)].endswith("uv run ")
    ]
    # After `source .venv/bin/activate` the scripts are on PATH: completion is installed there.
    assert bare == ["haru --install-completion"], bare
    assert "uv run haru seed --print-example > layout.json" in spans


CANNOT_RUN: dict[str, str] = {
    "/etc/haru/": "needs certificate files under /etc/haru and supervisors on GPU hosts",
    "uv run haru promote ": "needs the example's supervisors and vLLM servers (step 1, GPUs)",
}
"""A block naming the first key, or a line naming another, is not run: the reason is printed."""

_BLOCK_ONLY: frozenset[str] = frozenset({"/etc/haru/"})


def _runnable(section: str) -> tuple[list[str], list[str]]:
    """The section's ``sh`` lines that run here, and what was skipped with its reason."""
    lines: list[str] = []
    skipped: list[str] = []
    for info, body in _blocks(section):
        if info != "sh":
            continue
        blocked = [why for marker, why in CANNOT_RUN.items() if marker in body]
        if any(marker in body for marker in _BLOCK_ONLY):
            skipped.append(f"block {body.strip().splitlines()[0]!r}: {blocked[0]}")
            continue
        for line in body.splitlines():
            reasons = [why for marker, why in CANNOT_RUN.items() if marker in line]
            if reasons:
                skipped.append(f"line {line.strip()!r}: {reasons[0]}")
            elif line.strip():
                lines.append(line.strip())
    return lines, skipped


BASH = shutil.which("bash") or "/bin/bash"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("openssl")),
    reason="the README's first-run block uses curl and openssl, missing here",
)
def test_running_haru_for_real_runs_copy_paste(tmp_path: Path) -> None:
    section = _section((ROOT / "README.md").read_text(encoding="utf-8"), "Running Haru for real")
    lines, skipped = _runnable(section)
    for what in skipped:
        print(f"skipped {what}")
    assert "HARU_DEFAULT_FLEET=example uv run haru serve &    # or in a terminal of its own" in (
        lines
    )
    assert "uv run haru fleet show example" in lines
    assert len(skipped) == 2, skipped
    # A clean environment but for the port (8700 may be taken here) and where `uv run` finds
    # the project: the directory is empty, as a user's working directory would be.
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARU_", "VIRTUAL_ENV"))}
    env.pop("DATABASE_URL", None)
    env.update(
        UV_PROJECT=str(ROOT), UV_NO_SYNC="1", PORT=str(port), HARU_URL=f"http://127.0.0.1:{port}"
    )
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    log = tmp_path.parent / f"{tmp_path.name}.log"  # a file: the server keeps its output open
    with log.open("w") as out:
        process = subprocess.Popen(
            [BASH, "-c", script],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the background server is in its group: stopped below
        )
        try:
            process.wait(timeout=100)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    output = log.read_text()
    assert process.returncode == 0, output
    assert json.loads((tmp_path / "layout.json").read_text())["slug"] == "example"
    assert (tmp_path / "haru.db").is_file()
    # `haru fleet show` answered from the server with the seeded fleet.
    assert "fleet example (Example two-domain fleet)" in output, output
    assert re.search(r"active domain alpha\s+route revision", output), output
