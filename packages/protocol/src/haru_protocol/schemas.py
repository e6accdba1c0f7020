"""Regenerate the committed JSON Schemas: ``uv run python -m haru_protocol.schemas [DIR]``.

Without ``DIR`` the files go to ``packages/protocol/schemas`` of the source checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from haru_protocol._resources import render_json_schemas

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "schemas"


def write_schemas(directory: Path) -> list[Path]:
    """Write every schema file into ``directory``; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_json_schemas().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = sys.argv[1:] if argv is None else argv
    directory = Path(args[0]) if args else DEFAULT_DIR
    for path in write_schemas(directory):
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
