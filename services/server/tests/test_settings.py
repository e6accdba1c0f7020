"""The environment of SPEC 7.1: blank = unset, trimmed tokens, clear boot errors."""

from __future__ import annotations

import pytest
from haru_server._settings import Settings, SettingsError


def test_defaults_when_nothing_is_set() -> None:
    settings = Settings.from_env({})
    assert settings.database_url is None
    assert settings.port == 8700
    assert settings.api_token is None
    assert settings.host == "127.0.0.1"
    assert settings.chat_header_timeout_ms == 30_000
    assert settings.snapshot_cache_ttl_ms == 2_000
    assert settings.chat_max_body_bytes == 33_554_432
    assert settings.reconcile_interval_ms is None
    assert settings.reconcile_fleets is None


def test_blank_values_count_as_unset_and_tokens_are_trimmed() -> None:
    settings = Settings.from_env(
        {
            "DATABASE_URL": "   ",
            "PORT": "",
            "HARU_API_TOKEN": "  tok \n",
            "HARU_SUPERVISOR_TOKEN": "   ",
            "HARU_DEFAULT_FLEET": " ",
            "HARU_RECONCILE_INTERVAL_MS": "",
        }
    )
    assert settings.database_url is None
    assert settings.port == 8700
    assert settings.api_token == "tok"
    assert settings.supervisor_token is None
    assert settings.default_fleet is None
    assert settings.reconcile_interval_ms is None
    assert settings.host == "0.0.0.0"


def test_numbers_and_fleets_parse() -> None:
    settings = Settings.from_env(
        {
            "PORT": "0",
            "HARU_RECONCILE_INTERVAL_MS": " 250 ",
            "HARU_RECONCILE_FLEETS": "a, b ,,c",
            "HARU_CHAT_MAX_BODY_BYTES": "1024",
        }
    )
    assert settings.port == 0
    assert settings.reconcile_interval_ms == 250
    assert settings.reconcile_fleets == ("a", "b", "c")
    assert settings.chat_max_body_bytes == 1024


def test_reconcile_fleets_fall_back_to_default_fleet_and_star_means_all() -> None:
    assert Settings.from_env({"HARU_DEFAULT_FLEET": "f"}).reconcile_fleets == ("f",)
    star = {"HARU_DEFAULT_FLEET": "f", "HARU_RECONCILE_FLEETS": "*"}
    assert Settings.from_env(star).reconcile_fleets is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PORT", "eighty"),
        ("PORT", "70000"),
        ("PORT", "-1"),
        ("HARU_RECONCILE_INTERVAL_MS", "0"),
        ("HARU_RECONCILE_INTERVAL_MS", "1.5"),
        ("HARU_CHAT_HEADER_TIMEOUT_MS", "2147483648"),
        ("HARU_SNAPSHOT_CACHE_TTL_MS", "-5"),
    ],
)
def test_bad_numbers_are_a_clear_boot_error(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: value})


def test_repr_never_shows_tokens() -> None:
    settings = Settings.from_env(
        {
            "HARU_API_TOKEN": "api-secret",
            "HARU_SUPERVISOR_TOKEN": "sup-secret",
            "DATABASE_URL": "postgresql://u:pw@h/db",
        }
    )
    text = repr(settings)
    assert "api-secret" not in text
    assert "sup-secret" not in text
    assert "pw" not in text


def test_data_path_variables() -> None:
    settings = Settings.from_env(
        {
            "HARU_ROUTE_LEASE_MS": "0",
            "HARU_FAILOVER_HOLD_MS": "2500",
            "HARU_FAILOVER_HOLD_MAX": "8",
            "HARU_UPSTREAM_IDLE_TIMEOUT_MS": "1000",
        }
    )
    assert settings.route_lease_ms == 0
    assert settings.failover_hold_ms == 2500
    assert settings.failover_hold_max == 8
    assert settings.upstream_idle_timeout_ms == 1000
    defaults = Settings.from_env({})
    assert (defaults.route_lease_ms, defaults.failover_hold_ms) == (300, 10_000)
    with pytest.raises(SettingsError, match="HARU_ROUTE_LEASE_MS"):
        Settings.from_env({"HARU_ROUTE_LEASE_MS": "-1"})
