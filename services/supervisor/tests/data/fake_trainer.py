"""A trainer for the supervisor's tests, run as a real subprocess (stdlib only).

It records its environment in ``$HARU_CHECKPOINT_DIR/env.json``, installs its SIGTERM
disposition, optionally spawns a grandchild that ignores SIGTERM (and, with
``--escaped-grandchild``, leaves the trainer's session with ``setsid()``), then writes its own
pid and the grandchild's to ``ready.json`` (atomically) and waits.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
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
    stop = threading.Event()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
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
