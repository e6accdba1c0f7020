"""The schema gate: a server whose store a newer release migrated stops reconciling.

During a rolling upgrade the new release migrates the shared store while old servers still
run. An old server then answers 503 on ``/readyz`` (its load balancer stops sending it traffic),
and it must not act either: its reconcile ticks would write rows in the shape of a schema that
is gone. Each tick (the loop's and ``POST /reconcile``'s) therefore checks, at most every
:data:`SCHEMA_CHECK_S`, that the store carries no revision this code does not know; while it
does, the tick is refused (:class:`SchemaNewerError`) before it reads or writes anything. A
store moved back to a known revision (``haru db downgrade``) is reconciled again.

The API's writes (promote, demote, policy, apply, domain up and down) pass the same gate
(:func:`check_writes`): a client that reaches an old server directly, not through the load
balancer, gets 503 ``not_ready`` instead of a write in the old shape.

An outdated schema (the store not migrated yet: the new release's server before its
migration) is not refused here: it fails its own boot and readiness checks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from haru_db import HaruDbError, SchemaTooNewError, check_schema
from haru_protocol import ErrorCode
from haru_web import ApiError

from haru_server._errors import SchemaNewerError

logger = logging.getLogger(__name__)

SCHEMA_CHECK_S: Final = 5.0
"""How often a reconciling process re-reads the store's schema revision (a new connection)."""


class SchemaGate:
    """Refuses reconcile ticks while the store's schema is newer than this code's.

    Args:
        url: The store's database URL (the check opens a connection of its own).
        interval_s: Seconds between two reads of the revision.
        monotonic: Monotonic seconds (injected by tests).
        check: The check itself (``haru_db.check_schema``; injected by tests).
    """

    def __init__(
        self,
        url: str,
        *,
        interval_s: float = SCHEMA_CHECK_S,
        monotonic: Callable[[], float] = time.monotonic,
        check: Callable[[str], Awaitable[None]] = check_schema,
    ) -> None:
        self._url = url
        self._interval_s = interval_s
        self._monotonic = monotonic
        self._check = check
        self._checked_at: float | None = None
        self._refusal: str | None = None

    @property
    def refusal(self) -> str | None:
        """Why ticks are refused now (None: they are not)."""
        return self._refusal

    async def check(self) -> None:
        """Return when a tick may run.

        Raises:
            SchemaNewerError: A newer release migrated the store.
        """
        now = self._monotonic()
        if self._checked_at is None or now - self._checked_at >= self._interval_s:
            self._checked_at = now
            await self._read()
        if self._refusal is not None:
            raise SchemaNewerError(self._refusal)

    async def _read(self) -> None:
        newer: SchemaTooNewError | None = None
        try:
            await self._check(self._url)
        except SchemaTooNewError as exc:
            newer = exc
        except HaruDbError:
            # Not migrated yet, or unreachable: the tick's own reads report it.
            return
        self.saw(newer)

    def saw(self, newer: SchemaTooNewError | None) -> None:
        """Take the outcome of a schema check made elsewhere (``/readyz``'s): None, known."""
        self._checked_at = self._monotonic()
        if newer is not None:
            if self._refusal is None:
                logger.error(
                    "the state store was migrated by a newer release (%s): this server stops "
                    "reconciling; upgrade it",
                    newer,
                )
            self._refusal = f"the state store's schema is newer than this release: {newer}"
        elif self._refusal is not None:
            logger.warning("the state store's schema is known again: reconciling resumes")
            self._refusal = None


async def check_writes(gate: SchemaGate) -> None:
    """Return when an API write may run (the reconcile ticks' gate, same interval).

    Raises:
        haru_web.ApiError: 503 ``not_ready`` while a newer release's schema is in the store.
    """
    try:
        await gate.check()
    except SchemaNewerError as exc:
        raise ApiError(ErrorCode.NOT_READY, f"not accepting writes: {exc}") from None
