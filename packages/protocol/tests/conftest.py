"""Fixtures of haru-protocol's tests: fresh, valid operator documents to mutate."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def layout_doc() -> dict[str, Any]:
    """A valid two-domain layout, as an operator would write it (camelCase JSON)."""
    return {
        "slug": "fleet-1",
        "displayName": "Fleet one",
        "activeDomainSlug": "alpha",
        "policy": {"autoFailover": True, "probe": {"prompt": "hello"}},
        "domains": [
            {
                "slug": "alpha",
                "provider": "static",
                "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"},
                "supervisorUrl": "http://alpha.test:8701",
                "servingBaseUrl": "https://alpha.test/serve?team=a",
                "slots": [
                    {
                        "kind": "inference",
                        "gpuIndex": 0,
                        "models": [
                            {"name": "chat-small", "servingUrl": "http://alpha.test:8011"},
                            {"name": "chat-medium", "servingUrl": "http://alpha.test:8012"},
                        ],
                    },
                    {
                        "kind": "training",
                        "gpuIndex": 0,
                        "command": ["trainer", "--epochs", "1"],
                        "checkpointDir": "/ckpt/alpha",
                    },
                ],
            },
            {
                "slug": "beta",
                "placement": {
                    "cloud": "gcp",
                    "region": "us-central1",
                    "accelerator": "EXAMPLE-GPU",
                },
                "slots": [
                    {
                        "kind": "inference",
                        "gpuIndex": 1,
                        "models": [{"name": "chat-small", "servingUrl": "http://beta.test:8011"}],
                    }
                ],
            },
        ],
    }


@pytest.fixture
def supervisor_doc() -> dict[str, Any]:
    """A valid supervisor config: two inference slots and a training slot."""
    return {
        "slots": [
            {
                "kind": "inference",
                "gpuIndex": 0,
                "models": [
                    {"name": "chat-small", "port": 8011},
                    {"name": "chat-medium", "port": 8012},
                ],
            },
            {"kind": "inference", "gpuIndex": 1, "models": [{"name": "chat-large", "port": 8013}]},
            {
                "kind": "training",
                "gpuIndex": 0,
                "command": ["trainer"],
                "checkpointDir": "/ckpt",
            },
        ]
    }
