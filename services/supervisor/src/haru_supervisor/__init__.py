"""Haru supervisor: the agent on each GPU host (vLLM sleep/wake, training runs, GPU memory)."""

__all__: tuple[str, ...] = ()
