"""What ``haru-gateway`` imports at start: its own modules, never the supervisor's server side."""

from __future__ import annotations

import subprocess
import sys

GATEWAY_MODULES = {"haru_supervisor", "haru_supervisor._gateway", "haru_supervisor._gateway_app"}
# Distributions the supervisor needs and the gateway does not (trainers, fencing, GPU readers).
SUPERVISOR_ONLY = {"haru_exec", "psutil", "cachetools", "packaging", "pynvml"}


def imported_by_gateway(argv: list[str]) -> set[str]:
    """Modules a fresh interpreter holds after running ``haru-gateway ARGV``."""
    probe = (
        "import contextlib, io, sys\n"
        "from haru_supervisor._gateway import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(done.stdout.split())


def test_the_gateway_starts_without_the_supervisors_app_settings_or_trainers() -> None:
    modules = imported_by_gateway(["--help"])
    assert {m for m in modules if m.startswith("haru_supervisor")} == GATEWAY_MODULES
    assert not {m.split(".")[0] for m in modules} & SUPERVISOR_ONLY
