"""``haru-sim-vllm``: run one emulated vLLM server as a process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
from collections.abc import Sequence
from typing import Final

from haru_sim._config import Faults, VllmSimConfig
from haru_sim._errors import SimConfigError
from haru_sim._sim import VllmSim
from haru_sim._vllm_serve import ServeArgumentError, serve_config

logger = logging.getLogger(__name__)

PROGRAM: Final = "haru-sim-vllm"
_LISTEN_RE: Final = re.compile(r"haru-sim-vllm (listening|control) on (\S+):([0-9]+)")


def parse_listen_line(line: str) -> tuple[str, int] | None:
    """Parse the ``haru-sim-vllm listening on HOST:PORT`` line the CLI prints when ready.

    Returns:
        ``(host, port)``, or None when ``line`` is not that line.
    """
    match = _LISTEN_RE.fullmatch(line.strip())
    if match is None or match.group(1) != "listening":
        return None
    host = match.group(2)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(match.group(3))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="An emulated vLLM OpenAI server (sleep mode, dev-mode admin routes, faults).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="TCP port; 0 = ephemeral (default 8000)"
    )
    parser.add_argument(
        "--control-port",
        type=int,
        default=None,
        help="also serve /_sim/* on this port (0 = ephemeral); it keeps listening under refuse",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the server answers to (default: the --model value)",
    )
    parser.add_argument(
        "--model",
        default="haru-sim-model",
        help="model path reported as root (default haru-sim-model)",
    )
    parser.add_argument("--sleep-latency-ms", type=float, default=20.0)
    parser.add_argument("--wake-latency-ms", type=float, default=20.0)
    parser.add_argument("--first-token-latency-ms", type=float, default=0.0)
    parser.add_argument("--token-latency-ms", type=float, default=2.0)
    parser.add_argument("--tokenize-latency-ms", type=float, default=1.0)
    parser.add_argument("--step-period-ms", type=float, default=2.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--vllm-version", default="0.33.0", help="emulated vLLM release (default 0.33.0)"
    )
    parser.add_argument(
        "--disable-log-stats", action="store_true", help="no vllm:* metrics, like vLLM's flag"
    )
    parser.add_argument(
        "--api-key", default=None, help="require this bearer token on /v1/* (like --api-key)"
    )
    parser.add_argument(
        "--reasoning-field",
        choices=("reasoning", "reasoning_content"),
        default=None,
        help="emulate --reasoning-parser; the message field that holds the reasoning",
    )
    parser.add_argument("--reasoning-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--embedding-dimensions", type=int, default=8)
    parser.add_argument("--request-log-size", type=int, default=64)
    parser.add_argument("--start-asleep", action="store_true", help="start at sleep level 1")
    parser.add_argument(
        "--no-dev-mode",
        action="store_true",
        help="do not mount /sleep, /wake_up, /is_sleeping (like VLLM_SERVER_DEV_MODE=0)",
    )
    parser.add_argument(
        "--legacy-empty-bodies",
        action="store_true",
        help="/sleep and /wake_up answer an empty 200 (vLLM <= 0.31 does anyway)",
    )
    parser.add_argument(
        "--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    return parser


def _config(args: argparse.Namespace) -> VllmSimConfig:
    names = tuple(args.served_model_name) if args.served_model_name else (args.model,)
    return VllmSimConfig(
        served_model_names=names,
        model=args.model,
        dev_mode=not args.no_dev_mode,
        sleep_latency_ms=args.sleep_latency_ms,
        wake_latency_ms=args.wake_latency_ms,
        first_token_latency_ms=args.first_token_latency_ms,
        token_latency_ms=args.token_latency_ms,
        tokenize_latency_ms=args.tokenize_latency_ms,
        step_period_ms=args.step_period_ms,
        max_num_seqs=args.max_num_seqs,
        start_asleep=args.start_asleep,
        legacy_empty_bodies=args.legacy_empty_bodies,
        vllm_version=args.vllm_version,
        log_stats=not args.disable_log_stats,
        api_key=args.api_key,
        reasoning_field=args.reasoning_field,
        reasoning_tokens=args.reasoning_tokens,
        max_model_len=args.max_model_len,
        embedding_dimensions=args.embedding_dimensions,
        request_log_size=args.request_log_size,
        faults=Faults(),
    )


def _announce(kind: str, url: str) -> None:
    # One machine-readable line per listener; a parent process waits for "listening".
    sys.stdout.write(f"{PROGRAM} {kind} on {url.removeprefix('http://')}\n")
    sys.stdout.flush()


async def _serve(config: VllmSimConfig, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sim = VllmSim(config)
    try:
        await sim.start(args.host, args.port, control_port=args.control_port)
    except OSError as exc:
        sys.stderr.write(f"{PROGRAM}: cannot listen on {args.host}:{args.port}: {exc}\n")
        return 1
    try:
        if sim.control_url is not None:
            _announce("control", sim.control_url)
        _announce("listening", sim.url)
        await stop.wait()
        logger.info("signal received, shutting down")
    finally:
        await sim.stop()
    return 0


def _serve_main(argv: Sequence[str]) -> int:
    try:
        config, host, port = serve_config(argv)
    except ServeArgumentError as exc:
        sys.stderr.write(f"vllm serve: error: {exc}\n")
        return exc.exit_code
    except SimConfigError as exc:
        sys.stderr.write(f"vllm serve: error: {exc}\n")
        return 2
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    args = argparse.Namespace(host=host, port=port, control_port=None)
    return asyncio.run(_serve(config, args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the emulated vLLM server until SIGTERM or SIGINT; returns the exit status.

    ``serve MODEL [flags]`` reads the rest as real ``vllm serve`` does (see
    :mod:`haru_sim._vllm_serve`), so a ``vllm`` wrapper can stand in for vLLM.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["serve"]:
        return _serve_main(arguments[1:])
    parser = _parser()
    args = parser.parse_args(arguments)
    try:
        config = _config(args)
    except SimConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    return asyncio.run(_serve(config, args))
