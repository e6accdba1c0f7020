"""``haru-sim-trainer``: an emulated preemptible LoRA training job (stdlib only).

Contract with the supervisor (DESIGN 6.5): started with ``HARU_CHECKPOINT_DIR`` and
``HARU_GPU_INDEX`` in its environment, in its own process group; stopped with SIGTERM to
the group, then SIGKILL after a grace. It resumes from the checkpoint in
``HARU_CHECKPOINT_DIR``, "trains" one step every ``--step-ms``, checkpoints every
``--checkpoint-every`` steps, and on SIGTERM flushes a checkpoint and exits 0.

This runs as a plain blocking process, not inside an event loop: its waits `select` on a
pipe the signal handler writes to, so a signal ends a wait at once without burning CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Final

PROGRAM: Final = "haru-sim-trainer"
CHECKPOINT_FILE: Final = "checkpoint.json"
"""Name of the checkpoint file inside ``HARU_CHECKPOINT_DIR``."""

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

# The grandchild of --spawn-child: sleeps until its process group is killed.
_CHILD_CODE: Final = "import threading; threading.Event().wait()"


@dataclass(frozen=True, kw_only=True)
class TrainerCheckpoint:
    """What the emulated trainer saved last.

    Attributes:
        step: Steps completed in total, across every run that resumed from this directory.
        gpu_index: ``HARU_GPU_INDEX`` of the run that wrote it (None when unset).
        saved_at: When it was written (aware, UTC).
    """

    step: int
    gpu_index: int | None
    saved_at: datetime


def read_trainer_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> TrainerCheckpoint | None:
    """Read the emulated trainer's checkpoint in ``checkpoint_dir``.

    Returns:
        The checkpoint, or None when there is none yet or it is unreadable.
    """
    path = Path(checkpoint_dir) / CHECKPOINT_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    step, gpu, saved = data.get("step"), data.get("gpuIndex"), data.get("savedAt")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool)):
        return None
    try:
        saved_at = datetime.fromisoformat(saved) if isinstance(saved, str) else None
    except ValueError:
        saved_at = None
    if saved_at is None or saved_at.tzinfo is None:
        return None
    return TrainerCheckpoint(step=step, gpu_index=gpu, saved_at=saved_at)


def _write_checkpoint(checkpoint_dir: Path, step: int, gpu_index: int | None) -> None:
    """Write atomically: a reader (or a crash) never sees a half-written file."""
    body = json.dumps(
        {"step": step, "gpuIndex": gpu_index, "savedAt": datetime.now(UTC).isoformat()}
    )
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=checkpoint_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, checkpoint_dir / CHECKPOINT_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _say(line: str) -> None:
    sys.stdout.write(f"{PROGRAM} {line}\n")
    sys.stdout.flush()


def _fail(message: str, status: int) -> int:
    sys.stderr.write(f"{PROGRAM}: {message}\n")
    sys.stderr.flush()
    return status


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description=(
            "An emulated preemptible training job. Needs HARU_CHECKPOINT_DIR; reads HARU_GPU_INDEX."
        ),
    )
    parser.add_argument("--step-ms", type=_non_negative_int, default=50, help="time per step")
    parser.add_argument(
        "--checkpoint-every", type=_positive_int, default=10, help="checkpoint every N steps"
    )
    parser.add_argument(
        "--term-delay-ms",
        type=_non_negative_int,
        default=0,
        help="on SIGTERM, wait this long before the final checkpoint (a slow flush)",
    )
    parser.add_argument(
        "--ignore-sigterm", action="store_true", help="ignore SIGTERM (only SIGKILL stops it)"
    )
    parser.add_argument(
        "--spawn-child",
        action="store_true",
        help="start a sleeping grandchild process in the same process group",
    )
    parser.add_argument(
        "--max-steps",
        type=_non_negative_int,
        default=None,
        help="exit 0 once the TOTAL step count (resumed included) reaches N",
    )
    parser.add_argument(
        "--fail-after-steps",
        type=_positive_int,
        default=None,
        help="exit 1 after N steps of THIS run, without a final checkpoint (a crash)",
    )
    return parser


class _Stop:
    """Set from a signal handler; the main loop's waits return at once.

    The handler only records the signal and writes a byte to a pipe the waits ``select`` on.
    It must take no lock: a ``threading.Event.set()`` in a handler deadlocks when the signal
    lands while the main thread holds the event's own lock (entering or leaving a wait), and
    such a trainer then only dies by SIGKILL.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.signal_name: str | None = None

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, b"\0")

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s``; True once a stop signal arrived."""
        if self.signal_name is not None:
            return True
        ready, _, _ = select.select([self._read], [], [], timeout_s)
        return bool(ready) or self.signal_name is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the emulated trainer; returns the exit status."""
    args = _parser().parse_args(argv)
    stop = _Stop()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else stop.handler)
    signal.signal(signal.SIGINT, stop.handler)
    raw_dir = os.environ.get("HARU_CHECKPOINT_DIR", "").strip()
    if not raw_dir:
        return _fail(
            "HARU_CHECKPOINT_DIR is not set; it names the checkpoint directory", EXIT_USAGE
        )
    raw_gpu = os.environ.get("HARU_GPU_INDEX", "").strip()
    gpu_index: int | None = None
    if raw_gpu:
        if not raw_gpu.isdigit():
            return _fail(f"HARU_GPU_INDEX must be an integer >= 0, got {raw_gpu!r}", EXIT_USAGE)
        gpu_index = int(raw_gpu)
    checkpoint_dir = Path(raw_dir)
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"cannot create HARU_CHECKPOINT_DIR {raw_dir!r}: {exc}", EXIT_FAILED)

    resumed = read_trainer_checkpoint(checkpoint_dir)
    if resumed is None and (checkpoint_dir / CHECKPOINT_FILE).exists():
        sys.stderr.write(
            f"{PROGRAM}: ignoring an unreadable {CHECKPOINT_FILE}; starting at step 0\n"
        )
    step = resumed.step if resumed is not None else 0
    child: subprocess.Popen[bytes] | None = None
    if args.spawn_child:
        # No inherited pipes: a parent reading our stdout must see EOF when we exit.
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_CODE],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    _say(
        f"started pid={os.getpid()} resumed_step={step} "
        f"gpu={'unset' if gpu_index is None else gpu_index} "
        f"child_pid={child.pid if child is not None else 'none'}"
    )
    try:
        return _train(args, stop, checkpoint_dir, gpu_index, step)
    finally:
        if child is not None:
            child.terminate()
            child.wait()


