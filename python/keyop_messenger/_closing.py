"""``with`` support shared by the sync classes (the counterpart of
``aio._AsyncContext``)."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

C = TypeVar("C", bound="_SyncContext")

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

    def __enter__(self: C) -> C:
        self._enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
