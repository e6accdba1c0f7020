"""The listener settings base: every listener variable read, checked and turned into bounds.

And the service tokens it reads: from a variable or a file, followed or read once, the guarding
one deciding the bind address.
"""

from __future__ import annotations

import logging
from ipaddress import ip_network
from pathlib import Path
from typing import Annotated

import pytest
from haru_web import EnvSettingsError, FileToken, ListenerSettings, TlsFiles, token_validator
from pydantic import AliasChoices, Field, SecretStr, ValidationError


class _Service(ListenerSettings):
    """A service's settings: the listener's fields plus its own."""

    port: int = Field(8000)


def test_every_listener_variable_is_read_under_its_environment_name() -> None:
    settings = _Service.model_validate(
        {
            "HARU_HOST": "[::]",
            "HARU_ALLOW_OPEN_BIND": "1",
            "HARU_HTTP_HEADER_TIMEOUT_MS": "1500",
            "HARU_HTTP_BODY_IDLE_TIMEOUT_MS": "2500",
            "HARU_HTTP_KEEPALIVE_TIMEOUT_MS": "3500",
            "HARU_HTTP_MAX_CONNECTIONS": "7",
            "HARU_HTTP_MAX_CONNECTIONS_PER_PEER": "3",
            "HARU_TRUSTED_PROXIES": "10.0.0.0/8, 192.0.2.7",
            "HARU_METRICS_PUBLIC": "1",
            "HARU_LOG_FORMAT": "json",
            "HARU_LOG_LEVEL": "warning",
            "HARU_TLS_CERT_FILE": "/etc/haru/cert.pem",
            "HARU_TLS_KEY_FILE": "/etc/haru/key.pem",
            "HARU_TLS_CLIENT_CA_FILE": "/etc/haru/ca.pem",
            "port": 9000,
        }
    )
    assert settings.bind_host == "::"
    assert settings.allow_open_bind is True
    assert settings.metrics_public is True
    assert (settings.log_format, settings.log_level) == ("json", logging.WARNING)
    assert settings.port == 9000
    limits = settings.http_limits
    assert (limits.header_timeout_s, limits.body_idle_timeout_s, limits.keepalive_timeout_s) == (
        1.5,
        2.5,
        3.5,
    )
    assert (limits.max_connections, limits.max_connections_per_peer) == (7, 3)
    assert limits.trusted_proxies == (ip_network("10.0.0.0/8"), ip_network("192.0.2.7/32"))
    assert settings.tls == TlsFiles(
        Path("/etc/haru/cert.pem"), Path("/etc/haru/key.pem"), Path("/etc/haru/ca.pem")
    )


