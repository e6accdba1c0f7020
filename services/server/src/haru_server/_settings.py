"""The server's environment (DESIGN 7.1), parsed once at start-up into a frozen object.

:meth:`Settings.from_env` reads a mapping (``os.environ`` in production) through
pydantic-settings; building :class:`Settings` directly (tests, embedding) reads nothing from
the environment. Blank values count as unset, numbers are ASCII digits only, tokens are
secrets (``SecretStr``: never in a repr, a log line or an error) of at least 16 characters.
A token read from a file is followed afterwards (:meth:`Settings.api_token_source`,
:meth:`Settings.supervisor_token_source`): the file is re-read when it changes.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Final

from haru_protocol import MAX_DURATION_MS
from haru_supervisor_client import SupervisorLinks, client_ssl_context
from haru_web import (
    EnvInt,
    EnvSettingsError,
    FileToken,
    ListenerSettings,
    TokenSource,
    token_validator,
)
from pydantic import AliasChoices, Field, SecretStr, model_validator

from haru_server._errors import HaruServerError
from haru_server._pki import PkiError, StoreKey
from haru_server._settings_parse import DurationMs, FleetList, LoopIntervalMs, SupervisorPins

API_TOKEN_VAR: Final = "HARU_API_TOKEN"  # noqa: S105  (a variable name, not a secret)
SUPERVISOR_TOKEN_VAR: Final = "HARU_SUPERVISOR_TOKEN"  # noqa: S105
SERVING_TOKEN_VAR: Final = "HARU_SERVING_TOKEN"  # noqa: S105
RECONCILE_INTERVAL_DEFAULT_MS: Final = 500
"""An idle fleet's tick costs about 10 ms of CPU (docs/BENCHMARKS.md, *Reconcile loop
interval*): 2 % of a core per fleet buys a failure seen within half a second."""


class SettingsError(HaruServerError, ValueError):
    """An environment variable holds a value the server cannot use (a boot error)."""


API_TOKEN: Final = FileToken(API_TOKEN_VAR, "api_token", "api_token_file")
SUPERVISOR_TOKEN: Final = FileToken(
    SUPERVISOR_TOKEN_VAR, "supervisor_token", "supervisor_token_file"
)

_Token = Annotated[SecretStr | None, token_validator("the token")]


def _env(name: str, field: str) -> AliasChoices:
    return AliasChoices(field, name)


class Settings(ListenerSettings):
    """Everything the server reads from its environment (README: "Configuration").

    The listener's fields (``HARU_HOST``, ``HARU_HTTP_*``, ``HARU_LOG_*``, ``HARU_TLS_*``, ...)
    are :class:`haru_web.ListenerSettings`; the rest are the server's own.
    """

    guard_token = API_TOKEN
    file_tokens = (API_TOKEN, SUPERVISOR_TOKEN)
    once_tokens = (SERVING_TOKEN_VAR,)

    # Neither in a repr nor in a dump: a URL may carry a password.
    database_url: str | None = Field(
        None, validation_alias=_env("DATABASE_URL", "database_url"), repr=False, exclude=True
    )
    """``DATABASE_URL``: PostgreSQL or SQLite URL/path; None = the embedded SQLite default."""
    create_database: bool = Field(
        False, validation_alias=_env("HARU_CREATE_DATABASE", "create_database")
    )
    """``HARU_CREATE_DATABASE`` (``haru serve --create-db``): create the SQLite file that
    ``DATABASE_URL`` names when it does not exist; without it that is refused at boot (a typo
    in the path would otherwise start an empty store). The embedded default is always created."""
    port: Annotated[EnvInt, Field(ge=0, le=65535)] = Field(
        8700, validation_alias=_env("PORT", "port")
    )
    """``PORT``: TCP port; 0 picks a free one (the bound port is logged)."""
    api_token: _Token = Field(None, validation_alias=_env(API_TOKEN_VAR, "api_token"))
    """``HARU_API_TOKEN`` (or ``HARU_API_TOKEN_FILE``): bearer token of ``/v1/*``; None =
    open API, bound to 127.0.0.1 only, browsers kept out by the Origin/Host guard."""
    supervisor_token: _Token = Field(
        None, validation_alias=_env(SUPERVISOR_TOKEN_VAR, "supervisor_token")
    )
    """``HARU_SUPERVISOR_TOKEN`` (or ``HARU_SUPERVISOR_TOKEN_FILE``): presented to supervisors."""
    api_token_file: Path | None = Field(
        None, validation_alias=_env(API_TOKEN_VAR + "_FILE", "api_token_file")
    )
    """``HARU_API_TOKEN_FILE``: the file :attr:`api_token` was read from; re-read when it
    changes (a rotation without a restart)."""
    supervisor_token_file: Path | None = Field(
        None, validation_alias=_env(SUPERVISOR_TOKEN_VAR + "_FILE", "supervisor_token_file")
    )
    """``HARU_SUPERVISOR_TOKEN_FILE``: the file :attr:`supervisor_token` was read from; re-read
    when it changes."""
    serving_token: _Token = Field(None, validation_alias=_env(SERVING_TOKEN_VAR, "serving_token"))
    """``HARU_SERVING_TOKEN`` (or ``HARU_SERVING_TOKEN_FILE``): the serving credential of
    provisioned domains: passed to each launch as the SkyPilot secret of the same name, which
    the machine's gateway requires, and presented by the proxy on every request it forwards
    there. Launching a provisioned domain needs it."""
    default_fleet: str | None = Field(
        None, validation_alias=_env("HARU_DEFAULT_FLEET", "default_fleet")
    )
    """``HARU_DEFAULT_FLEET``: fleet of inference requests without ``X-Haru-Fleet``."""
    clock_offset_file: Path | None = Field(
        None, validation_alias=_env("HARU_CLOCK_OFFSET_FILE", "clock_offset_file")
    )
    """``HARU_CLOCK_OFFSET_FILE``: test and fault-injection hook; the process's clock reads
    the real time plus the offset (milliseconds) this file holds, re-read when it changes.
    Never set in production."""
    max_clock_skew_ms: DurationMs = Field(
        2_000, validation_alias=_env("HARU_MAX_CLOCK_SKEW_MS", "max_clock_skew_ms")
    )
    """``HARU_MAX_CLOCK_SKEW_MS``: the largest difference between this host's clock and the
    database's at which the process still reconciles; beyond it the reconcile loop stops and
    ``/readyz`` fails (stored times always come from the database's clock)."""
    chat_header_timeout_ms: DurationMs = Field(
        30_000, validation_alias=_env("HARU_CHAT_HEADER_TIMEOUT_MS", "chat_header_timeout_ms")
    )
    """``HARU_CHAT_HEADER_TIMEOUT_MS``: upstream time-to-first-byte bound."""
    snapshot_cache_ttl_ms: DurationMs = Field(
        2_000, validation_alias=_env("HARU_SNAPSHOT_CACHE_TTL_MS", "snapshot_cache_ttl_ms")
    )
    """``HARU_SNAPSHOT_CACHE_TTL_MS``: snapshot cache TTL on the inference hot path."""
    chat_max_body_bytes: DurationMs = Field(
        33_554_432, validation_alias=_env("HARU_CHAT_MAX_BODY_BYTES", "chat_max_body_bytes")
    )
    """``HARU_CHAT_MAX_BODY_BYTES``: largest inference request body (413 beyond)."""
    reconcile_interval_ms: LoopIntervalMs = Field(
        RECONCILE_INTERVAL_DEFAULT_MS,
        validation_alias=_env("HARU_RECONCILE_INTERVAL_MS", "reconcile_interval_ms"),
    )
    """``HARU_RECONCILE_INTERVAL_MS``: pause between two ticks of an idle fleet in the background
    reconcile loop; ``0`` or ``off`` (None here) = no loop, nothing fails over."""
    shutdown_drain_ms: Annotated[EnvInt, Field(ge=0, le=600_000)] = Field(
        0, validation_alias=_env("HARU_SHUTDOWN_DRAIN_MS", "shutdown_drain_ms")
    )
    """``HARU_SHUTDOWN_DRAIN_MS``: after SIGTERM, keep serving this long with ``/readyz``
    failing before the listener closes, so load balancers stop sending new connections first
    (0: close at once)."""
    reconcile_fleets: FleetList = Field(
        None, validation_alias=_env("HARU_RECONCILE_FLEETS", "reconcile_fleets")
    )
    """``HARU_RECONCILE_FLEETS``: fleets the loop reconciles; None = every fleet. From the
    environment: a comma-separated list, ``*`` or unset for every fleet; a list naming no fleet
    (``","``) is refused at boot."""
    route_lease_ms: Annotated[EnvInt, Field(ge=0, le=60_000)] = Field(
        300, validation_alias=_env("HARU_ROUTE_LEASE_MS", "route_lease_ms")
    )
    """``HARU_ROUTE_LEASE_MS``: re-confirm each routed fleet's pointer this often; 0 = read it
    on every request. Processes may differ: each records its lease in the fleet row, and a
    promotion waits out the longest (server README, *Mixed leases*)."""
    failover_hold_ms: Annotated[EnvInt, Field(ge=0, le=MAX_DURATION_MS)] = Field(
        10_000, validation_alias=_env("HARU_FAILOVER_HOLD_MS", "failover_hold_ms")
    )
    """``HARU_FAILOVER_HOLD_MS``: longest a request is held for a failover; 0 = never hold."""
    failover_hold_max: Annotated[EnvInt, Field(ge=1, le=1_000_000)] = Field(
        256, validation_alias=_env("HARU_FAILOVER_HOLD_MAX", "failover_hold_max")
    )
    """``HARU_FAILOVER_HOLD_MAX``: requests held at once in this process, lowered to half the
    listener's connection cap so that held requests never starve ``/healthz``, ``/readyz`` or
    the control API; past it a request that would be held gets 503 with ``Retry-After``."""
    upstream_idle_timeout_ms: DurationMs = Field(
        300_000,
        validation_alias=_env("HARU_UPSTREAM_IDLE_TIMEOUT_MS", "upstream_idle_timeout_ms"),
    )
    """``HARU_UPSTREAM_IDLE_TIMEOUT_MS``: an answer whose upstream sends nothing for this long
    is cut (the client's connection is broken, never a clean end)."""
    sky_status_interval_ms: Annotated[EnvInt, Field(ge=0, le=MAX_DURATION_MS)] = Field(
        10_000, validation_alias=_env("HARU_SKY_STATUS_INTERVAL_MS", "sky_status_interval_ms")
    )
    """``HARU_SKY_STATUS_INTERVAL_MS``: least time between two ``sky status --refresh`` reads
    (one call for every ``skypilot`` cluster, in the background: the tick never waits for
    it); 0 = as soon as the last one ended. Bounds how soon a preempted cluster is noticed."""
    retention_days: Annotated[EnvInt, Field(ge=0, le=36_500)] = Field(
        30, validation_alias=_env("HARU_RETENTION_DAYS", "retention_days")
    )
    """``HARU_RETENTION_DAYS``: finished operations and events older than this many days are
    pruned (hourly, by each server process); 0 = keep them forever. In-flight operations, each
    fleet's newest 64 and their events always stay (server README, *Retention*)."""
    workers: Annotated[EnvInt, Field(ge=1, le=64)] = Field(
        1, validation_alias=_env("HARU_WORKERS", "workers")
    )
    """``HARU_WORKERS``: server processes sharing the port (SO_REUSEPORT); see the README."""
    proxy_accept_admin_token: bool = Field(
        False,
        validation_alias=_env("HARU_PROXY_ACCEPT_ADMIN_TOKEN", "proxy_accept_admin_token"),
    )
    """``HARU_PROXY_ACCEPT_ADMIN_TOKEN``: ``1`` lets the admin token (``HARU_API_TOKEN``) send
    inference requests too; otherwise the proxy takes client keys only (``haru keys``)."""
    # ---- TLS: the listener, and the links to supervisors on other hosts ----
    supervisor_ca_file: Path | None = Field(
        None, validation_alias=_env("HARU_SUPERVISOR_CA_FILE", "supervisor_ca_file")
    )
    """``HARU_SUPERVISOR_CA_FILE``: PEM CA bundle that ``https://`` supervisors' certificates
    must chain to; None = the system trust store."""
    serving_ca_file: Path | None = Field(
        None, validation_alias=_env("HARU_SERVING_CA_FILE", "serving_ca_file")
    )
    """``HARU_SERVING_CA_FILE``: PEM CA bundle that ``https://`` serving endpoints of static
    domains must chain to; None = the system trust store. (A ``skypilot`` domain's gateway is
    verified against its fleet's CA and the domain's name.)"""
    supervisor_client_cert_file: Path | None = Field(
        None,
        validation_alias=_env("HARU_SUPERVISOR_CLIENT_CERT_FILE", "supervisor_client_cert_file"),
    )
    """``HARU_SUPERVISOR_CLIENT_CERT_FILE``: client certificate presented to supervisors that
    require one (their ``HARU_TLS_CLIENT_CA_FILE``)."""
    supervisor_client_key_file: Path | None = Field(
        None,
        validation_alias=_env("HARU_SUPERVISOR_CLIENT_KEY_FILE", "supervisor_client_key_file"),
    )
    """``HARU_SUPERVISOR_CLIENT_KEY_FILE``: its PEM private key."""
    supervisor_pins: SupervisorPins = Field(
        default_factory=dict,
        validation_alias=_env("HARU_SUPERVISOR_PINS", "supervisor_pins"),
        repr=False,
    )
    """``HARU_SUPERVISOR_PINS``: ``host:port=sha256`` pairs, comma-separated: the supervisor at
    that address is trusted by the SHA-256 fingerprint of its leaf certificate (hex, colons
    allowed) instead of a CA."""
    allow_plaintext: bool = Field(
        False, validation_alias=_env("HARU_ALLOW_PLAINTEXT", "allow_plaintext")
    )
    """``HARU_ALLOW_PLAINTEXT``: ``1`` lets the server call ``http://`` supervisors and
    serving endpoints on other hosts (a private network); a warning names each such domain at
    boot. Otherwise those calls are refused (loopback is always allowed; a ``skyserve``
    domain's endpoint, which has no certificate, is only warned about)."""

    store_key_file: Path | None = Field(
        None, validation_alias=_env("HARU_STORE_KEY_FILE", "store_key_file"), repr=False
    )
    """``HARU_STORE_KEY_FILE``: file holding the store key (a Fernet key), which seals each
    fleet's CA key in the store; required to launch ``skypilot`` domains (their certificates
    come from that CA). Keep it out of the database and its backups."""
    domain_cert_days: Annotated[EnvInt, Field(ge=1, le=397)] = Field(
        30, validation_alias=_env("HARU_DOMAIN_CERT_DAYS", "domain_cert_days")
    )
    """``HARU_DOMAIN_CERT_DAYS``: life of the certificate issued to a ``skypilot`` domain
    before each launch (a relaunch issues a new one)."""

    @model_validator(mode="after")
    def _tls_settings(self) -> Settings:
        # The listener's own pair is checked by ListenerSettings.
        if (self.supervisor_client_cert_file is None) != (self.supervisor_client_key_file is None):
            raise ValueError(
                "set both HARU_SUPERVISOR_CLIENT_CERT_FILE and HARU_SUPERVISOR_CLIENT_KEY_FILE, "
                "or neither"
            )
        if self.supervisor_pins and self.supervisor_client_cert_file is not None:
            raise ValueError(
                "HARU_SUPERVISOR_PINS cannot be combined with a client certificate yet "
                "(a pinned connection presents none): use HARU_SUPERVISOR_CA_FILE for "
                "mutual TLS"
            )
        return self

    def supervisor_links(self) -> SupervisorLinks:
        """How supervisors are reached: trust, pins, client certificate, plain-HTTP policy.

        Raises:
            SettingsError: A CA or client certificate file cannot be loaded (named).
        """
        try:
            context = client_ssl_context(
                self.supervisor_ca_file,
                cert_file=self.supervisor_client_cert_file,
                key_file=self.supervisor_client_key_file,
            )
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(
                "cannot load HARU_SUPERVISOR_CA_FILE / HARU_SUPERVISOR_CLIENT_CERT_FILE / "
                f"HARU_SUPERVISOR_CLIENT_KEY_FILE: {exc}"
            ) from None
        return SupervisorLinks(
            ssl=context, pins=dict(self.supervisor_pins), allow_plaintext=self.allow_plaintext
        )

    def serving_ssl(self) -> ssl.SSLContext | None:
        """The verifying context of ``https://`` serving endpoints; None = the system store.

        Raises:
            SettingsError: ``HARU_SERVING_CA_FILE`` cannot be loaded (named).
        """
        if self.serving_ca_file is None:
            return None
        try:
            return client_ssl_context(self.serving_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(f"cannot load HARU_SERVING_CA_FILE: {exc}") from None

    def store_key(self) -> StoreKey | None:
        """The store key from ``HARU_STORE_KEY_FILE``; None when it is not set.

        Raises:
            SettingsError: The file cannot be read or holds no Fernet key.
        """
        if self.store_key_file is None:
            return None
        try:
            return StoreKey.from_file(self.store_key_file)
        except PkiError as exc:
            raise SettingsError(str(exc)) from None

    def api_token_value(self) -> str | None:
        """The API token in clear, as read at start-up (see :meth:`api_token_source`)."""
        return None if self.api_token is None else self.api_token.get_secret_value()

    def supervisor_token_value(self) -> str | None:
        """The supervisor token in clear, as read at start-up (:meth:`supervisor_token_source`)."""
        return None if self.supervisor_token is None else self.supervisor_token.get_secret_value()

    def api_token_source(
        self, *, monotonic: Callable[[], float] = time.monotonic
    ) -> TokenSource | None:
        """The API token as the bearer check asks it.

        It follows ``HARU_API_TOKEN_FILE`` when that is set. A new source per call: build it
        once per process.
        """
        return self.token_source_of(API_TOKEN, monotonic=monotonic)

    def supervisor_token_source(
        self, *, monotonic: Callable[[], float] = time.monotonic
    ) -> TokenSource | None:
        """The supervisor token as the supervisor client asks it.

        It follows ``HARU_SUPERVISOR_TOKEN_FILE`` when that is set.
        """
        return self.token_source_of(SUPERVISOR_TOKEN, monotonic=monotonic)

    def serving_token_value(self) -> str | None:
        """The serving credential in clear (for the proxy and the launch secrets only)."""
        return None if self.serving_token is None else self.serving_token.get_secret_value()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Parse the environment (DESIGN 7.1); blank values count as unset.

        Raises:
            SettingsError: A value is unusable; the message names the variable, never a token.
        """
        environ = dict(env)
        # Unset (or blank) means every fleet: a fleet no loop drives never fails over, and its
        # accepted operations would never run (HARU_DEFAULT_FLEET no longer narrows the loop).
        if not environ.get("HARU_RECONCILE_FLEETS", "").strip():
            environ.pop("HARU_RECONCILE_FLEETS", None)
        try:
            return cls.from_environ(environ)
        except EnvSettingsError as exc:
            raise SettingsError(str(exc)) from None
