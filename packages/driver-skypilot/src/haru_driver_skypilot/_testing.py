"""A scripted :class:`haru_protocol.Exec` for tests of code that drives ``sky``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from haru_exec import ExecResult
from haru_protocol import DomainLayout

from haru_driver_skypilot._domain import domain_task
from haru_driver_skypilot._spec import TaskSpec, cluster_name


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted outcome of a command."""

    returncode: int = 0
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True, slots=True)
class ExecCall:
    """One command the code under test ran.

    Attributes:
        argv: The command line.
        timeout: The time bound it was given.
        env: The environment it was given (``None``: inherited).
        files: Contents, at call time, of every argv entry naming an existing ``.yaml`` file
            (rendered files are deleted right after the call, so this is the only record).
    """

    argv: tuple[str, ...]
    timeout: float
    env: Mapping[str, str] | None
    files: Mapping[str, str] = field(default_factory=dict)


def _read_yaml_args(argv: Sequence[str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for arg in argv:
        path = Path(arg)
        if arg.endswith(".yaml") and path.is_file():
            files[arg] = path.read_text(encoding="utf-8")
    return files


class ScriptedExec:
    """An Exec that answers each call with the next scripted :class:`Reply` or exception.

    Every call is recorded in :attr:`calls`. Running out of replies raises ``AssertionError``
    so a test never passes on an unexpected extra command.
    """

    def __init__(self, *script: Reply | BaseException) -> None:
        """Create it with the outcomes of the expected calls, in order."""
        self._script = list(script)
        self.calls: list[ExecCall] = []

    @property
    def remaining(self) -> int:
        """How many scripted outcomes were not used."""
        return len(self._script)

    async def __call__(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        args = tuple(argv)
        files = await asyncio.to_thread(_read_yaml_args, args)
        self.calls.append(ExecCall(argv=args, timeout=timeout, env=env, files=files))
        if not self._script:
            raise AssertionError(f"unexpected command {args!r}: no scripted reply left")
        outcome = self._script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return ExecResult(
            argv=args,
            returncode=outcome.returncode,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
        )


def example_domain_layout() -> DomainLayout:
    """A provisioned domain: two models on GPU 0, one on GPU 1, training on both GPUs."""
    return DomainLayout.model_validate(
        {
            "slug": "beta",
            "provider": "skypilot",
            "placement": {
                "cloud": "gcp",
                "region": "us-central1",
                "accelerator": "EXAMPLE-GPU",
                "acceleratorCount": 2,
                "useSpot": True,
            },
            "provisioning": {
                "vllmVersion": "0.33.0",
                "supervisorPackage": "haru-supervisor==0.2.0",
            },
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [
                        {"name": "example-chat-small", "source": "example-org/chat-small"},
                        {
                            "name": "example-chat-medium",
                            "extraVllmArgs": ["--max-model-len", "8192"],
                        },
                    ],
                },
                {
                    "kind": "inference",
                    "gpuIndex": 1,
                    "models": [{"name": "example-chat-large", "gpuMemoryUtilization": 0.85}],
                },
                {
                    "kind": "training",
                    "gpuIndex": 0,
                    "command": ["python", "train.py", "--lora"],
                    "checkpointDir": "/ckpt/0",
                },
                {
                    "kind": "training",
                    "gpuIndex": 1,
                    "command": ["python", "train.py", "--lora"],
                    "checkpointDir": "/ckpt/1",
                },
            ],
        }
    )


def example_domain_task(*, start_asleep: bool) -> TaskSpec:
    """The task of :func:`example_domain_layout` (cluster ``haru-demo--beta``)."""
    domain = example_domain_layout()
    return domain_task(
        cluster_name("demo", domain.slug),
        domain.placement,
        domain.slots,
        domain.settings,
        start_asleep=start_asleep,
    )