def test_defaults_are_a_plain_http_listener_with_the_documented_bounds() -> None:
    settings = _Service()
    assert settings.bind_host is None
    assert settings.tls is None
    limits = settings.http_limits
    assert (limits.header_timeout_s, limits.body_idle_timeout_s, limits.keepalive_timeout_s) == (
        10.0,
        30.0,
        75.0,
    )
    assert limits.max_connections == 512
    assert (settings.log_format, settings.log_level) == ("text", logging.INFO)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"HARU_TLS_CERT_FILE": "/c.pem"}, "HARU_TLS_KEY_FILE"),
        ({"HARU_TLS_CLIENT_CA_FILE": "/ca.pem"}, "HARU_TLS_CERT_FILE"),
        ({"HARU_HTTP_MAX_CONNECTIONS": "٣"}, "ASCII digits"),
        ({"HARU_HTTP_HEADER_TIMEOUT_MS": "0"}, "greater than or equal to 1"),
        ({"HARU_LOG_FORMAT": "xml"}, "HARU_LOG_FORMAT"),
        ({"HARU_UNKNOWN": "1"}, "Extra inputs are not permitted"),
    ],
)
def test_an_unusable_listener_setting_is_refused(values: dict[str, str], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        _Service.model_validate(values)


def test_listener_settings_are_frozen() -> None:
    settings = _Service()
    with pytest.raises(ValidationError):
        settings.bind_host = "0.0.0.0"  # type: ignore[misc]  # frozen: the point of the test


_TOKEN_VAR = "HARU_TEST_TOKEN"
_TOKEN = FileToken(_TOKEN_VAR, "token", "token_file")


class _Guarded(ListenerSettings):
    """A service whose ``/v1`` a followed token guards, with a second token read once."""

    guard_token = _TOKEN
    file_tokens = (_TOKEN,)
    once_tokens = ("HARU_TEST_OTHER_TOKEN",)

    port: int = Field(8000, validation_alias=AliasChoices("port", "PORT"))
    token: Annotated[SecretStr | None, token_validator(_TOKEN_VAR)] = Field(
        None, validation_alias=AliasChoices("token", _TOKEN_VAR)
    )
    token_file: Path | None = Field(
        None, validation_alias=AliasChoices("token_file", _TOKEN_VAR + "_FILE")
    )
    other_token: Annotated[SecretStr | None, token_validator("the other token")] = Field(
        None, validation_alias=AliasChoices("other_token", "HARU_TEST_OTHER_TOKEN")
    )


def test_tokens_come_from_their_files_and_a_followed_one_is_re_read(tmp_path: Path) -> None:
    followed, once = tmp_path / "followed", tmp_path / "once"
    followed.write_text("followed-token-0123456789\n")
    once.write_text("read-once-token-0123456789\n")
    settings = _Guarded.from_environ(
        {
            "HARU_TEST_TOKEN_FILE": str(followed),
            "HARU_TEST_OTHER_TOKEN_FILE": str(once),
            "PORT": " ",  # blank: unset
            "HARU_NOT_READ": "x",  # no field reads it
        }
    )
    assert settings.port == 8000
    assert settings.token_file == followed
    assert settings.other_token is not None
    assert settings.other_token.get_secret_value() == "read-once-token-0123456789"
    assert settings.guarded
    assert settings.host == "0.0.0.0"
    now = [0.0]
    source = settings.token_source_of(_TOKEN, monotonic=lambda: now[0])
    assert source is not None
    followed.write_text("rotated-token-0123456789\n")
    now[0] += 5
    assert source.current() == "rotated-token-0123456789"
    literal = _Guarded.from_environ({_TOKEN_VAR: "literal-token-0123456789"})
    constant = literal.token_source_of(_TOKEN, monotonic=lambda: now[0])
    assert constant is not None
    assert constant.current() == "literal-token-0123456789"
    assert _Guarded().token_source_of(_TOKEN) is None


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({_TOKEN_VAR: "short-tok"}, "^HARU_TEST_TOKEN is 9 characters long"),
        ({_TOKEN_VAR: "x" * 20, "HARU_TEST_TOKEN_FILE": "/t"}, "either HARU_TEST_TOKEN or"),
        ({"PORT": "x", "HARU_LOG_FORMAT": "xml"}, "^HARU_LOG_FORMAT must be one of .*; PORT "),
        ({"HARU_HOST": "0.0.0.0"}, "HARU_HOST=0.0.0.0 is not a loopback address and "),
    ],
)
def test_an_unusable_environment_is_one_error_naming_each_variable(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(EnvSettingsError, match=message) as err:
        _Guarded.from_environ(environ)
    assert "short-tok" not in str(err.value)


def test_a_message_can_replace_pydantics_words_for_a_variable() -> None:
    with pytest.raises(EnvSettingsError, match=r"^PORT must be a port number$"):
        _Guarded.from_environ({"PORT": "x"}, messages={"PORT": "must be a port number"})


def test_a_token_file_named_without_its_token_is_read_before_the_bind_rule(
    tmp_path: Path,
) -> None:
    path = tmp_path / "token"
    path.write_text("from-a-file-0123456789\n")
    direct = _Guarded(token_file=path, bind_host="0.0.0.0")
    assert direct.token is not None
    assert direct.token.get_secret_value() == "from-a-file-0123456789"
    assert not direct.open_to_network
    with pytest.raises(ValidationError, match="HARU_TEST_TOKEN is unset"):
        _Guarded(bind_host="0.0.0.0")
    opened = _Guarded(bind_host="0.0.0.0", allow_open_bind=True)
    assert (opened.guarded, opened.open_to_network) == (False, True)
    assert not _Guarded().open_to_network
