"""Child processes of a benchmark: start each until it prints its ready line, stop them all.

Shared by ``streams.py`` and ``proxy_overhead.py``; a script imports it as ``procs`` (the
script's folder is first on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0


class Processes:
    """Children started by the benchmark; all are terminated on exit."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[Any]] = []

    def start(
        self,
        argv: list[str],
        *,
        ready: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> tuple[str, int]:
        """Start ``argv``; return its first stdout line containing ``ready``, and its pid.

        ``env`` is added to this process's environment; ``log`` (appended to) takes its
        stderr, which is discarded otherwise.
        """
        stderr = subprocess.DEVNULL if log is None else log.open("ab")
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.children.append(child)
        deadline = time.monotonic() + START_TIMEOUT_S
        assert child.stdout is not None
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if ready in line:
                return line.strip(), child.pid
        raise RuntimeError(f"{argv[:3]} did not become ready (exit code {child.poll()})")

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                child.terminate()
        for child in reversed(self.children):
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    """A :class:`Processes` whose children are stopped on exit, however it is left."""
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
