"""Regenerate the committed JSON Schemas: ``uv run python -m haru_protocol.schemas [DIR]``.

Without ``DIR`` the files go to ``packages/protocol/schemas`` of the source checkout.
"""

from __future__ import annotations

import argparse
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m haru_protocol.schemas",
        description="Write the JSON Schemas of Haru's operator documents into a folder.",
    )
    parser.add_argument(
        "directory",
        nargs="?",
        type=Path,
        default=DEFAULT_DIR,
        help="target folder (default: packages/protocol/schemas of the source checkout)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; ``--help`` prints usage and writes nothing."""
    args = _parser().parse_args(argv)
    for path in write_schemas(args.directory):
        print(f"wrote {path}")  # noqa: T201 -- a command-line tool's output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
