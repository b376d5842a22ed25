"""Subscriptions: delivering a channel to a callback, at least once."""

from __future__ import annotations

import logging
import typing
from typing import Any

from . import _core
from ._closing import CLOSE_TIMEOUT_S, _SyncContext, refuse_when_closed
from .errors import PayloadTypeError
from .message import Message
from .payloads import PayloadRegistry

__all__ = ["Deliverer", "Handler", "Subscription"]

log = logging.getLogger("keyop_messenger")

# typing.Callable rather than collections.abc's: its alias takes a __doc__, so
# help(km.Handler) and the API reference show what a handler is.
Handler = typing.Callable[[Message], Any]
Handler.__doc__ = (
    "A subscriber callback, ``(message) -> Any``: returning acknowledges the message, "
    "raising means retry (then dead-letter)."
)

_Failure = tuple[bool, str] | None


class Deliverer:
    """The batch function the engine calls (GIL held, engine thread): it
    decodes each row and hands it to ``handler`` in order, and reports how
    many were handled and why the next one failed. Once ``stop()`` is called
    it hands over no further message, so closing waits at most for the
    handler call in progress."""

    __slots__ = ("_channel", "_handler", "_id", "_registry", "stopped")

    def __init__(
        self, handler: Handler, registry: PayloadRegistry, channel: str, subscriber_id: str
    ) -> None:
        self._handler = handler
        self._registry = registry
        self._channel = channel
        self._id = subscriber_id
        self.stopped = False

    def stop(self) -> None:
        """Hands no further message to the handler."""
        self.stopped = True

    def __call__(self, rows: list[tuple[Any, ...]]) -> tuple[int, _Failure]:
        """Hands ``rows`` to the handler in order; returns how many were handled and why the next
        failed."""
        # The delivery hot path: one tuple unpack, one Message and one handler
        # call per row; payloads are decoded only for registered types.
        handler, entries, decode = self._handler, self._registry.entries, self._registry.decode
        i = 0
        for _offset, id_, ts, channel, origin, ptype, service, corr, data in rows:
            if self.stopped:
                return i, None
            if entries and ptype in entries:
                try:
                    data = decode(ptype, data)
                except PayloadTypeError as exc:
                    log.warning("%s/%s: undecodable message %s: %s", self._channel, self._id,
                                id_, exc)
                    return i, (True, str(exc))
            message = Message(id_, channel, origin, ptype, data, ts, service, corr)
            try:
                handler(message)
            except Exception as exc:
                log.warning("%s/%s: handler failed on %s: %r", self._channel, self._id,
                            id_, exc)
                log.debug("handler traceback", exc_info=True)
                return i, (False, f"{type(exc).__name__}: {exc}")
            i += 1
        return i, None


@refuse_when_closed(
    lambda s: s._deliverer.stopped, lambda s: f"subscription {s.channel!r}/{s.subscriber_id!r}"
)
class Subscription(_SyncContext):
    """A running subscription. ``close()`` stops delivery and keeps the
    subscriber's offset, so subscribing again with the same id resumes.
    After ``close()`` (or the messenger's) every method but ``close()``
    raises :class:`ClosedError`; the properties keep answering."""

    def __init__(self, core: _core.Subscription, deliverer: Deliverer) -> None:
        self._core = core
        self._deliverer = deliverer

    @property
    def channel(self) -> str:
        """The channel delivered."""
        return self._core.channel

    @property
    def subscriber_id(self) -> str:
        """The subscriber id (names the offset file)."""
        return self._core.subscriber_id

    @property
    def position(self) -> int:
        """Global offset of the next message not yet acknowledged."""
        return self._core.position

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops delivery after the handler call in progress (if any) and
        persists the offset. Idempotent; may be called from the handler.

        Waits at most ``timeout`` seconds (default 10) for that handler call:
        if it has not returned by then it is left running, a WARNING names
        the subscriber and channel, and its message stays unacknowledged
        (delivered again to the id's next subscription). Ctrl-C stops the
        waiting and raises :class:`KeyboardInterrupt`."""
        self._deliverer.stop()
        self._core.close(timeout)

    def __repr__(self) -> str:
        return f"<Subscription {self.channel!r}/{self.subscriber_id!r} at {self.position}>"
