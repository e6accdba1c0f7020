"""Pure rendering of a :class:`TaskSpec` into SkyPilot task YAML (DESIGN 8)."""

from __future__ import annotations

from typing import Any

import yaml

from haru_driver_skypilot._spec import TaskSpec


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line scripts as literal blocks, so they read as scripts."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(config: dict[str, Any]) -> str:
    """Serialise a SkyPilot config dict: safe types only, keys in insertion order.

    Multi-line strings become literal blocks (``|``); anything PyYAML cannot write as a block
    falls back to a quoted scalar, so the result always loads back to ``config``.
    """
    return yaml.dump(
        config,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )


def task_config(spec: TaskSpec) -> dict[str, Any]:
    """The task YAML of ``spec`` as a dict (what :func:`render_task_yaml` serialises)."""
    placement = spec.placement
    resources: dict[str, Any] = {
        "infra": f"{placement.cloud.value}/{placement.region}",
        "accelerators": f"{placement.accelerator}:{placement.accelerator_count}",
        "use_spot": placement.use_spot,
    }
    if spec.ports:
        resources["ports"] = list(spec.ports)
    config: dict[str, Any] = {"name": spec.name, "resources": resources}
    if spec.envs:
        config["envs"] = dict(spec.envs)
    if spec.secrets:
        config["secrets"] = dict.fromkeys(spec.secrets)
    if spec.setup is not None:
        config["setup"] = spec.setup
    config["run"] = spec.run
    return config


def render_task_yaml(spec: TaskSpec) -> str:
    """Render ``spec`` as SkyPilot task YAML.

    Shape: ``name``, ``resources`` (``infra: <cloud>/<region>``, ``accelerators:
    "<ACC>:<N>"``, ``use_spot``, ``ports`` when any), ``envs`` when any (string values),
    ``setup`` when given, ``run``. ``infra`` replaces the deprecated ``cloud``/``region``
    keys (SkyPilot >= 0.10 rejects giving both).
    """
    return dump_yaml(task_config(spec))
