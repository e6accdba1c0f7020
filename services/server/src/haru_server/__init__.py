"""Haru control server: control API, reconciler, inference proxy and the haru CLI."""

__all__: tuple[str, ...] = ()
