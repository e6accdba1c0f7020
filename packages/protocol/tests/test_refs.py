from __future__ import annotations

from uuid import UUID

import pytest
from haru_protocol import MAX_FLEET_REF_LENGTH, FleetRef, parse_fleet_ref

LOWER = "0b0c4a2e-1d2f-4b5a-9c8d-7e6f5a4b3c2d"
UPPER = LOWER.upper()
OTHER = UUID("11111111-2222-4333-8444-555555555555")


def test_a_slug_names_a_slug_only() -> None:
    ref = parse_fleet_ref("prod-eu")
    assert ref == FleetRef("prod-eu", None, "prod-eu")
    assert not ref.names_nothing
    assert ref.key == "prod-eu"


def test_a_lowercase_uuid_is_an_id_first_and_a_slug_second() -> None:
    ref = parse_fleet_ref(LOWER)
    assert ref.id == UUID(LOWER)
    assert ref.slug == LOWER  # a slug may look like a UUID
    assert ref.key == LOWER


def test_an_uppercase_uuid_is_an_id_only() -> None:
    ref = parse_fleet_ref(UPPER)
    assert ref.id == UUID(LOWER)
    assert ref.slug is None  # slugs are lowercase
    assert ref.key == LOWER  # ids compare lowercase


def test_mixed_case_uuid_is_an_id() -> None:
    mixed = LOWER[:9] + LOWER[9:].upper()
    assert parse_fleet_ref(mixed).id == UUID(LOWER)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "\n",
        LOWER + "\n",  # GET /v1/fleets/<uuid>%0A answered 500 before
        "\n" + LOWER,
        LOWER + " ",
        " " + LOWER,
        "\t" + LOWER,
        "prod\n",
        " prod",
        "prod ",
        "pr od",
        "Prod",  # slugs are case-sensitive and lowercase
        "prod-",
        "-prod",
        "pr--od",
        "prod\x00",
        "prød",  # non-ASCII
        "\u0661\u0662",  # Arabic-Indic digits: str.isdigit() says yes, the rule says no
        "\uff10" + LOWER[1:],  # fullwidth digit zero
        "{" + LOWER + "}",  # uuid.UUID accepts braces; the rule does not
        "urn:uuid:" + LOWER,
        LOWER.replace("-", ""),  # hyphen-free hex: a slug, never an id
        LOWER + "0",
        "a" * (MAX_FLEET_REF_LENGTH + 1),
        "a" * 10_000,
    ],
)
def test_neither_an_id_nor_an_id_shaped_slug(text: str) -> None:
    ref = parse_fleet_ref(text)
    assert ref.id is None
    assert ref.text == text
    assert ref.key == text


@pytest.mark.parametrize(
    "text",
    ["", " ", "\n", LOWER + "\n", "prod\n", " prod", "Prod", "prød", "a" * 64, "a" * 10_000],
)
def test_references_that_name_nothing(text: str) -> None:
    ref = parse_fleet_ref(text)
    assert ref.names_nothing
    assert ref.choose({UUID(LOWER): "prod"}) is None


def test_longest_slug_is_accepted() -> None:
    text = "a" * MAX_FLEET_REF_LENGTH
    assert parse_fleet_ref(text).slug == text


def test_hyphen_free_hex_is_a_slug_not_an_id() -> None:
    text = LOWER.replace("-", "")
    ref = parse_fleet_ref(text)
    assert (ref.id, ref.slug) == (None, text)


def test_choose_prefers_the_id_match() -> None:
    by_id = UUID(LOWER)
    candidates = {OTHER: LOWER, by_id: "prod"}  # OTHER's slug looks like by_id's id
    assert parse_fleet_ref(LOWER).choose(candidates) == by_id
    assert parse_fleet_ref(UPPER).choose(candidates) == by_id
    # Without an id match, the UUID-looking slug names its fleet (lowercase only).
    assert parse_fleet_ref(LOWER).choose({OTHER: LOWER}) == OTHER
    assert parse_fleet_ref(UPPER).choose({OTHER: LOWER}) is None
    assert parse_fleet_ref("prod").choose(candidates) == by_id
    assert parse_fleet_ref("staging").choose(candidates) is None


def test_a_uuid_shaped_slug_is_never_an_alias_of_another_fleet() -> None:
    assert not parse_fleet_ref(LOWER).may_alias(OTHER)
    assert parse_fleet_ref(LOWER).may_alias(UUID(LOWER))
    assert parse_fleet_ref(UPPER).may_alias(UUID(LOWER))
    assert parse_fleet_ref("prod").may_alias(OTHER)
