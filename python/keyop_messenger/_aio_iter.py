"""Async iterators of :class:`~keyop_messenger.aio.AsyncMessenger`: ``messages()``
(a subscription consumed with ``async for``) and ``read_channel()``.

``messages()`` is built on the ordinary subscription machinery: its handler runs
on the engine's delivery thread, hands the message to the event loop with
``loop.call_soon_threadsafe`` and blocks (that thread, never the loop) until the
consumer has finished the loop body for it. Returning from the handler is what
acknowledges, so acknowledgement order is file order and a message is
acknowledged only after its body ran (at-least-once).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._closing import CLOSE_TIMEOUT_S, EXIT_GATE
from .message import LogEntry, Message
from .positions import Position

if TYPE_CHECKING:
    from .subscription import Subscription

log = logging.getLogger("keyop_messenger")

#: Seconds between checks that the event loop still exists while a message waits.
_LOOP_CHECK_S = 0.25
#: Entries fetched per worker-thread hop by the async ``read_channel``.
_READ_CHUNK = 256


class StreamStoppedError(RuntimeError):
    """Raised to the engine when a ``messages()`` stream ends with a message
    in hand that its body did not finish: the subscription stops and the
    message stays unacknowledged (delivered again to the id's next
    subscription)."""


class _Slot:
    """One message handed to the loop, and the consumer's verdict on it."""

    __slots__ = ("acked", "done", "msg")

    def __init__(self, msg: Message) -> None:
        self.msg = msg
        self.done = threading.Event()
        self.acked = False

    def finish(self, acked: bool) -> None:
        self.acked = acked
        self.done.set()


class _Feed:
    """What the engine's delivery thread touches (not the stream itself, so a
    stream dropped by ``break`` is finalized at once)."""

    def __init__(self, channel: str, subscriber_id: str, buffer: int) -> None:
        self.channel = channel
        self.subscriber_id = subscriber_id
        self.queue: asyncio.Queue[_Slot | None] = asyncio.Queue(maxsize=buffer)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sub: Subscription | None = None
        self.ended = False
        self._lock = threading.Lock()
        self.outstanding = 0
        self.max_outstanding = 0

    def __call__(self, msg: Message) -> None:
        loop = self.loop
        if self.ended or loop is None or loop.is_closed():
            raise self._stop_here("the stream has ended")
        slot = _Slot(msg)
        with self._lock:
            self.outstanding += 1
            self.max_outstanding = max(self.max_outstanding, self.outstanding)
        try:
            try:
                loop.call_soon_threadsafe(self._put, slot)
            except RuntimeError:  # the loop closed in between
                raise self._stop_here("its event loop is closed") from None
            # Registered with the exit gate: at interpreter exit this wait
            # gives up, so the thread is back in the engine before Python
            # finalizes (see _closing.ExitGate).
            if not EXIT_GATE.enter(slot.done):
                raise self._stop_here("the interpreter is exiting")
            try:
                while not slot.done.wait(_LOOP_CHECK_S):
                    if loop.is_closed():
                        raise self._stop_here("its event loop is closed")
            finally:
                EXIT_GATE.leave(slot.done)
            if EXIT_GATE.exiting and not slot.acked:
                raise self._stop_here("the interpreter is exiting")
            if not slot.acked:
                raise self._stop_here("the loop body did not finish")
        finally:
            with self._lock:
                self.outstanding -= 1

    def _stop_here(self, why: str) -> StreamStoppedError:
        """Stops the subscription from the delivery thread; the message in
        hand stays unacknowledged."""
        self.ended = True
        sub = self.sub
        if sub is not None:
            sub.close()
        return StreamStoppedError(f"messages({self.channel!r}, {self.subscriber_id!r}): {why}")

    def _put(self, slot: _Slot) -> None:
        if self.ended:
            slot.finish(False)
            return
        self.queue.put_nowait(slot)  # never full: the engine waits for each body


