from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from haru_driver_skypilot import (
    TaskSpec,
    cluster_name,
    dump_yaml,
    example_domain_task,
    render_task_yaml,
    task_config,
)
from haru_protocol import Cloud, Placement

GOLDEN_DIR = Path(__file__).parent / "golden"


def golden_specs() -> dict[str, TaskSpec]:
    """Representative launch specs; each has a committed render in tests/golden/<key>.yaml."""
    return {
        "aws-on-demand": TaskSpec(
            name=cluster_name("demo", "alpha"),
            placement=Placement(
                cloud=Cloud.AWS, region="us-east-1", accelerator="A100-80GB", accelerator_count=1
            ),
            ports=(8000,),
            envs={"MODEL_NAME": "example-chat-small", "PORT": "8000", "HF_HOME": "/data/hf"},
            setup="pip install 'vllm==0.11.0'\nmkdir -p /data/hf\n",
            run=(
                'vllm serve "$MODEL_NAME" --port "$PORT" \\\n'
                '  --enable-sleep-mode --served-model-name "$MODEL_NAME"\n'
            ),
        ),
        "gcp-spot-ports": TaskSpec(
            name=cluster_name("demo", "beta"),
            placement=Placement(
                cloud=Cloud.GCP,
                region="us-central1",
                accelerator="L4",
                accelerator_count=2,
                use_spot=True,
            ),
            ports=(8000, 8001, 9100),
            run="python -m haru_supervisor",
        ),
        "kubernetes-long-name": TaskSpec(
            name=cluster_name(
                "a-fleet-with-a-rather-long-descriptive-slug", "training-domain-in-region-two"
            ),
            placement=Placement(
                cloud=Cloud.KUBERNETES,
                region="gke_proj_us-east4_gpu",
                accelerator="H100",
                accelerator_count=8,
            ),
            envs={"CHECKPOINT_DIR": "/ckpt", "EMPTY": ""},
            run="torchrun --nproc-per-node 8 train.py",
        ),
        "domain-standby-two-gpus": example_domain_task(start_asleep=True),
    }


GOLDEN = golden_specs()


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_render_matches_committed_golden(key: str) -> None:
    expected = (GOLDEN_DIR / f"{key}.yaml").read_text(encoding="utf-8")
    assert render_task_yaml(GOLDEN[key]) == expected


def test_every_golden_file_has_a_spec() -> None:
    on_disk = {p.stem for p in GOLDEN_DIR.glob("*.yaml")}
    assert on_disk == set(GOLDEN)


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_render_loads_back_to_the_config(key: str) -> None:
    spec = GOLDEN[key]
    assert yaml.safe_load(render_task_yaml(spec)) == task_config(spec)


def test_resources_use_infra_and_a_counted_accelerator_string() -> None:
    config = task_config(GOLDEN["gcp-spot-ports"])
    resources = config["resources"]
    assert resources == {
        "infra": "gcp/us-central1",
        "accelerators": "L4:2",
        "use_spot": True,
        "ports": [8000, 8001, 9100],
    }
    # `infra` and `cloud`/`region` together are an error in SkyPilot >= 0.10.
    assert "cloud" not in resources
    assert "region" not in resources


def test_count_of_one_is_still_written() -> None:
    loaded = yaml.safe_load(render_task_yaml(GOLDEN["aws-on-demand"]))
    assert loaded["resources"]["accelerators"] == "A100-80GB:1"
    assert loaded["resources"]["use_spot"] is False


def test_key_order_is_name_resources_envs_setup_run() -> None:
    assert list(task_config(GOLDEN["aws-on-demand"])) == [
        "name",
        "resources",
        "envs",
        "setup",
        "run",
    ]


def test_optional_sections_are_left_out() -> None:
    config = task_config(GOLDEN["gcp-spot-ports"])
    assert list(config) == ["name", "resources", "run"]
    assert "ports" not in task_config(GOLDEN["kubernetes-long-name"])["resources"]


def test_env_values_stay_strings_even_when_numeric() -> None:
    text = render_task_yaml(GOLDEN["aws-on-demand"])
    assert "PORT: '8000'" in text
    assert yaml.safe_load(text)["envs"]["PORT"] == "8000"


def test_multiline_scripts_are_literal_blocks() -> None:
    text = render_task_yaml(GOLDEN["aws-on-demand"])
    assert "setup: |\n  pip install 'vllm==0.11.0'\n  mkdir -p /data/hf\n" in text


def test_awkward_strings_round_trip() -> None:
    # Trailing spaces and tabs cannot be literal blocks; the dumper must fall back, not corrupt.
    config = {"run": "echo 'a: b' # not a comment \n\tindented\n", "name": "yes", "x": "0o17"}
    assert yaml.safe_load(dump_yaml(config)) == config


def test_render_is_pure() -> None:
    spec = GOLDEN["aws-on-demand"]
    assert render_task_yaml(spec) == render_task_yaml(spec)
    config = task_config(spec)
    config["envs"]["PORT"] = "1"
    assert task_config(spec)["envs"]["PORT"] == "8000"
