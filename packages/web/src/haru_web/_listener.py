"""The listener settings both services read from their environment, in one base model.

:class:`ListenerSettings` holds the fields of an HTTP listener that the control server and the
supervisor read under the same environment variables: the bind address and its open-to-network
opt-in, the slow-client and overload bounds, trusted proxies, the metrics opt-out of the token,
the log format and level, and the listener's TLS files. Each field is read by its name or by
its variable (``AliasChoices(field, VAR)``). The port (each service has its own default) and
the token fields stay in each service; a service names its tokens (:class:`FileToken`), and
the base reads each from its variable or its file (:meth:`ListenerSettings.from_environ`, or a
file named without its token when built directly), refuses an open bind without the guarding
token, and builds the source each check asks (:meth:`ListenerSettings.token_source_of`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Self

from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from haru_web._bind import (
    HOST_VAR,
    OPEN_BIND_VAR,
    choose_bind_host,
    is_loopback_bind,
    normalize_bind_host,
)
from haru_web._env import EnvInt, EnvLogLevel, TrustedProxies
from haru_web._limits import DEFAULT_MAX_CONNECTIONS_PER_PEER, ServerLimits
from haru_web._logs import LogFormat, parse_log_format
from haru_web._peers import TRUSTED_PROXIES_VAR
from haru_web._settings_env import EnvSettingsError, settings_from_env
from haru_web._tls import (
    TLS_CERT_FILE_VAR,
    TLS_CLIENT_CA_FILE_VAR,
    TLS_KEY_FILE_VAR,
    TlsFiles,
    tls_files,
)
from haru_web._tokens import FILE_SUFFIX, TokenConfigError, TokenSource, resolve_token

HEADER_TIMEOUT_VAR: Final = "HARU_HTTP_HEADER_TIMEOUT_MS"
BODY_IDLE_VAR: Final = "HARU_HTTP_BODY_IDLE_TIMEOUT_MS"
KEEPALIVE_VAR: Final = "HARU_HTTP_KEEPALIVE_TIMEOUT_MS"
MAX_CONNECTIONS_VAR: Final = "HARU_HTTP_MAX_CONNECTIONS"
MAX_CONNECTIONS_PER_PEER_VAR: Final = "HARU_HTTP_MAX_CONNECTIONS_PER_PEER"
METRICS_PUBLIC_VAR: Final = "HARU_METRICS_PUBLIC"
LOG_FORMAT_VAR: Final = "HARU_LOG_FORMAT"
LOG_LEVEL_VAR: Final = "HARU_LOG_LEVEL"

_MAX_DURATION_MS: Final = 2_147_483_647
_DurationMs = Annotated[EnvInt, Field(ge=1, le=_MAX_DURATION_MS)]
_Connections = Annotated[EnvInt, Field(ge=1, le=1_000_000)]


def _env(name: str, field: str) -> AliasChoices:
    return AliasChoices(field, name)


@dataclass(frozen=True, slots=True)
class FileToken:
    """A token a service reads from its variable or from the file ``<var>_FILE`` names.

    Attributes:
        var: The token's variable (``HARU_API_TOKEN``).
        field: The settings field holding it (``SecretStr | None``).
        file_field: The field naming the file it was read from (``Path | None``); a file is
            followed: re-read when it changes.
    """

    var: str
    field: str
    file_field: str


class ListenerSettings(BaseSettings):
    """The listener's part of a service's settings (a base: each service adds its own fields).

    Frozen and strict like the services' own settings: unknown keys are refused, a value is
    read by its field name or its environment variable, and a bad value is never echoed.
    """

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        case_sensitive=True,
        validate_by_name=True,
        validate_by_alias=True,
        hide_input_in_errors=True,
    )

    guard_token: ClassVar[FileToken | None] = None
    """The token of the service's ``/v1`` routes; while it is unset the listener stays on
    loopback unless the operator opts in (:attr:`host`)."""
    file_tokens: ClassVar[tuple[FileToken, ...]] = ()
    """Every token the service may read from a file it follows (the guarding one among them)."""
    once_tokens: ClassVar[tuple[str, ...]] = ()
    """Variables of tokens read from the variable or its ``_FILE`` once, at start-up."""

    bind_host: str | None = Field(None, validation_alias=_env(HOST_VAR, "bind_host"))
    """``HARU_HOST``: the address to listen on; None = all interfaces with a token, 127.0.0.1
    without one. A non-loopback address without a token needs ``HARU_ALLOW_OPEN_BIND``."""
    allow_open_bind: bool = Field(False, validation_alias=_env(OPEN_BIND_VAR, "allow_open_bind"))
    """``HARU_ALLOW_OPEN_BIND``: allow a non-loopback ``HARU_HOST`` without a token (an API
    open to the network, on purpose; a warning is logged at boot)."""
    http_header_timeout_ms: _DurationMs = Field(
        10_000, validation_alias=_env(HEADER_TIMEOUT_VAR, "http_header_timeout_ms")
    )
    """``HARU_HTTP_HEADER_TIMEOUT_MS``: time a client gets to send a request head (408)."""
    http_body_idle_timeout_ms: _DurationMs = Field(
        30_000, validation_alias=_env(BODY_IDLE_VAR, "http_body_idle_timeout_ms")
    )
    """``HARU_HTTP_BODY_IDLE_TIMEOUT_MS``: longest silence inside a request body."""
    http_keepalive_timeout_ms: _DurationMs = Field(
        75_000, validation_alias=_env(KEEPALIVE_VAR, "http_keepalive_timeout_ms")
    )
    """``HARU_HTTP_KEEPALIVE_TIMEOUT_MS``: idle keep-alive connections are closed after it."""
    http_max_connections: _Connections = Field(
        512, validation_alias=_env(MAX_CONNECTIONS_VAR, "http_max_connections")
    )
    """``HARU_HTTP_MAX_CONNECTIONS``: open client connections (lowered to fit the open-file
    limit); at the cap an idle or half-sent one is closed, or the newcomer gets 503."""
    http_max_connections_per_peer: _Connections = Field(
        DEFAULT_MAX_CONNECTIONS_PER_PEER,
        validation_alias=_env(MAX_CONNECTIONS_PER_PEER_VAR, "http_max_connections_per_peer"),
    )
    """``HARU_HTTP_MAX_CONNECTIONS_PER_PEER``: open connections of one client address (IPv6: one
    /64); at the bound its own idle or half-sent one is closed, or the newcomer gets 503.
    Trusted proxies are exempt."""
    trusted_proxies: Annotated[TrustedProxies, NoDecode] = Field(
        (), validation_alias=_env(TRUSTED_PROXIES_VAR, "trusted_proxies")
    )
    """``HARU_TRUSTED_PROXIES``: reverse proxies (addresses or CIDR networks, comma-separated)
    whose ``X-Forwarded-For`` names the client in the access log; empty = never trusted."""
    metrics_public: bool = Field(False, validation_alias=_env(METRICS_PUBLIC_VAR, "metrics_public"))
    """``HARU_METRICS_PUBLIC``: ``1`` serves ``GET /metrics`` without the bearer token (for a
    scraper that cannot present one); otherwise it sits behind the service's token."""
    log_format: Annotated[LogFormat, BeforeValidator(parse_log_format)] = Field(
        "text", validation_alias=_env(LOG_FORMAT_VAR, "log_format")
    )
    """``HARU_LOG_FORMAT``: ``text`` (default) or ``json`` (one JSON object per line)."""
    log_level: EnvLogLevel = Field(logging.INFO, validation_alias=_env(LOG_LEVEL_VAR, "log_level"))
    """``HARU_LOG_LEVEL``: DEBUG, INFO (default), WARNING, ERROR or CRITICAL."""
    tls_cert_file: Path | None = Field(
        None, validation_alias=_env(TLS_CERT_FILE_VAR, "tls_cert_file")
    )
    """``HARU_TLS_CERT_FILE``: PEM certificate chain; with the key, the listener serves HTTPS
    only (re-read when the file changes)."""
    tls_key_file: Path | None = Field(None, validation_alias=_env(TLS_KEY_FILE_VAR, "tls_key_file"))
    """``HARU_TLS_KEY_FILE``: the certificate's PEM private key."""
    tls_client_ca_file: Path | None = Field(
        None, validation_alias=_env(TLS_CLIENT_CA_FILE_VAR, "tls_client_ca_file")
    )
    """``HARU_TLS_CLIENT_CA_FILE``: PEM CA bundle; every client must present a certificate it
    issued (mutual TLS)."""

    @field_validator("bind_host", mode="before")
    @classmethod
    def _bind_host(cls, value: object) -> object:
        return normalize_bind_host(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _tls_pair(self) -> ListenerSettings:
        tls_files(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        return self

    @model_validator(mode="after")
    def _guard(self) -> ListenerSettings:
        # A file named without its token (built directly, not from the environment): read it
        # now, before the bind rule asks whether the guarding token is set.
        for token in self.file_tokens:
            path = getattr(self, token.file_field)
            if path is not None and getattr(self, token.field) is None:
                value = resolve_token({token.var + FILE_SUFFIX: str(path)}, token.var)
                object.__setattr__(self, token.field, None if value is None else SecretStr(value))
        _ = self.host  # refuses a non-loopback address without a token, unless opted in
        return self

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str],
        *,
        messages: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> Self:
        """The settings ``environ`` sets (blank values count as unset), plus ``fields`` as given.

        Each token is read from its variable or from the file its ``_FILE`` variable names
        (:attr:`file_tokens` first, then :attr:`once_tokens`); variables no field reads are
        left out.

        Args:
            environ: The environment (``os.environ`` in production).
            messages: Variable -> what a boot error says of it instead of pydantic's words.
            fields: Values that do not come from a variable (a parsed document, say).

        Raises:
            EnvSettingsError: A value is unusable; the message names each variable, never a
                value or a token.
        """
        env = dict(environ)
        try:
            for var in (*(token.var for token in cls.file_tokens), *cls.once_tokens):
                env[var] = resolve_token(env, var) or ""
        except TokenConfigError as exc:
            raise EnvSettingsError(str(exc)) from None
        return settings_from_env(cls, env, messages=messages, fields=fields)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: Any, *_others: Any, **_kw: Any
    ) -> tuple[Any, ...]:
        # Only what is passed: a service's loader passes the environment it was given.
        return (init_settings,)

    @property
    def guarded(self) -> bool:
        """Whether a token guards the service's ``/v1`` routes."""
        return self.guard_token is not None and getattr(self, self.guard_token.field) is not None

    @property
    def host(self) -> str:
        """``HARU_HOST``, else all interfaces with a token and loopback without one (DESIGN 6.2).

        Raises:
            ValueError: A non-loopback ``HARU_HOST`` without the token and without
                ``HARU_ALLOW_OPEN_BIND`` (refused when the settings are built).
        """
        return choose_bind_host(
            self.bind_host,
            token_set=self.guarded,
            allow_open=self.allow_open_bind,
            token_var="the token" if self.guard_token is None else self.guard_token.var,
        )

    @property
    def open_to_network(self) -> bool:
        """No token, and listening beyond loopback (``HARU_ALLOW_OPEN_BIND``)."""
        return not self.guarded and not is_loopback_bind(self.host)

    def token_source_of(
        self,
        token: FileToken,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        overlap_s: float = 0.0,
    ) -> TokenSource | None:
        """``token`` as a check asks it: a constant, or following its file when one is set.

        A new source per call: build it once per process. None when the token is unset.

        Args:
            token: One of :attr:`file_tokens`.
            monotonic: Seconds that only go forward (tests inject a fake).
            overlap_s: How long the previous token keeps matching after the file changes.
        """
        secret: SecretStr | None = getattr(self, token.field)
        if secret is None:
            return None
        path: Path | None = getattr(self, token.file_field)
        if path is None:
            return TokenSource.constant(secret.get_secret_value())
        return TokenSource(
            secret.get_secret_value(),
            path=path,
            name=token.var + FILE_SUFFIX,
            monotonic=monotonic,
            overlap_s=overlap_s,
        )

    @property
    def tls(self) -> TlsFiles | None:
        """The listener's TLS files; None = plain HTTP."""
        return tls_files(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    @property
    def http_limits(self) -> ServerLimits:
        """The listener's slow-client and overload bounds."""
        return ServerLimits(
            header_timeout_s=self.http_header_timeout_ms / 1000,
            body_idle_timeout_s=self.http_body_idle_timeout_ms / 1000,
            keepalive_timeout_s=self.http_keepalive_timeout_ms / 1000,
            max_connections=self.http_max_connections,
            max_connections_per_peer=self.http_max_connections_per_peer,
            trusted_proxies=self.trusted_proxies,
        )
