"""The README's "Running Haru for real" commands work copy-paste in a fresh clone.

A clone has no ``haru`` on ``PATH`` until its environment is activated; ``uv run haru ...``
works at once, so every command of that section is written that way.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("haru", "haru-supervisor", "haru-server")
# A console script in command position: at the start of a code span, or after a VAR=value
# prefix (``HARU_API_TOKEN=... haru serve``).
_COMMAND = re.compile(r"(?:^|=\S*\s+)(" + "|".join(map(re.escape, SCRIPTS)) + r")(?=\s|$)")


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def test_running_haru_for_real_uses_uv_run() -> None:
    section = _section((ROOT / "README.md").read_text(encoding="utf-8"), "Running Haru for real")
    # Fenced blocks first (their triple backticks would pair the inline spans wrongly): every
    # line of them that runs a script runs it through `uv run` too.
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    assert fenced, "the section shows no command block"
    for line in (line for block in fenced for line in block.splitlines()):
        for match in _COMMAND.finditer(line.split("#", 1)[0]):
            assert line[: match.start(1)].endswith("uv run "), line
    inline = re.sub(r"^```[^\n]*\n.*?^```", "", section, flags=re.MULTILINE | re.DOTALL)
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
