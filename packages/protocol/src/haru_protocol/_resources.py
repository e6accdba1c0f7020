"""Package data: the example layout and the JSON Schemas generated from the models."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from haru_protocol._events import event_json_schema
from haru_protocol._layout import FleetLayout
from haru_protocol._supervisor import SupervisorConfig

EXAMPLE_LAYOUT_RESOURCE = "examples/example-fleet.json"


def example_layout_json() -> str:
    """Text of the bundled two-domain example layout (DESIGN 3.4)."""
    return (
        resources.files("haru_protocol")
        .joinpath(EXAMPLE_LAYOUT_RESOURCE)
        .read_text(encoding="utf-8")
    )


def load_example_layout() -> FleetLayout:
    """The bundled example layout, validated."""
    return FleetLayout.model_validate_json(example_layout_json())


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schemas of the operator documents and the audit events, by file name."""
    return {
        "event.schema.json": event_json_schema(),
        "fleet-layout.schema.json": FleetLayout.model_json_schema(by_alias=True),
        "supervisor-config.schema.json": SupervisorConfig.model_json_schema(by_alias=True),
    }


def render_json_schemas() -> dict[str, str]:
    """The schema files exactly as committed (stable key order, trailing newline)."""
    return {
        name: json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in json_schemas().items()
    }
