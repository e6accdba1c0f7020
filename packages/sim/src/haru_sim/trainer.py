"""Entry point: ``python -m haru_sim.trainer`` (same as the ``haru-sim-trainer`` console script)."""

from haru_sim._trainer import main

if __name__ == "__main__":
    raise SystemExit(main())
