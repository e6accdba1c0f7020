"""The environment of DESIGN 7.1: blank = unset, trimmed tokens, clear boot errors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from haru_server._app import create_app
from haru_server._clock import OffsetFileClock, StoreClock, utc_now
from haru_server._keys import clock_key
from haru_server._settings import Settings, SettingsError
from pydantic import ValidationError


def test_defaults_when_nothing_is_set() -> None:
    settings = Settings.from_env({})
    assert settings.database_url is None
    assert settings.port == 8700
    assert settings.api_token is None
    assert settings.host == "127.0.0.1"
    assert settings.chat_header_timeout_ms == 30_000
    assert settings.snapshot_cache_ttl_ms == 2_000
    assert settings.chat_max_body_bytes == 33_554_432
    assert settings.reconcile_interval_ms == 500  # the loop runs unless turned off
    assert settings.reconcile_fleets is None


def test_blank_values_count_as_unset_and_tokens_are_trimmed() -> None:
    settings = Settings.from_env(
        {
            "DATABASE_URL": "   ",
            "PORT": "",
            "HARU_API_TOKEN": "  tok-0123456789abcdef \n",
            "HARU_SUPERVISOR_TOKEN": "   ",
            "HARU_DEFAULT_FLEET": " ",
            "HARU_RECONCILE_INTERVAL_MS": "",
        }
    )
    assert settings.database_url is None
    assert settings.port == 8700
    assert settings.api_token_value() == "tok-0123456789abcdef"
    assert settings.supervisor_token is None
    assert settings.default_fleet is None
    assert settings.reconcile_interval_ms == 500
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


@pytest.mark.parametrize("value", ["0", "off", " OFF ", "Off"])
def test_zero_or_off_turns_the_reconcile_loop_off(value: str) -> None:
    assert Settings.from_env({"HARU_RECONCILE_INTERVAL_MS": value}).reconcile_interval_ms is None
    assert Settings(reconcile_interval_ms=0).reconcile_interval_ms is None


def test_reconcile_fleets_default_to_every_fleet_and_star_means_all() -> None:
    # HARU_DEFAULT_FLEET only picks the fleet of chat requests; it never narrows the loop (a
    # second fleet would otherwise never be reconciled).
    assert Settings.from_env({"HARU_DEFAULT_FLEET": "f"}).reconcile_fleets is None
    star = {"HARU_DEFAULT_FLEET": "f", "HARU_RECONCILE_FLEETS": "*"}
    assert Settings.from_env(star).reconcile_fleets is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PORT", "eighty"),
        ("PORT", "70000"),
        ("PORT", "-1"),
        ("HARU_RECONCILE_INTERVAL_MS", "1.5"),
        ("HARU_RECONCILE_INTERVAL_MS", "none"),
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
            "HARU_API_TOKEN": "api-secret-0123456789",
            "HARU_SUPERVISOR_TOKEN": "sup-secret-0123456789",
            "DATABASE_URL": "postgresql://u:pw@h/db",
        }
    )
    for text in (repr(settings), str(settings), settings.model_dump_json()):
        assert "api-secret-0123456789" not in text
        assert "sup-secret-0123456789" not in text
        assert "pw@" not in text


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(ValidationError, match="frozen"):
        settings.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("value", [",", " , ,", ",,,"])
def test_a_fleet_list_naming_no_fleet_is_refused(value: str) -> None:
    with pytest.raises(SettingsError, match="HARU_RECONCILE_FLEETS names no fleet"):
        Settings.from_env({"HARU_RECONCILE_FLEETS": value, "HARU_DEFAULT_FLEET": "f"})


@pytest.mark.parametrize("value", ["+1", "1_0", "\u0661\u0662", "1e3", " -5"])
def test_numbers_are_ascii_digits_only(value: str) -> None:
    with pytest.raises(SettingsError, match="HARU_RECONCILE_INTERVAL_MS must be a non-negative"):
        Settings.from_env({"HARU_RECONCILE_INTERVAL_MS": value})


@pytest.mark.parametrize("name", ["HARU_API_TOKEN", "HARU_SUPERVISOR_TOKEN"])
def test_short_tokens_are_a_clear_boot_error(name: str) -> None:
    with pytest.raises(SettingsError, match=f"{name} is 9 characters long; use at least 16") as err:
        Settings.from_env({name: "short-tok"})
    assert "short-tok" not in str(err.value)


@pytest.mark.parametrize("name", ["HARU_API_TOKEN", "HARU_SUPERVISOR_TOKEN"])
def test_tokens_can_come_from_files(name: str, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-a-file-0123456789\n")
    settings = Settings.from_env({f"{name}_FILE": str(path)})
    values = {
        "HARU_API_TOKEN": settings.api_token_value(),
        "HARU_SUPERVISOR_TOKEN": settings.supervisor_token_value(),
    }
    assert values[name] == "from-a-file-0123456789"


@pytest.mark.parametrize("name", ["HARU_API_TOKEN", "HARU_SUPERVISOR_TOKEN"])
def test_token_files_are_followed_and_literal_tokens_are_not(name: str, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-a-file-0123456789\n")
    now = [0.0]
    settings = Settings.from_env({f"{name}_FILE": str(path)})
    sources = {
        "HARU_API_TOKEN": settings.api_token_source,
        "HARU_SUPERVISOR_TOKEN": settings.supervisor_token_source,
    }
    source = sources[name](monotonic=lambda: now[0])
    assert source is not None
    assert source.current() == "from-a-file-0123456789"
    path.write_text("rotated-token-0123456789\n")
    now[0] += 1
    assert source.current() == "rotated-token-0123456789"
    literal = Settings.from_env({name: "literal-token-0123456789"})
    assert literal.api_token_file is None
    assert literal.supervisor_token_file is None
    # Built directly with only the file: the token is read from it.
    direct = Settings(api_token_file=path, supervisor_token_file=path)
    assert direct.api_token_value() == "rotated-token-0123456789"
    assert direct.supervisor_token_value() == "rotated-token-0123456789"
    assert Settings().api_token_source() is None


def test_token_file_errors_are_clear_and_never_quote_the_content(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("tiny")
    with pytest.raises(SettingsError, match=r"characters long") as err:
        Settings.from_env({"HARU_API_TOKEN_FILE": str(path)})
    assert "tiny" not in str(err.value)
    with pytest.raises(SettingsError, match="HARU_API_TOKEN_FILE: cannot read"):
        Settings.from_env({"HARU_API_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(SettingsError, match="either HARU_API_TOKEN or HARU_API_TOKEN_FILE"):
        Settings.from_env(
            {"HARU_API_TOKEN_FILE": str(path), "HARU_API_TOKEN": "inline-0123456789abc"}
        )


def test_http_bounds_are_settings() -> None:
    limits = Settings.from_env(
        {
            "HARU_HTTP_HEADER_TIMEOUT_MS": "2000",
            "HARU_HTTP_BODY_IDLE_TIMEOUT_MS": "3000",
            "HARU_HTTP_KEEPALIVE_TIMEOUT_MS": "4000",
            "HARU_HTTP_MAX_CONNECTIONS": "64",
        }
    ).http_limits
    assert (limits.header_timeout_s, limits.body_idle_timeout_s) == (2.0, 3.0)
    assert (limits.keepalive_timeout_s, limits.max_connections) == (4.0, 64)
    defaults = Settings().http_limits
    assert (defaults.header_timeout_s, defaults.body_idle_timeout_s) == (10.0, 30.0)


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


def test_sky_status_interval() -> None:
    assert Settings.from_env({}).sky_status_interval_ms == 10_000
    assert Settings.from_env({"HARU_SKY_STATUS_INTERVAL_MS": "0"}).sky_status_interval_ms == 0
    with pytest.raises(SettingsError, match="HARU_SKY_STATUS_INTERVAL_MS"):
        Settings.from_env({"HARU_SKY_STATUS_INTERVAL_MS": "-1"})


TOKEN = "tok-0123456789abcdef"


@pytest.mark.parametrize(
    ("env", "host"),
    [
        ({"HARU_HOST": "127.0.0.2"}, "127.0.0.2"),
        ({"HARU_HOST": " [::1] "}, "::1"),
        ({"HARU_HOST": "LOCALHOST"}, "localhost"),
        ({"HARU_HOST": "0.0.0.0", "HARU_API_TOKEN": TOKEN}, "0.0.0.0"),
        ({"HARU_HOST": "10.1.2.3", "HARU_API_TOKEN": TOKEN}, "10.1.2.3"),
        ({"HARU_HOST": "127.0.0.1", "HARU_API_TOKEN": TOKEN}, "127.0.0.1"),
        ({"HARU_HOST": "0.0.0.0", "HARU_ALLOW_OPEN_BIND": "1"}, "0.0.0.0"),
        ({"HARU_HOST": "::", "HARU_ALLOW_OPEN_BIND": "true"}, "::"),
        ({"HARU_HOST": "", "HARU_ALLOW_OPEN_BIND": "1"}, "127.0.0.1"),
    ],
)
def test_the_listening_address_is_settable(env: dict[str, str], host: str) -> None:
    settings = Settings.from_env(env)
    assert settings.host == host
    exposed = "HARU_API_TOKEN" not in env and host not in {"127.0.0.1", "127.0.0.2", "::1"}
    assert settings.open_to_network is (exposed and host != "localhost")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "haru.example.com"])
@pytest.mark.parametrize("opt_in", [None, "0", "false"])
def test_an_open_api_is_never_exposed_by_accident(host: str, opt_in: str | None) -> None:
    env = {"HARU_HOST": host}
    if opt_in is not None:
        env["HARU_ALLOW_OPEN_BIND"] = opt_in
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    message = str(caught.value)
    assert f"HARU_HOST={host} is not a loopback address" in message
    assert "HARU_API_TOKEN" in message
    assert "HARU_ALLOW_OPEN_BIND=1" in message


@pytest.mark.parametrize("value", ["not a host", "a..b", "-x.example", "1.2.3.4:80", "x" * 64])
def test_a_malformed_host_is_a_boot_error(value: str) -> None:
    with pytest.raises(SettingsError, match=r"^HARU_HOST must be an IP address or a host name"):
        Settings.from_env({"HARU_HOST": value, "HARU_API_TOKEN": TOKEN})


def test_a_malformed_opt_in_is_a_boot_error() -> None:
    with pytest.raises(SettingsError, match=r"^HARU_ALLOW_OPEN_BIND "):
        Settings.from_env({"HARU_HOST": "0.0.0.0", "HARU_ALLOW_OPEN_BIND": "perhaps"})


def test_direct_construction_applies_the_same_rule() -> None:
    with pytest.raises(ValidationError, match="not a loopback address"):
        Settings(bind_host="0.0.0.0")
    assert Settings(bind_host="0.0.0.0", allow_open_bind=True).host == "0.0.0.0"


def test_clock_offset_file_is_a_test_hook_off_by_default(tmp_path: Path) -> None:
    assert Settings.from_env({}).clock_offset_file is None
    db = {"DATABASE_URL": str(tmp_path / "haru.db")}
    # The app's clock is the database's; the offset hook shifts only the local clock it is
    # compared with.
    clock = create_app(Settings.from_env(db))[clock_key]
    assert isinstance(clock, StoreClock)
    assert clock.local is utc_now
    assert clock.max_skew == timedelta(milliseconds=2000)
    path = tmp_path / "offset"
    settings = Settings.from_env(
        {**db, "HARU_CLOCK_OFFSET_FILE": str(path), "HARU_MAX_CLOCK_SKEW_MS": "500"}
    )
    assert settings.clock_offset_file == path
    clock = create_app(settings)[clock_key]
    assert isinstance(clock, StoreClock)
    assert isinstance(clock.local, OffsetFileClock)
    assert clock.local.path == path
    assert clock.max_skew == timedelta(milliseconds=500)


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_clock_skew_bound_is_a_boot_error(value: str) -> None:
    with pytest.raises(SettingsError, match="HARU_MAX_CLOCK_SKEW_MS"):
        Settings.from_env({"HARU_MAX_CLOCK_SKEW_MS": value})


def test_per_peer_bound_and_trusted_proxies_from_the_environment() -> None:
    limits = Settings.from_env(
        {"HARU_HTTP_MAX_CONNECTIONS_PER_PEER": "8", "HARU_TRUSTED_PROXIES": " 10.0.0.0/8 , ::1"}
    ).http_limits
    assert limits.max_connections_per_peer == 8
    assert [str(n) for n in limits.trusted_proxies] == ["10.0.0.0/8", "::1/128"]
    defaults = Settings.from_env({}).http_limits
    assert (defaults.max_connections_per_peer, defaults.trusted_proxies) == (256, ())
    with pytest.raises(SettingsError, match="HARU_TRUSTED_PROXIES"):
        Settings.from_env({"HARU_TRUSTED_PROXIES": "proxy.example"})
    with pytest.raises(SettingsError, match="HARU_HTTP_MAX_CONNECTIONS_PER_PEER"):
        Settings.from_env({"HARU_HTTP_MAX_CONNECTIONS_PER_PEER": "0"})
