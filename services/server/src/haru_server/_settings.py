"""The server's environment (SPEC 7.1), parsed once at start-up into a frozen object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from haru_protocol import MAX_DURATION_MS, normalize_token

from haru_server._errors import HaruServerError


class SettingsError(HaruServerError, ValueError):
    """An environment variable holds a value the server cannot use (a boot error)."""


@dataclass(frozen=True, slots=True, repr=False)
class Settings:
    """Everything the server reads from its environment."""

    database_url: str | None = None
    """Raw ``DATABASE_URL``; None means the embedded SQLite default."""
    port: int = 8700
    """TCP port; 0 picks a free one (the bound port is logged)."""
    api_token: str | None = None
    supervisor_token: str | None = None
    default_fleet: str | None = None
    chat_header_timeout_ms: int = 30_000
    snapshot_cache_ttl_ms: int = 2_000
    chat_max_body_bytes: int = 33_554_432
    reconcile_interval_ms: int | None = None
    route_lease_ms: int = 300
    """``HARU_ROUTE_LEASE_MS``: re-confirm each routed fleet's pointer this often; 0 = read it
    on every request."""
    failover_hold_ms: int = 10_000
    """``HARU_FAILOVER_HOLD_MS``: longest a request is held for a failover; 0 = never hold."""
    failover_hold_max: int = 1_024
    """``HARU_FAILOVER_HOLD_MAX``: requests held at once in this process."""
    upstream_idle_timeout_ms: int = 300_000
    """``HARU_UPSTREAM_IDLE_TIMEOUT_MS``: an answer whose upstream sends nothing for this long
    is cut (the client's connection is broken)."""
    reconcile_fleets: tuple[str, ...] | None = None
    """Fleets the loop reconciles; None means every fleet in the store."""
    workers: int = 1
    """``HARU_WORKERS``: server processes sharing the port (SO_REUSEPORT); see the README."""

    def __repr__(self) -> str:
        # Tokens never reach a log line, even through a repr.
        return (
            f"Settings(database_url={'set' if self.database_url else 'unset'}, "
            f"port={self.port}, api_token={'set' if self.api_token else 'unset'}, "
            f"supervisor_token={'set' if self.supervisor_token else 'unset'}, "
            f"default_fleet={self.default_fleet!r}, "
            f"reconcile_interval_ms={self.reconcile_interval_ms!r}, "
            f"reconcile_fleets={self.reconcile_fleets!r})"
        )

    @property
    def host(self) -> str:
        """Bind address: all interfaces only when a token guards the API."""
        return "0.0.0.0" if self.api_token else "127.0.0.1"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Parse the environment; blank values count as unset.

        Raises:
            SettingsError: a number is not an integer in its range.
        """

        def text(name: str) -> str | None:
            value = env.get(name)
            if value is None or not value.strip():
                return None
            return value.strip()

        def number(
            name: str, default: int, *, minimum: int = 1, maximum: int = MAX_DURATION_MS
        ) -> int:
            raw = text(name)
            if raw is None:
                return default
            try:
                value = int(raw, 10)
            except ValueError:
                raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
            if not minimum <= value <= maximum:
                raise SettingsError(f"{name} must be between {minimum} and {maximum}, got {value}")
            return value

        default_fleet = text("HARU_DEFAULT_FLEET")
        interval_raw = text("HARU_RECONCILE_INTERVAL_MS")
        fleets_raw = text("HARU_RECONCILE_FLEETS")
        if fleets_raw is None or fleets_raw == "*":
            fleets: tuple[str, ...] | None = (
                (default_fleet,) if fleets_raw is None and default_fleet is not None else None
            )
        else:
            fleets = tuple(f.strip() for f in fleets_raw.split(",") if f.strip()) or None
        return cls(
            database_url=text("DATABASE_URL"),
            # PORT=0 binds a free port (logged at boot): tests and side-by-side servers use it.
            port=number("PORT", 8700, minimum=0, maximum=65535),
            api_token=normalize_token(env.get("HARU_API_TOKEN")),
            supervisor_token=normalize_token(env.get("HARU_SUPERVISOR_TOKEN")),
            default_fleet=default_fleet,
            chat_header_timeout_ms=number("HARU_CHAT_HEADER_TIMEOUT_MS", 30_000),
            snapshot_cache_ttl_ms=number("HARU_SNAPSHOT_CACHE_TTL_MS", 2_000),
            chat_max_body_bytes=number("HARU_CHAT_MAX_BODY_BYTES", 33_554_432),
            reconcile_interval_ms=(
                None if interval_raw is None else number("HARU_RECONCILE_INTERVAL_MS", 0)
            ),
            reconcile_fleets=fleets,
            route_lease_ms=number("HARU_ROUTE_LEASE_MS", 300, minimum=0, maximum=60_000),
            failover_hold_ms=number("HARU_FAILOVER_HOLD_MS", 10_000, minimum=0),
            failover_hold_max=number("HARU_FAILOVER_HOLD_MAX", 1_024, maximum=1_000_000),
            upstream_idle_timeout_ms=number("HARU_UPSTREAM_IDLE_TIMEOUT_MS", 300_000),
            workers=number("HARU_WORKERS", 1, minimum=1, maximum=64),
        )
