"""``haru-sim-vllm serve MODEL [vLLM flags]``: the emulator behind ``vllm serve``'s command line.

A script written for real vLLM (the task a provisioned domain runs) starts the emulator when a
``vllm`` wrapper on its ``PATH`` runs ``haru-sim-vllm "$@"``. The command line is read as vLLM
0.33's ``vllm serve`` reads it, not as the emulator's own CLI:

- the model is the positional ``MODEL`` (or ``--model``, not both); the served names default
  to it;
- ``--host`` defaults to every interface and ``--port`` to 8000, like vLLM;
- the dev-mode routes (``/sleep``, ``/wake_up``, ``/is_sleeping``) are mounted only when the
  environment says ``VLLM_SERVER_DEV_MODE=1``; vLLM parses the value with ``int()``, so
  ``true`` is a start-up error (exit 1);
- ``--gpu-memory-utilization`` must be in (0, 1] (vLLM's ``CacheConfig`` refuses anything
  else at start-up: exit 1);
- ``--enable-sleep-mode``, ``--dtype`` and other real flags that change nothing the emulator
  models are accepted and ignored (:data:`IGNORED_VALUE_FLAGS`, :data:`IGNORED_SWITCHES`);
- any other flag is refused with exit 2, like vLLM's parser refuses a flag it does not know.
  A real vLLM flag outside those lists is refused too, with a message saying the emulator
  does not take it, so a test never passes on a flag nobody checked.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Final

from haru_sim._config import Faults, VllmSimConfig

DEFAULT_MODEL: Final = "Qwen/Qwen3-0.6B"
"""``vllm serve`` with no model serves this one (vLLM 0.33's default)."""

IGNORED_VALUE_FLAGS: Final = (
    "--dtype",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--kv-cache-dtype",
    "--quantization",
    "-q",
    "--seed",
    "--max-num-batched-tokens",
    "--tokenizer",
    "--revision",
    "--download-dir",
    "--swap-space",
    "--chat-template",
    "--generation-config",
    "--uvicorn-log-level",
    "--max-lora-rank",
    "--tool-call-parser",
    "--sleep-mode-backend",
)
"""Real ``vllm serve`` flags taking a value that the emulator accepts and ignores."""

IGNORED_SWITCHES: Final = (
    "--enable-sleep-mode",
    "--no-enable-sleep-mode",
    "--enforce-eager",
    "--trust-remote-code",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-lora",
    "--disable-uvicorn-access-log",
    "--enable-auto-tool-choice",
)
"""Real ``vllm serve`` switches the emulator accepts and ignores (it models no GPU memory, so
``--enable-sleep-mode`` changes nothing: without it real vLLM still answers ``/sleep`` with
200 and frees nothing)."""

DEV_MODE_VAR: Final = "VLLM_SERVER_DEV_MODE"


class ServeArgumentError(Exception):
    """A command line or environment that real ``vllm serve`` would refuse.

    Attributes:
        exit_code: 2 for a command line vLLM's parser refuses, 1 for a value refused at
            start-up (an engine config error).
    """

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm serve",
        description="haru-sim: the emulated vLLM server behind `vllm serve`'s command line",
        allow_abbrev=False,
        add_help=False,
    )
    parser.add_argument("model_tag", nargs="?", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--disable-log-stats", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--reasoning-parser", default=None)
    for flag in IGNORED_VALUE_FLAGS:
        parser.add_argument(flag, dest=f"ignored{flag.replace('-', '_')}", default=None)
    for flag in IGNORED_SWITCHES:
        parser.add_argument(flag, dest=f"ignored{flag.replace('-', '_')}", action="store_true")
    return parser


def _dev_mode(environ: dict[str, str]) -> bool:
    raw = environ.get(DEV_MODE_VAR, "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise ServeArgumentError(
            f"ValueError: invalid literal for int() with base 10: {raw!r} ({DEV_MODE_VAR})",
            exit_code=1,
        ) from None


def serve_config(
    argv: Sequence[str], *, environ: dict[str, str] | None = None
) -> tuple[VllmSimConfig, str, int]:
    """Read a ``vllm serve`` command line (without ``serve``) as vLLM 0.33 would.

    Returns:
        The emulator's config, the host to bind and the port.

    Raises:
        ServeArgumentError: real vLLM would refuse it (see the exit code).
    """
    env = dict(os.environ if environ is None else environ)
    args, unknown = _parser().parse_known_args(list(argv))
    if unknown:
        raise ServeArgumentError(
            "unrecognized arguments: "
            f"{' '.join(unknown)} (not a vLLM flag, or one haru-sim does not emulate)",
            exit_code=2,
        )
    if args.model_tag is not None and args.model is not None:
        raise ServeArgumentError(
            "With `vllm serve`, you should provide the model as a positional argument "
            "instead of via the `--model` option.",
            exit_code=2,
        )
    model = args.model_tag or args.model or DEFAULT_MODEL
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ServeArgumentError(
            "ValidationError: gpu_memory_utilization must be greater than 0 and at most 1, "
            f"got {args.gpu_memory_utilization}",
            exit_code=1,
        )
    names = tuple(args.served_model_name) if args.served_model_name else (model,)
    config = VllmSimConfig(
        served_model_names=names,
        model=model,
        dev_mode=_dev_mode(env),
        api_key=args.api_key,
        log_stats=not args.disable_log_stats,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        reasoning_field="reasoning" if args.reasoning_parser else None,
        faults=Faults(),
    )
    return config, args.host if args.host is not None else "0.0.0.0", args.port
