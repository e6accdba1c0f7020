"""What a trainer writes: each line of its stdout and stderr relayed into the supervisor's log."""

from __future__ import annotations

import asyncio
import logging
from typing import Final

TRAINER_LOGGER: Final = "haru_supervisor.trainer"
"""The logger of what trainers write: one record per line, with ``slot`` and ``stream``."""

_trainer_logger = logging.getLogger(TRAINER_LOGGER)
LINE_LIMIT: Final = 16 * 1024
"""Longest trainer line logged as one record; a longer one is logged in pieces."""
RELAY_DRAIN_S: Final = 1.0
"""After the run ends, how long its output may still be read (a lost descendant may hold the
pipe open: it is then abandoned)."""


async def relay_output(stream: asyncio.StreamReader, *, gpu_index: int, name: str) -> None:
    """Log each line the trainer writes on ``name`` (``stdout``/``stderr``) until EOF.

    In the supervisor's own log stream (JSON lines in JSON mode): the line as ``message``, with
    ``slot`` (the GPU index) and ``stream`` as fields; control characters are escaped by the
    formatter like any message.
    """
    while True:
        try:
            raw = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            raw = exc.partial  # the last line, without a newline
            if not raw:
                return
        except asyncio.LimitOverrunError as exc:
            raw = await stream.read(min(max(exc.consumed, 1), LINE_LIMIT))  # a piece of it
        text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        _trainer_logger.info(
            "GPU %d %s: %s", gpu_index, name, text, extra={"slot": gpu_index, "stream": name}
        )
