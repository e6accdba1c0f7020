"""Package data: the example layout and the committed JSON Schemas (drift test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from haru_protocol import (
    FleetLayout,
    InferenceSlotSpec,
    TrainingSlotSpec,
    example_layout_json,
    json_schemas,
    load_example_layout,
    render_json_schemas,
)
from haru_protocol.schemas import main, write_schemas

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"
REGENERATE = "uv run python -m haru_protocol.schemas"


def test_example_layout_validates() -> None:
    layout = load_example_layout()
    assert isinstance(layout, FleetLayout)
    assert FleetLayout.model_validate_json(example_layout_json()) == layout
    assert [d.slug for d in layout.domains] == ["alpha", "beta"]
    assert layout.active_domain_slug == "alpha"


def test_example_layout_shape_is_the_documented_one() -> None:
    layout = load_example_layout()
    for domain in layout.domains:
        inference = {s.gpu_index: s for s in domain.slots if isinstance(s, InferenceSlotSpec)}
        training = {s.gpu_index for s in domain.slots if isinstance(s, TrainingSlotSpec)}
        assert [m.name for m in inference[0].models] == [
            "example-chat-small",
            "example-chat-medium",
        ]
        assert [m.name for m in inference[1].models] == ["example-chat-large"]
        assert training == {0, 1}
        assert domain.placement.accelerator == "EXAMPLE-GPU"


def test_example_layout_uses_only_generic_names() -> None:
    text = example_layout_json().lower()
    # No real model families or GPU products: Haru hard-codes none of them.
    for real in [
        "llama",
        "qwen",
        "mistral",
        "gemma",
        "gpt",
        "a100",
        "h100",
        "h200",
        "l4",
        "t4",
        "a10g",
        "v100",
        "nvidia",
        "phi-",
        "deepseek",
    ]:
        assert not re.search(rf"(?<![a-z0-9]){re.escape(real)}", text), real
    layout = load_example_layout()
    names = {m.name for d in layout.domains for s in d.inference_slots for m in s.models}
    assert all(n.startswith("example-") for n in names)


def test_committed_schemas_have_not_drifted() -> None:
    rendered = render_json_schemas()
    committed = {p.name for p in SCHEMA_DIR.glob("*.json")}
    assert committed == set(rendered), f"schema files differ; run `{REGENERATE}`"
    for name, text in rendered.items():
        assert (SCHEMA_DIR / name).read_text(encoding="utf-8") == text, (
            f"{name} is stale; run `{REGENERATE}`"
        )


def test_schemas_describe_camel_case_and_strictness() -> None:
    layout = json_schemas()["fleet-layout.schema.json"]
    assert {"slug", "activeDomainSlug", "domains", "$schema"} <= set(layout["properties"])
    assert layout["additionalProperties"] is False
    assert layout["required"] == ["slug", "domains"]
    config = json_schemas()["supervisor-config.schema.json"]
    assert config["additionalProperties"] is False
    assert set(config["properties"]) == {"$schema", "slots"}


def test_schema_files_are_stable_json() -> None:
    for name, text in render_json_schemas().items():
        assert text.endswith("}\n"), name
        assert json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n" == text


def test_regenerate_writes_the_rendered_files(tmp_path: Path) -> None:
    written = write_schemas(tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(render_json_schemas())
    for path in written:
        assert path.read_text(encoding="utf-8") == render_json_schemas()[path.name]
    assert main([str(tmp_path / "cli")]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == sorted(render_json_schemas())


def test_schema_command_help_prints_usage_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_schema_command_rejects_unknown_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--output", "x"])
    assert exit_info.value.code == 2
    assert list(tmp_path.iterdir()) == []