class MessageStream:
    """``async for msg in am.messages(...)``; also ``async with am.messages(...) as s``.

    A message is acknowledged when the next one is asked for, or when an
    ``async with`` block is left without an exception. Leaving the loop by an
    exception inside ``async with`` leaves the message in hand unacknowledged.
    Without ``async with`` a loop left by ``break`` or by an exception cannot
    be told apart, so the message in hand is left unacknowledged (delivered
    again next time): use ``async with`` (or :meth:`aclose` with
    ``ack=True``) to acknowledge it on ``break``.
    """

    def __init__(
        self,
        owner: Any,  # the AsyncMessenger (not named: aio imports this module)
        channel: str,
        subscriber_id: str,
        *,
        start: Position,
        reset: bool,
        buffer: int,
    ) -> None:
        if buffer < 1:
            raise ValueError(f"buffer must be >= 1, got {buffer}")
        self._owner = owner
        self._start = start
        self._reset = reset
        self._feed = _Feed(channel, subscriber_id, buffer)
        self._opened = False
        self._current: _Slot | None = None

    def __reduce__(self) -> Any:
        raise TypeError(
            f"cannot pickle {type(self).__name__!r} object: it is a running subscription "
            "of this process"
        )

    @property
    def max_outstanding(self) -> int:
        """Most messages the engine had handed over and not yet seen answered."""
        return self._feed.max_outstanding

    async def _open(self) -> None:
        feed = self._feed
        if self._opened or feed.ended:
            return
        self._opened = True
        feed.loop = asyncio.get_running_loop()
        key = (feed.channel, feed.subscriber_id)
        closing = self._owner._stream_closes.pop(key, None)
        if closing is not None:  # a dropped stream of this id is still closing
            await asyncio.wrap_future(closing)
        sync = self._owner._require()
        feed.sub = await self._owner._run(
            sync.subscribe, feed.channel, feed.subscriber_id, feed,
            start=self._start, reset=self._reset,
        )  # fmt: skip
        self._owner._streams.add(self)

    def __aiter__(self) -> MessageStream:
        return self

    async def __anext__(self) -> Message:
        self._ack_current()
        if self._feed.ended:
            raise StopAsyncIteration
        await self._open()
        slot = await self._feed.queue.get()
        if slot is None or self._feed.ended:
            if slot is not None:
                slot.finish(False)
            raise StopAsyncIteration
        self._current = slot
        return slot.msg

    def _ack_current(self) -> None:
        slot, self._current = self._current, None
        if slot is not None:
            slot.finish(True)

    def _end(self, ack: bool) -> Subscription | None:
        """Ends the stream on the loop: answers the message in hand, wakes a
        waiting ``__anext__``; returns the subscription to close."""
        feed = self._feed
        feed.ended = True
        if feed.sub is not None:
            # Before the message in hand is answered: the delivery thread it
            # wakes must hand over no further message (that one would meet
            # the ended stream and fail, logged as a handler failure).
            feed.sub._deliverer.stop()
        if ack:
            self._ack_current()
        slot, self._current = self._current, None
        if slot is not None:
            slot.finish(False)
        while not feed.queue.empty():
            pending = feed.queue.get_nowait()
            if pending is not None:
                pending.finish(False)
        feed.queue.put_nowait(None)
        self._owner._streams.discard(self)
        sub, feed.sub = feed.sub, None
        return sub

    async def aclose(self, ack: bool = False, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ends the stream and closes its subscription (idempotent). ``ack``
        acknowledges the message whose body is in progress first."""
        sub = self._end(ack)
        if sub is not None and not self._owner._closed:
            await self._owner._run(sub.close, timeout)

    async def __aenter__(self) -> MessageStream:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose(ack=exc_type is None)

    def __del__(self) -> None:
        # Dropped without aclose() (``break`` or an exception in a plain
        # ``async for``): the message in hand stays unacknowledged.
        feed = getattr(self, "_feed", None)  # None if __init__ raised
        if feed is None or feed.ended or feed.sub is None:
            return
        loop = feed.loop
        try:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._drop)
        except RuntimeError:
            pass

    def _drop(self) -> None:
        sub = self._end(False)
        if sub is not None and not self._owner._closed:
            key = (self._feed.channel, self._feed.subscriber_id)
            self._owner._stream_closes[key] = self._owner._pool.submit(sub.close)


async def read_entries(run: Any, fn: Any) -> AsyncGenerator[LogEntry, None]:
    """Yields the entries of the iterator ``fn()`` returns, called and then
    drained ``_READ_CHUNK`` at a time through ``run`` (a worker thread)."""
    entries: Iterator[LogEntry] = await run(fn)
    while True:
        chunk = await run(lambda: list(itertools.islice(entries, _READ_CHUNK)))
        for entry in chunk:
            yield entry
        if len(chunk) < _READ_CHUNK:
            return