def _train(
    args: argparse.Namespace,
    stop: _Stop,
    checkpoint_dir: Path,
    gpu_index: int | None,
    step: int,
) -> int:
    steps_this_run = 0
    saved = step
    step_s = args.step_ms / 1000
    while True:
        if args.max_steps is not None and step >= args.max_steps:
            if saved != step:
                _write_checkpoint(checkpoint_dir, step, gpu_index)
            _say(f"finished step={step}")
            return EXIT_OK
        if stop.wait(step_s):
            break
        step += 1
        steps_this_run += 1
        if args.fail_after_steps is not None and steps_this_run >= args.fail_after_steps:
            return _fail(f"simulated crash at step={step}", EXIT_FAILED)
        if step % args.checkpoint_every == 0:
            _write_checkpoint(checkpoint_dir, step, gpu_index)
            saved = step
            _say(f"checkpoint step={step}")
    # Preempted: a slow flush, then the final checkpoint. The wait is deliberate and cannot
    # be cut short by a second SIGTERM; only SIGKILL ends it early.
    if args.term_delay_ms:
        threading.Event().wait(args.term_delay_ms / 1000)
    _write_checkpoint(checkpoint_dir, step, gpu_index)
    _say(f"stopped signal={stop.signal_name} step={step}")
    return EXIT_OK
