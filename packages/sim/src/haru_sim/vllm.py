"""Entry point: ``python -m haru_sim.vllm`` (same as the ``haru-sim-vllm`` console script)."""

from haru_sim._vllm_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
