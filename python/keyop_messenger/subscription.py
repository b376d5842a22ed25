"""Subscriptions: delivering a channel to a callback, at least once."""

from __future__ import annotations

import logging
import threading
import typing
from typing import Any

from . import _core
from ._closing import CLOSE_TIMEOUT_S, _SyncContext, refuse_when_closed
from .errors import PayloadTypeError
from .message import Message
from .payloads import PayloadRegistry
from .positions import Position, to_core

__all__ = ["DeadLetter", "Deliverer", "Handler", "Subscription"]

log = logging.getLogger("keyop_messenger")

# typing.Callable rather than collections.abc's: its alias takes a __doc__, so
# help(km.Handler) and the API reference show what a handler is.
Handler = typing.Callable[[Message], Any]
Handler.__doc__ = (
    "A subscriber callback, ``(message) -> Any``: returning acknowledges the message, "
    "raising means retry (then dead-letter)."
)

_Failure = tuple[bool, str] | tuple[bool, str, bool] | None

_DELIVERING = threading.local()


def in_handler() -> bool:
    """Whether the calling thread is running a subscription handler (a
    ``close()`` there must not wait for that handler to return)."""
    return getattr(_DELIVERING, "active", False)


class DeadLetter(Exception):
    """Raised by a subscription handler to dead-letter the message at once,
    without retries: it goes to ``<channel>.dead-letter`` with ``reason`` as
    its error text, and delivery moves on. Not a :class:`KeyopError`: the
    library never raises it, handlers do."""

    def __init__(self, reason: str = "dead-lettered by the handler") -> None:
        super().__init__(reason)
        self.reason = reason


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

    def __call__(self, messages: list[Message]) -> tuple[int, _Failure]:
        """Hands ``messages`` to the handler in order; returns how many were handled and why the
        next failed."""
        # The delivery hot path: one handler call per message. The engine
        # built each Message with its payload still JSON text; it is decoded
        # when first read (here for registered types, else by the handler).
        _DELIVERING.active = True
        try:
            return self._deliver(messages)
        finally:
            _DELIVERING.active = False

    def _deliver(self, messages: list[Message]) -> tuple[int, _Failure]:
        handler, entries, decode = self._handler, self._registry.entries, self._registry.decode
        i = 0
        for message in messages:
            if self.stopped:
                return i, None
            if entries and message.payload_type in entries:
                try:
                    message = message._with_payload(decode(message.payload_type,
                                                           message.payload))
                except PayloadTypeError as exc:
                    log.warning("%s/%s: undecodable message %s: %s", self._channel, self._id,
                                message.id, exc)
                    return i, self._unreadable(message) or (True, str(exc))
            try:
                handler(message)
            except DeadLetter as exc:
                log.info("%s/%s: handler dead-lettered %s: %s", self._channel, self._id,
                         message.id, exc.reason)
                return i, (True, exc.reason)
            except BaseException as exc:  # SystemExit & co. too: the ones before stay handled
                unreadable = self._unreadable(message)
                if unreadable is not None:
                    return i, unreadable
                log.warning("%s/%s: handler failed on %s: %r", self._channel, self._id,
                            message.id, exc)
                log.debug("handler traceback", exc_info=True)
                return i, (False, f"{type(exc).__name__}: {exc}")
            i += 1
        return i, None

    @staticmethod
    def _unreadable(message: Message) -> _Failure:
        """The failure of a message whose payload could not become a Python value (it goes to
        the dead letters as raw text), else None."""
        reason = message._unreadable()
        return None if reason is None else (True, f"payload cannot be read: {reason}", True)


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
        """Global offset of the next message not yet acknowledged; after
        :meth:`seek`, the position sought."""
        return self._core.position

    def seek(self, position: Position) -> None:
        """Makes delivery go on at ``position`` (``"earliest"``, ``"latest"``,
        an ``int`` offset that starts a record, or a timezone-aware
        ``datetime``): the next message delivered is the one there, and the
        subscriber's offset is moved there. Taken between handler calls: a
        call in progress finishes first. :attr:`position` shows the new
        position at once, and a seek not yet taken when the subscription
        closes is kept: its offset is the one persisted. Raises
        :class:`ConfigError` for a position that is not a record boundary or
        a naive datetime."""
        self._core.seek(*to_core(position, "position"))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops delivery after the handler call in progress (if any) and
        persists the offset. Idempotent; may be called from the handler.

        Waits at most ``timeout`` seconds (default 10) for that handler call:
        if it has not returned by then it is left running, a WARNING names
        the subscriber and channel, and its message stays unacknowledged
        (delivered again to the id's next subscription). Ctrl-C stops the
        waiting and raises :class:`KeyboardInterrupt`. A ``timeout`` that is
        not a finite number >= 0 raises :class:`ValueError` and stops nothing."""
        _core.check_timeout(timeout)
        self._deliverer.stop()
        self._core.close(timeout)

    def __repr__(self) -> str:
        return f"<Subscription {self.channel!r}/{self.subscriber_id!r} at {self.position}>"
