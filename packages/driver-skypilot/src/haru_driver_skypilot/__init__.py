"""SkyPilot boundary of Haru: task YAML renderer and sky CLI runner."""

__all__: tuple[str, ...] = ()
