"""Start-up settings parsed from the environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from haru_protocol import SupervisorConfig
from haru_supervisor._users import check_run_as
from haru_supervisor.api import Settings, SettingsError, load_config, load_settings
from pydantic import SecretStr, ValidationError

CONFIG: dict[str, Any] = {
    "slots": [
        {"kind": "inference", "gpuIndex": 0, "models": [{"name": "chat-small", "port": 8001}]},
        {
            "kind": "training",
            "gpuIndex": 1,
            "command": ["python", "train.py", "--lora"],
            "checkpointDir": "/var/lib/haru/ckpt",
        },
    ]
}


def test_inline_json_and_defaults() -> None:
    settings = load_settings({"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG)})
    assert settings.port == 8701
    assert settings.token is None
    assert settings.host == "127.0.0.1"
    assert settings.gpu_source == "auto"
    assert settings.shutdown_grace_s == 30.0
    assert settings.stop_grace_s == 30.0
    assert [slot.gpu_index for slot in settings.config.training_slots] == [1]
    assert settings.config.training_slots[0].command == ("python", "train.py", "--lora")


def test_config_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "supervisor.json"
    path.write_text(json.dumps(CONFIG | {"$schema": "https://example.invalid/s.json"}))
    settings = load_settings({"HARU_SUPERVISOR_CONFIG": f"  {path}\n"})
    assert settings.config.inference_slots[0].models[0].port == 8001


def test_a_token_binds_every_interface_and_is_trimmed() -> None:
    settings = load_settings(
        {
            "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
            "HARU_SUPERVISOR_TOKEN": "  abc123-0123456789  ",
        }
    )
    assert settings.token_value() == "abc123-0123456789"
    assert settings.host == "0.0.0.0"
    for text in (repr(settings), str(settings), settings.model_dump_json()):
        assert "abc123" not in text


def test_a_blank_token_counts_as_unset() -> None:
    settings = load_settings(
        {"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG), "HARU_SUPERVISOR_TOKEN": "   "}
    )
    assert settings.token is None
    assert settings.host == "127.0.0.1"


def test_the_trainer_environment_holds_no_secret() -> None:
    settings = load_settings(
        {
            "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
            "HARU_SUPERVISOR_TOKEN": "tok-42-secret-0123456789",
            "SAME_TOKEN": "tok-42-secret-0123456789",
            "DB_URL": "postgres://u:tok-42-secret-0123456789@h/db",
            "HOME": "/root",
            "PATH": "/usr/bin",
        }
    )
    # The token variable and exact copies go; a value merely containing the token stays.
    assert dict(settings.trainer_env) == {
        "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
        "DB_URL": "postgres://u:tok-42-secret-0123456789@h/db",
        "HOME": "/root",
        "PATH": "/usr/bin",
    }
    assert settings.search_path == "/usr/bin"


def test_settings_built_directly_also_strip_the_token() -> None:
    settings = Settings(
        config=load_config(json.dumps(CONFIG)),
        token=SecretStr("t0k-0123456789abcdef"),
        trainer_env={"HARU_SUPERVISOR_TOKEN": "t0k-0123456789abcdef", "A": "b"},
    )
    assert dict(settings.trainer_env) == {"A": "b"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PORT": "9000"}, ("port", 9000)),
        ({"PORT": "0"}, ("port", 0)),
        ({"PORT": " "}, ("port", 8701)),
        ({"HARU_SUPERVISOR_GPU_SOURCE": "NVML"}, ("gpu_source", "nvml")),
        ({"HARU_SUPERVISOR_GPU_SOURCE": "nvidia-smi"}, ("gpu_source", "nvidia-smi")),
        ({"HARU_SUPERVISOR_GPU_SOURCE": ""}, ("gpu_source", "auto")),
        ({"HARU_SUPERVISOR_SHUTDOWN_GRACE_MS": "1500"}, ("shutdown_grace_s", 1.5)),
        ({"HARU_SUPERVISOR_SHUTDOWN_GRACE_MS": "0"}, ("shutdown_grace_s", 0.0)),
    ],
)
def test_optional_variables(env: dict[str, str], expected: tuple[str, object]) -> None:
    settings = load_settings({"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG), **env})
    name, value = expected
    assert getattr(settings, name) == value


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "HARU_SUPERVISOR_CONFIG is required"),
        ({"HARU_SUPERVISOR_CONFIG": "  "}, "HARU_SUPERVISOR_CONFIG is required"),
        ({"HARU_SUPERVISOR_CONFIG": "/nonexistent/supervisor.json"}, "cannot read file"),
        ({"HARU_SUPERVISOR_CONFIG": "{not json"}, "not valid JSON"),
        ({"HARU_SUPERVISOR_CONFIG": '{"slots": []}'}, "invalid"),
        (
            {"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG | {"extra": 1})},
            "Extra inputs are not permitted",
        ),
        (
            {
                "HARU_SUPERVISOR_CONFIG": json.dumps(
                    {
                        "slots": [
                            {
                                "kind": "inference",
                                "gpuIndex": 0,
                                "models": [{"name": "A", "port": 1}],
                            }
                        ]
                    }
                )
            },
            "lowercase",
        ),
        (
            {
                "HARU_SUPERVISOR_CONFIG": json.dumps(
                    {"slots": [CONFIG["slots"][0], CONFIG["slots"][0]]}
                )
            },
            "duplicate inference slot on GPU 0",
        ),
        ({"PORT": "http"}, "PORT must be an integer"),
        ({"PORT": "70000"}, "PORT must be an integer"),
        ({"PORT": "-1"}, "PORT must be an integer"),
        ({"HARU_SUPERVISOR_GPU_SOURCE": "cuda"}, "HARU_SUPERVISOR_GPU_SOURCE must be one of"),
        ({"HARU_SUPERVISOR_SHUTDOWN_GRACE_MS": "soon"}, "non-negative integer"),
        ({"HARU_SUPERVISOR_SHUTDOWN_GRACE_MS": "+5"}, "non-negative integer"),
        ({"HARU_SUPERVISOR_SHUTDOWN_GRACE_MS": "2147483648"}, "SHUTDOWN_GRACE_MS"),
        (
            {"HARU_SUPERVISOR_GPU_SOURCE": "cuda", "PORT": "x"},
            "PORT must be an integer.*; HARU_SUPERVISOR_GPU_SOURCE must be one of",
        ),
        ({"PORT": "\u0661"}, "PORT must be an integer"),
        ({"HARU_SUPERVISOR_TOKEN": "short-tok"}, "HARU_SUPERVISOR_TOKEN is 9 characters long"),
        ({"HARU_HTTP_HEADER_TIMEOUT_MS": "0"}, "HARU_HTTP_HEADER_TIMEOUT_MS"),
        ({"HARU_HTTP_MAX_CONNECTIONS": "1_0"}, "HARU_HTTP_MAX_CONNECTIONS"),
    ],
)
def test_invalid_settings(env: dict[str, str], match: str) -> None:
    env = {"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG)} | env if env else env
    with pytest.raises(SettingsError, match=match):
        load_settings(env)


def test_an_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read file"):
        load_config(str(tmp_path))  # a directory


def test_the_token_can_come_from_a_file_kept_out_of_the_trainers(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-a-file-0123456789\n")
    settings = load_settings(
        {
            "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
            "HARU_SUPERVISOR_TOKEN_FILE": str(path),
            "HOME": "/root",
        }
    )
    assert settings.token_value() == "from-a-file-0123456789"
    assert settings.host == "0.0.0.0"
    assert dict(settings.trainer_env) == {
        "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
        "HOME": "/root",
    }


def test_the_token_file_is_followed_with_an_overlap(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-a-file-0123456789\n")
    env = {
        "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
        "HARU_SUPERVISOR_TOKEN_FILE": str(path),
        "HARU_SUPERVISOR_TOKEN_OVERLAP_MS": "2000",
    }
    settings = load_settings(env)
    assert settings.token_overlap_ms == 2000
    assert load_settings({**env, "HARU_SUPERVISOR_TOKEN_OVERLAP_MS": ""}).token_overlap_ms == (
        300_000
    )
    now = [0.0]
    source = settings.token_source(monotonic=lambda: now[0])
    assert source is not None
    path.write_text("rotated-token-0123456789\n")
    now[0] += 1
    assert source.current() == "rotated-token-0123456789"
    assert source.matches("Bearer from-a-file-0123456789")  # within the overlap
    now[0] += 2
    assert not source.matches("Bearer from-a-file-0123456789")
    assert source.matches("Bearer rotated-token-0123456789")
    with pytest.raises(SettingsError, match="HARU_SUPERVISOR_TOKEN_OVERLAP_MS"):
        load_settings({**env, "HARU_SUPERVISOR_TOKEN_OVERLAP_MS": "soon"})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"HARU_SUPERVISOR_TOKEN": "inline-0123456789abc"}, "not both"),
        ({}, "cannot read"),
    ],
)
def test_token_file_errors(tmp_path: Path, extra: dict[str, str], match: str) -> None:
    env = {
        "HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG),
        "HARU_SUPERVISOR_TOKEN_FILE": str(tmp_path / ("missing" if not extra else "t")),
        **extra,
    }
    (tmp_path / "t").write_text("file-token-0123456789")
    with pytest.raises(SettingsError, match=match) as err:
        load_settings(env)
    assert "0123456789" not in str(err.value)


def test_settings_are_frozen_and_bounds_are_settings() -> None:
    settings = load_settings(
        {"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG), "HARU_HTTP_HEADER_TIMEOUT_MS": "2500"}
    )
    assert settings.http_limits.header_timeout_s == 2.5
    assert settings.http_limits.body_idle_timeout_s == 30.0
    with pytest.raises(ValidationError, match="frozen"):
        settings.port = 1  # type: ignore[misc]


def _with_run_as(user: str) -> str:
    slots = [*CONFIG["slots"]]
    return json.dumps(
        {
            "slots": [
                *slots,
                {
                    "kind": "training",
                    "gpuIndex": 7,
                    "command": ["/bin/true"],
                    "checkpointDir": "/var/lib/haru/ck7",
                    "runAs": user,
                },
            ]
        }
    )


def test_run_as_an_unknown_user_is_refused_at_load() -> None:
    with pytest.raises(SettingsError, match=r"runAs 'no-such-user-haru'.*no such user"):
        load_config(_with_run_as("no-such-user-haru"))


def test_run_as_needs_a_root_supervisor() -> None:
    config = SupervisorConfig.model_validate_json(_with_run_as("nobody"))
    with pytest.raises(SettingsError, match="needs the supervisor to run as root"):
        check_run_as(config, euid=lambda: 1000)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="runAs needs a root supervisor; tests run as non-root"
)
def test_run_as_an_existing_user_loads_as_root() -> None:
    config = load_config(_with_run_as("nobody"))
    assert config.training_slots[-1].run_as == "nobody"


@pytest.mark.parametrize(
    ("env", "host", "exposed"),
    [
        ({"HARU_HOST": "127.0.0.1"}, "127.0.0.1", False),
        ({"HARU_HOST": "[::1]"}, "::1", False),
        ({"HARU_HOST": "0.0.0.0", "HARU_SUPERVISOR_TOKEN": "abc123-0123456789"}, "0.0.0.0", False),
        (
            {"HARU_HOST": "10.0.0.7", "HARU_SUPERVISOR_TOKEN": "abc123-0123456789"},
            "10.0.0.7",
            False,
        ),
        ({"HARU_HOST": "0.0.0.0", "HARU_ALLOW_OPEN_BIND": "1"}, "0.0.0.0", True),
    ],
)
def test_the_listening_address_is_settable(env: dict[str, str], host: str, exposed: bool) -> None:
    settings = load_settings({"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG), **env})
    assert settings.host == host
    assert settings.open_to_network is exposed


@pytest.mark.parametrize("opt_in", [None, "0", "no"])
def test_an_open_supervisor_is_never_exposed_by_accident(opt_in: str | None) -> None:
    env = {"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG), "HARU_HOST": "0.0.0.0"}
    if opt_in is not None:
        env["HARU_ALLOW_OPEN_BIND"] = opt_in
    with pytest.raises(SettingsError) as caught:
        load_settings(env)
    message = str(caught.value)
    assert message.startswith("HARU_HOST=0.0.0.0 is not a loopback address")
    assert "HARU_SUPERVISOR_TOKEN" in message
    assert "HARU_ALLOW_OPEN_BIND=1" in message


def test_a_malformed_supervisor_host_is_a_boot_error() -> None:
    with pytest.raises(SettingsError, match=r"^HARU_HOST must be an IP address or a host name"):
        load_settings({"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG), "HARU_HOST": "a b"})


def test_per_peer_bound_and_trusted_proxies_from_the_environment() -> None:
    base = {"HARU_SUPERVISOR_CONFIG": json.dumps(CONFIG)}
    limits = load_settings(
        {**base, "HARU_HTTP_MAX_CONNECTIONS_PER_PEER": "8", "HARU_TRUSTED_PROXIES": "192.0.2.7"}
    ).http_limits
    assert limits.max_connections_per_peer == 8
    assert [str(n) for n in limits.trusted_proxies] == ["192.0.2.7/32"]
    assert load_settings(base).http_limits.trusted_proxies == ()
    with pytest.raises(SettingsError, match="HARU_TRUSTED_PROXIES"):
        load_settings({**base, "HARU_TRUSTED_PROXIES": "10.0.0.0/33"})
    with pytest.raises(SettingsError, match="HARU_HTTP_MAX_CONNECTIONS_PER_PEER"):
        load_settings({**base, "HARU_HTTP_MAX_CONNECTIONS_PER_PEER": "-1"})
