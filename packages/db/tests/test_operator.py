"""The helpers behind `haru db upgrade` and `haru seed`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from haru_db import (
    LayoutFileError,
    SchemaOutdatedError,
    StateStore,
    downgrade,
    load_layout_file,
    seed_layout_file,
)
from haru_db.testing import DatabaseUrlFactory
from haru_protocol import example_layout_json, load_example_layout


def test_load_the_example_layout(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(example_layout_json(), encoding="utf-8")
    assert load_layout_file(path) == load_example_layout()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "invalid"),
        (json.dumps({"slug": "x", "domains": [], "typo": 1}), r"domains: .*typo: "),
        (b"\xff\xfe\x00", "cannot read"),
    ],
)
def test_bad_layout_files(tmp_path: Path, content: str | bytes | None, message: str) -> None:
    path = tmp_path / "fleet.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(LayoutFileError, match=message):
        load_layout_file(path)


async def test_seed_is_idempotent(
    database_url_factory: DatabaseUrlFactory, tmp_path: Path, now: datetime
) -> None:
    url = await database_url_factory()
    path = tmp_path / "fleet.json"
    path.write_text(example_layout_json(), encoding="utf-8")
    first = await seed_layout_file(url, path, at=now)
    assert (first.fleet_created, first.domains_created, first.pointer_set) == (True, 2, True)
    again = await seed_layout_file(url, str(path))
    assert not again.changed
    store = StateStore.open(url)
    try:
        snapshot = await store.get_fleet_snapshot(load_example_layout().slug)
    finally:
        await store.close()
    assert snapshot is not None
    assert snapshot.id == first.fleet_id


async def test_seed_validates_before_touching_the_database(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(LayoutFileError):
        await seed_layout_file("postgresql://nobody:secret@127.0.0.1:1/none", path)


async def test_seed_needs_a_migrated_database(
    database_url_factory: DatabaseUrlFactory, tmp_path: Path
) -> None:
    url = await database_url_factory()
    await downgrade(url)
    path = tmp_path / "fleet.json"
    path.write_text(example_layout_json(), encoding="utf-8")
    with pytest.raises(SchemaOutdatedError, match="haru db upgrade"):
        await seed_layout_file(url, path)
