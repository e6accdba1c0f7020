"""A trainer for the supervisor's tests, run as a real subprocess (stdlib only).

It records its environment in ``$HARU_CHECKPOINT_DIR/env.json``, installs its SIGTERM
disposition, optionally spawns a grandchild that ignores SIGTERM (and, with
``--escaped-grandchild``, leaves the trainer's session with ``setsid()``), then writes its own
pid and the grandchild's to ``ready.json`` (atomically) and waits.

Its SIGTERM handler takes no lock: it writes a byte to a pipe its waits ``select`` on. A
``threading.Event.set()`` in the handler deadlocks when the signal lands while the main thread
holds the event's own lock (entering or leaving a wait); that hung this trainer forever, now
and then, under load.
"""

import argparse
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

GRANDCHILD = (
    "import signal, sys, threading; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1], 'w').close(); threading.Event().wait()"
)

# Leaves the trainer's session and process group first, as a daemonizing helper does.
ESCAPED = "import os; os.setsid(); " + GRANDCHILD


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Stop:
    """Set by the SIGTERM handler without taking any lock; waits return at once once set."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()

    def handler(self, _signum: int, _frame: object) -> None:
        os.write(self._write, b"x")

    def wait(self, timeout_s: float | None) -> bool:
        """Whether SIGTERM came, within ``timeout_s`` (None: wait until it does)."""
        ready, _, _ = select.select([self._read], [], [], timeout_s)
        return bool(ready)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument(
        "--escaped-grandchild",
        action="store_true",
        help="the grandchild calls setsid() (its own session and group) and ignores SIGTERM",
    )
    parser.add_argument("--exit-after-ms", type=int, default=None)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    directory = Path(os.environ["HARU_CHECKPOINT_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / "env.json", json.dumps(dict(os.environ)))
    stop = Stop()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else stop.handler)
    pids = [os.getpid()]
    if args.grandchild or args.escaped_grandchild:
        ready = directory / "grandchild-ready"
        source = ESCAPED if args.escaped_grandchild else GRANDCHILD
        child = subprocess.Popen([sys.executable, "-c", source, str(ready)])
        while not ready.exists():
            stop.wait(0.01)
        pids.append(child.pid)
    write_atomically(directory / "ready.json", json.dumps(pids))
    stop.wait(None if args.exit_after_ms is None else args.exit_after_ms / 1000)
    code: int = args.exit_code
    return code


if __name__ == "__main__":
    sys.exit(main())
