"""The base of the state store's method groups: the executor they share and the call deadline."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from haru_db._exec import Executor

_P = ParamSpec("_P")
_R = TypeVar("_R")
_F = TypeVar("_F", bound="Facade")


class Facade:
    """What every group of :class:`~haru_db.StateStore` methods runs on."""

    _ex: Executor


def bounded(
    method: Callable[Concatenate[_F, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[_F, _P], Coroutine[Any, Any, _R]]:
    """Run the whole facade call under the store's deadline."""

    async def call(self: _F, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await self._ex.bounded(method(self, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call
