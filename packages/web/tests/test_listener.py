"""The listener settings base: every listener variable read, checked and turned into bounds."""

from __future__ import annotations

import logging
from ipaddress import ip_network
from pathlib import Path

import pytest
from haru_web import ListenerSettings, TlsFiles
from pydantic import Field, ValidationError


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
