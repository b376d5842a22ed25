"""``with`` support shared by the sync classes (the counterpart of
``aio._AsyncContext``)."""

from __future__ import annotations

import atexit
import functools
import inspect
import sys
import threading
import time
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


#: Longest time the interpreter's exit waits for engine threads to leave Python.
EXIT_WAIT_S = 2.0


class ExitGate:
    """Engine threads that wait in Python with the GIL released (the async
    bridges waiting for a handler on an event loop, ``messages()`` waiting
    for a loop body) register their wake-up event here.

    A thread that takes the GIL back once the interpreter is finalizing is
    ended by CPython in the middle of the engine's call (``pthread_exit``),
    and unwinding the binding's GIL guard then aborts the process ("Fatal
    Python error: PyGILState_Release"). So at exit (an ``atexit`` hook, run
    while the GIL still works, after the messengers' own closing) every
    registered wait is woken and told to give up, and the exit waits (at
    most :data:`EXIT_WAIT_S`) until those threads are back in the engine,
    with no Python frame left."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exiting = False
        self._waits: dict[threading.Event, int] = {}
        #: Threads seen in a wait once exiting began (still in Python for a while).
        self._seen: set[int] = set()

    def enter(self, wake: threading.Event) -> bool:
        """Registers the calling thread's wait on ``wake``; False (the caller
        must give up at once) when the interpreter is exiting."""
        ident = threading.get_ident()
        with self._lock:
            self._waits[wake] = ident
            if self.exiting:
                self._seen.add(ident)
                return False
            return True

    def leave(self, wake: threading.Event) -> None:
        """Ends the registration of ``enter``."""
        with self._lock:
            self._waits.pop(wake, None)

    def release(self, timeout: float = EXIT_WAIT_S) -> None:
        """Wakes every registered wait for good, then waits until their
        threads have left Python (or ``timeout`` seconds)."""
        with self._lock:
            self.exiting = True
            waits = list(self._waits.items())
            self._seen.update(ident for _, ident in waits)
        for wake, _ in waits:
            wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                busy = set(self._waits.values()) | self._seen
            if not busy & set(sys._current_frames()):
                return
            time.sleep(0.005)  # releases the GIL: lets them run out


EXIT_GATE = ExitGate()
# Registered at import, before messenger.py registers its close of every open
# messenger: atexit runs hooks last-in first-out, so this runs after them.
atexit.register(EXIT_GATE.release)
