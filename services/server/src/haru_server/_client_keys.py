"""Inference client keys: who may use the proxy, which fleets and models, and how often.

With ``HARU_API_TOKEN`` set, every proxied request presents a client key (``Authorization:
Bearer``); the admin token opens the proxy only with ``HARU_PROXY_ACCEPT_ADMIN_TOKEN=1``. A key
is looked up by its SHA-256 and the answer (found, unknown or revoked) is cached per process
for one route lease (``HARU_ROUTE_LEASE_MS``; 0 asks the store on every request), so a
revocation takes effect on every replica within a lease. A store that cannot answer a lookup
fails the request (503): a key is never honoured on a stale answer.

A key's ``rpm`` is a token bucket per key per process (capacity ``rpm``, refilled at
``rpm``/60 per second): ``HARU_WORKERS`` processes or replicas each allow that many. Past it:
429 ``rate_limited`` with ``Retry-After``. The key's id (never the key, never its name) goes in
the access log and the ``key`` metric label.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from aiohttp import web
from haru_db import ClientKey, StateStore
from haru_protocol import ErrorCode
from haru_web import BEARER_CHALLENGE, ApiError, TokenSource

MAX_CACHED_KEYS: Final = 4096
"""Lookups (found or not) a process remembers; the oldest is forgotten past it, so random
keys cannot grow the cache."""

ADMIN_LABEL: Final = "admin"
"""The ``key`` label and access-log value of a request that presented the admin token."""


def key_hash(secret: str) -> str:
    """The SHA-256 of a key (64 lower-case hex digits): what the store keeps."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Grant:
    """What a request may do: ``key`` None means anything (open server or admin token)."""

    label: str
    key: ClientKey | None

    def check_fleet(self, fleet_id: UUID, slug: str) -> None:
        """Raise 403 unless the key may use this fleet."""
        if self.key is not None and self.key.fleets is not None and fleet_id not in self.key.fleets:
            raise ApiError(
                ErrorCode.FORBIDDEN, f"client key {self.key.id} may not use fleet {slug!r}"
            )

    def check_model(self, model: str) -> None:
        """Raise 403 unless the key may ask for ``model``."""
        if self.key is not None and self.key.models is not None and model not in self.key.models:
            raise ApiError(
                ErrorCode.FORBIDDEN,
                f"client key {self.key.id} may not use model {model[:200]!r}",
            )

    def allows_model(self, model: str) -> bool:
        """Whether ``GET /v1/models`` lists ``model`` to this key."""
        return self.key is None or self.key.models is None or model in self.key.models


def _unauthorized(message: str) -> ApiError:
    return ApiError(ErrorCode.UNAUTHORIZED, message, headers={"WWW-Authenticate": BEARER_CHALLENGE})


class _Bucket:
    __slots__ = ("last", "tokens")

    def __init__(self, tokens: float, last: float) -> None:
        self.tokens = tokens
        self.last = last


class KeyGate:
    """Checks the client key of each proxied request (one per app process)."""

    def __init__(
        self,
        store: StateStore,
        *,
        admin_token: TokenSource | None,
        accept_admin: bool,
        lease_ms: int,
        monotonic: Callable[[], float],
    ) -> None:
        self._store = store
        self._admin = admin_token
        self._accept_admin = accept_admin
        self._lease_s = lease_ms / 1000
        self._mono = monotonic
        self._cache: OrderedDict[str, tuple[ClientKey | None, float]] = OrderedDict()
        self._buckets: dict[UUID, _Bucket] = {}

    async def admit(self, request: web.BaseRequest) -> Grant:
        """The grant of ``request``'s credential, or the 401/403 that refuses it."""
        if self._admin is None:
            return Grant("none", None)  # an open server: the proxy is open too
        header = request.headers.get("Authorization")
        if header is None:
            raise _unauthorized("missing bearer token: send a client key (haru keys create)")
        if self._admin.matches(header):
            if not self._accept_admin:
                raise ApiError(
                    ErrorCode.FORBIDDEN,
                    "the admin token does not open the inference proxy: send a client key "
                    "(haru keys create), or set HARU_PROXY_ACCEPT_ADMIN_TOKEN=1",
                )
            return Grant(ADMIN_LABEL, None)
        scheme, _, presented = header.strip().partition(" ")
        secret = presented.strip()
        if scheme.lower() != "bearer" or not secret:
            raise _unauthorized("missing or invalid bearer token")
        try:
            digest = key_hash(secret)
        except UnicodeEncodeError:
            raise _unauthorized("missing or invalid bearer token") from None
        key = await self._lookup(digest)
        if key is None or key.revoked_at is not None:
            raise _unauthorized("invalid or revoked client key")
        return Grant(str(key.id), key)

    async def _lookup(self, digest: str) -> ClientKey | None:
        now = self._mono()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[1] < self._lease_s:
            return cached[0]
        key = await self._store.client_key_by_hash(digest)
        self._cache[digest] = (key, now)
        self._cache.move_to_end(digest)
        while len(self._cache) > MAX_CACHED_KEYS:
            self._cache.popitem(last=False)
        return key

    def spend(self, grant: Grant) -> None:
        """Take one request from the key's rate budget, or raise 429 with ``Retry-After``."""
        key = grant.key
        if key is None or key.rpm is None:
            return
        now = self._mono()
        rate = key.rpm / 60
        bucket = self._buckets.get(key.id)
        if bucket is None:
            bucket = self._buckets[key.id] = _Bucket(float(key.rpm), now)
        bucket.tokens = min(float(key.rpm), bucket.tokens + (now - bucket.last) * rate)
        bucket.last = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return
        wait_s = max(1, math.ceil((1 - bucket.tokens) / rate))
        raise ApiError(
            ErrorCode.RATE_LIMITED,
            f"client key {key.id} is over its limit of {key.rpm} requests per minute "
            "(per server process)",
            headers={"Retry-After": str(wait_s)},
        )
