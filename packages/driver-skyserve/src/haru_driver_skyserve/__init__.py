"""SkyServe boundary of Haru: service YAML renderer and sky serve runner."""

__all__: tuple[str, ...] = ()
