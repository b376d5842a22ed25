"""``with`` support shared by the sync classes (the counterpart of
``aio._AsyncContext``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import ClosedError

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T", bound=type)


def refuse_when_closed(
    is_closed: Callable[[Any], bool], what: Callable[[Any], str], *, exempt: tuple[str, ...] = ()
) -> Callable[[T], T]:
    """Class decorator: every public method defined in the class (``close``
    and ``exempt`` aside) raises :class:`ClosedError` once ``is_closed(self)``
    is true, before doing anything (generator methods too, at the call).
    Methods added later are covered without a change here; properties,
    static and class methods are left alone."""

    def decorate(cls: T) -> T:
        for name, member in list(vars(cls).items()):
            if name.startswith("_") or name == "close" or name in exempt:
                continue
            if inspect.isfunction(member):
                setattr(cls, name, _guarded(member, is_closed, what))
        return cls

    return decorate


def _guarded(
    method: Callable[..., Any], is_closed: Callable[[Any], bool], what: Callable[[Any], str]
) -> Callable[..., Any]:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if is_closed(self):
            raise ClosedError(f"{what(self)} is closed: {method.__name__}() cannot be called")
        return method(self, *args, **kwargs)

    return guarded


#: Seconds ``close()`` waits by default for subscriber handlers still running
#: (``Messenger.close``, ``Subscription.close``, the async ``close``/``aclose``
#: and the close at interpreter exit). A handler still running then is left
#: behind with a warning; its message stays unacknowledged.
CLOSE_TIMEOUT_S = 10.0


class _SyncContext:
    """``with`` for the sync classes: entering calls :meth:`_enter` and gives
    the object itself; leaving calls ``close()``."""

    # No instance layout of its own, so it mixes in beside the native base.
    __slots__ = ()

    def _enter(self) -> None:
        """Runs when the ``with`` block is entered (nothing by default)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        if getattr(self, "_closed", False):
            raise ClosedError(f"{type(self).__name__} is closed: a with block cannot reopen it")
        self._enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
