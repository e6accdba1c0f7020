from __future__ import annotations

import re

import pytest
from haru_driver_skypilot import (
    MAX_NAME_LENGTH,
    InvalidSpecError,
    TaskSpec,
    check_name,
    cluster_name,
    is_valid_name,
    legacy_cluster_name,
)
from haru_protocol import Placement
from hypothesis import given
from hypothesis import strategies as st

# SkyPilot's own rule (sky/skylet/constants.py CLUSTER_NAME_VALID_REGEX), plus DNS length.
SKYPILOT_NAME_RE = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")
DNS_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")

slugs = st.from_regex(r"\A[a-z0-9]{1,20}(-[a-z0-9]{1,20}){0,3}\Z").filter(lambda s: len(s) <= 63)


def placement(**overrides: object) -> Placement:
    fields: dict[str, object] = {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"}
    fields.update(overrides)
    return Placement.model_validate(fields)


def test_short_names_are_prefixed_and_joined() -> None:
    assert cluster_name("prod", "alpha") == "haru-prod--alpha"


def test_hyphenated_slugs_never_share_a_name() -> None:
    # The old `haru-<fleet>-<domain>` gave both pairs `haru-prod-eu-alpha`.
    assert legacy_cluster_name("prod-eu", "alpha") == legacy_cluster_name("prod", "eu-alpha")
    assert cluster_name("prod-eu", "alpha") != cluster_name("prod", "eu-alpha")


@given(slugs, slugs, slugs, slugs)
def test_distinct_pairs_get_distinct_names(a: str, b: str, c: str, d: str) -> None:
    if (a, b) != (c, d):
        assert cluster_name(a, b) != cluster_name(c, d)


def test_a_name_of_exactly_63_chars_is_kept() -> None:
    domain = "d" * (63 - len("haru-f--"))
    assert cluster_name("f", domain) == f"haru-f--{domain}"
    assert len(cluster_name("f", domain)) == MAX_NAME_LENGTH


def test_long_names_are_cut_and_hashed() -> None:
    fleet = "f" * 40
    name = cluster_name(fleet, "domain-" + "x" * 40)
    assert len(name) <= MAX_NAME_LENGTH
    assert name.startswith("haru-" + fleet)
    assert re.fullmatch(r".*-[0-9a-f]{8}", name)
    assert is_valid_name(name)


def test_hash_is_stable_and_separates_pairs_sharing_a_prefix() -> None:
    fleet = "shared-" + "p" * 50
    first = cluster_name(fleet, "one")
    assert first == cluster_name(fleet, "one")
    assert first != cluster_name(fleet, "two")
    assert first[:-9] == cluster_name(fleet, "two")[:-9]


def test_a_cut_on_a_hyphen_never_leaves_a_double_hyphen_or_trailing_hyphen() -> None:
    # "haru-" + fleet puts a hyphen exactly at the cut position (index 53).
    fleet = "a" * 47 + "-b"
    name = cluster_name(fleet, "c" * 20)
    assert "--" not in name
    assert not name.endswith("-")
    assert "---" not in cluster_name("a" * 30, "b" * 40)
    assert is_valid_name(name)


@given(slugs, slugs)
def test_derived_names_are_always_valid(fleet: str, domain: str) -> None:
    name = cluster_name(fleet, domain)
    assert len(name) <= MAX_NAME_LENGTH
    assert DNS_LABEL_RE.fullmatch(name)
    assert SKYPILOT_NAME_RE.fullmatch(name)


@pytest.mark.parametrize(
    ("fleet", "domain"), [("", "a"), ("A", "b"), ("a", "b_c"), ("a-", "b"), ("x" * 64, "b")]
)
def test_non_slugs_are_rejected(fleet: str, domain: str) -> None:
    with pytest.raises(InvalidSpecError, match="slug"):
        cluster_name(fleet, domain)


@pytest.mark.parametrize("name", ["", "1abc", "-abc", "abc-", "ABC", "a_b", "a.b", "a" * 64])
def test_check_name_rejects_invalid_names(name: str) -> None:
    assert not is_valid_name(name)
    with pytest.raises(InvalidSpecError):
        check_name(name)


def test_spec_defaults() -> None:
    spec = TaskSpec(name="haru-a-b", placement=placement(), run="serve")
    assert spec.ports == ()
    assert dict(spec.envs) == {}
    assert spec.setup is None


def test_spec_copies_envs_and_ports() -> None:
    envs = {"A": "1"}
    ports = [8000]
    spec = TaskSpec(name="haru-a-b", placement=placement(), run="x", envs=envs, ports=ports)  # type: ignore[arg-type]
    envs["A"] = "2"
    ports.append(1)
    assert spec.envs["A"] == "1"
    assert spec.ports == (8000,)
    with pytest.raises(TypeError):
        spec.envs["A"] = "3"  # type: ignore[index]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "Bad_Name"}, "DNS label"),
        ({"run": "  "}, "run"),
        ({"setup": ""}, "setup"),
        ({"ports": (0,)}, "TCP port"),
        ({"ports": (65536,)}, "TCP port"),
        ({"ports": (True,)}, "TCP port"),
        ({"ports": ("8000",)}, "TCP port"),
        ({"ports": (8000, 8000)}, "unique"),
        ({"envs": {"1BAD": "x"}}, "variable name"),
        ({"envs": {"A-B": "x"}}, "variable name"),
        ({"envs": {"PORT": 8000}}, "string"),
        ({"placement": placement(region="us/east")}, "infra"),
        ({"placement": placement(region="us east")}, "infra"),
        ({"placement": placement(accelerator="L4:2")}, "accelerator"),
    ],
)
def test_spec_rejects_what_skypilot_would_misread(
    overrides: dict[str, object], message: str
) -> None:
    fields: dict[str, object] = {"name": "haru-a-b", "placement": placement(), "run": "x"}
    fields.update(overrides)
    with pytest.raises(InvalidSpecError, match=message):
        TaskSpec(**fields)  # type: ignore[arg-type]


def test_kubernetes_context_may_contain_a_slash() -> None:
    context = "arn:aws:eks:us-east-1:123:cluster/gpu"
    spec = TaskSpec(
        name="haru-a-b", placement=placement(cloud="kubernetes", region=context), run="x"
    )
    assert spec.placement.region == context


def test_invalid_spec_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="DNS label"):
        TaskSpec(name="", placement=placement(), run="x")
