# why this file is long: the async face of both messengers and of their subscriptions shares
# one bridge from engine threads to the event loop and one worker pool; every sync method
# has its twin here (the messages() iterator lives in _aio_iter.py).
"""asyncio face of :class:`Messenger` and :class:`EphemeralMessenger`.

::

    import keyop_messenger as km
    from keyop_messenger.aio import AsyncMessenger

    async def on_reading(msg: km.Message) -> None:
        await store(msg.payload)              # raising means: retry later

    async def main() -> None:
        async with AsyncMessenger("keyop.yaml") as m:
            await m.subscribe("temps", "recorder", on_reading)
            msg_id = await m.publish("temps", "demo.Reading", {"celsius": 21.5})

    asyncio.run(main())

How it works:

* ``AsyncMessenger.publish`` hands the message to the channel's committer
  thread at once and awaits a future; each commit completes the futures of
  all its messages in one step on the loop, so concurrent publishes from many
  tasks share one fsync per channel (group commit) with no thread hand-off
  per message.
* Other blocking calls (``publish_batch``, ``flush``, ``close`` waiting for the
  handler in progress, ...) run on a small thread pool owned by the object
  (``max_workers`` threads, default :data:`DEFAULT_WORKERS`), never on the event
  loop. The engine releases the GIL while it waits, so the loop keeps running.
* Subscriber handlers are ``async def`` functions run **on the event loop that
  called** :meth:`AsyncMessenger.subscribe`: the engine's delivery thread
  schedules ``handler(msg)`` there with :func:`asyncio.run_coroutine_threadsafe`
  and waits for it, so a subscription handles one message at a time, in order,
  as in the sync API. Returning acknowledges; raising retries with backoff and
  finally dead-letters, exactly as in the sync API, whatever the exception
  (``TimeoutError`` included; a ``CancelledError`` the handler raises while
  its own task was not cancelled becomes :class:`HandlerCancelledError`). A
  plain (non-async) function is accepted too; it is called on the loop.
* Several event loops may use one object at once (one per thread): each
  loop's publishes complete on that loop (a completer per loop).
* If the event loop is closed (or shuts down, cancelling the handler's task)
  while a subscription is running, the message in hand is **not**
  acknowledged, not retried and not dead-lettered, and the subscription stops
  (a warning is logged): nothing is lost, the message is delivered again when
  the subscriber id subscribes next time. Close the messenger (``async with``)
  before the loop ends to avoid this. At interpreter exit, a handler call
  still waited for is given up the same way (see ``_closing.ExitGate``).
* ``service_name`` / ``correlation_id`` set with :func:`keyop_messenger.context`
  in the calling task are honoured (the task's context is carried to the pool).

Cancellation: cancelling a task awaiting :meth:`~AsyncMessenger.publish` stops
the wait, not the publish: the message was handed to the engine when the call
started and still commits (its id is simply not returned), so a retry after a
cancellation can store the message twice: delivery is at-least-once, and
consumers should be idempotent (e.g. by message id, or the application's own
key). So does an ephemeral ``publish`` still queued for a pool thread. A
``publish_batch`` still queued for a pool thread when cancelled is not made.
``open``/``close`` (and ``async with``) finish what they started even when
cancelled, then re-raise :class:`asyncio.CancelledError`, so a cancelled task
never leaves a data directory locked.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _core
from ._aio_iter import MessageStream, read_entries
from ._closing import CLOSE_TIMEOUT_S, EXIT_GATE
from .config import Config
from .errors import ClosedError, ForkedProcessError, SubscriptionError
from .message import Message
from .positions import Position

if TYPE_CHECKING:
    from typing_extensions import Self

    from .config import AllowedPeer, GatewayToken, TLSConfig
    from .ephemeral import EphemeralMessenger
    from .message import LogEntry
    from .messenger import Messenger
    from .stats import FederationStatus, Stats
    from .subscription import Subscription

__all__ = [
    "DEFAULT_WORKERS",
    "AsyncEphemeralMessenger",
    "AsyncHandler",
    "AsyncMessenger",
    "AsyncSubscription",
    "EventLoopClosedError",
    "HandlerCancelledError",
    "MessageStream",
]

log = logging.getLogger("keyop_messenger")

T = TypeVar("T")
S = TypeVar("S")

#: Threads of the pool each async messenger owns for its blocking calls.
DEFAULT_WORKERS = 8
#: Seconds between checks that the event loop still exists while a handler runs.
_LOOP_CHECK_S = 0.25

AsyncHandler = Callable[[Message], Any]
"""A handler: an ``async def handler(msg)``, or a plain function (called on the
loop); returning acknowledges, raising means retry."""

ConfigLike = Config | Mapping[str, Any] | str | os.PathLike[str]

# Set inside handler coroutines, so close() called from a handler does not wait
# for that very handler (which would never finish).
# (The bridge whose handler runs: see _Bridge.run_here.)
_IN_HANDLER: contextvars.ContextVar[_Bridge | None] = contextvars.ContextVar(
    "keyop_messenger_aio_in_handler", default=None
)


class _Process:
    """This process's id, kept current by a fork hook, so that checking on
    each call that an object is used in the process that opened it is no
    system call (the engine checks for a fork on its own as well)."""

    pid = os.getpid()


os.register_at_fork(after_in_child=lambda: setattr(_Process, "pid", os.getpid()))


class EventLoopClosedError(RuntimeError):
    """Raised to the engine when a handler cannot run to its end because its
    event loop is closed or shutting down (the handler's task was cancelled):
    the subscription stops and the message stays unacknowledged."""


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieves the outcome of a future nobody may await any more (no
    "exception was never retrieved" warning)."""
    if not fut.cancelled():
        fut.exception()


async def _finish(
    fut: asyncio.Future[T], on_cancel: Callable[[], object] | None = None
) -> T:
    """Awaits ``fut`` to completion even if the awaiting task is cancelled
    meanwhile (calling ``on_cancel`` then, to make it end sooner); then
    re-raises the cancellation (or returns the result)."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            if not cancelled and on_cancel is not None:
                on_cancel()
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return fut.result()


class HandlerCancelledError(RuntimeError):
    """What a handler that raised :class:`asyncio.CancelledError` without its
    own task being cancelled (it awaited a task something else cancelled)
    fails with: an ordinary handler failure, retried and then dead-lettered."""


class _Call:
    """One handler call in progress: the delivery thread waits on ``wake``,
    set when the handler's future is done or a request is queued. ``task``
    is the handler's own task; ``ended`` (under ``lock``) once the delivery
    thread has taken the last requests."""

    __slots__ = ("ended", "lock", "requests", "task", "wake")

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.ended = False
        self.task: asyncio.Task[Any] | None = None
        self.requests: collections.deque[tuple[Callable[[], Any], asyncio.Future[Any]]] = (
            collections.deque()
        )


def _own_bridge() -> _Bridge | None:
    """The bridge whose handler is running in the current task, if any. A
    task the handler spawned inherits the context but is not the handler:
    it gets None (as the handler's own task does once its call has ended)."""
    bridge = _IN_HANDLER.get()
    if bridge is None:
        return None
    call = bridge._call
    if call is None or call.task is None or call.task is not asyncio.current_task():
        return None
    return bridge


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not fut.done():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class _Bridge:
    """The sync handler given to the engine: runs ``handler(msg)`` on ``loop``
    and waits for its outcome on the calling (engine) thread."""

    def __init__(
        self,
        handler: Callable[[Message], Any],
        loop: asyncio.AbstractEventLoop,
        channel: str,
        subscriber_id: str | None,
    ) -> None:
        self._handler = handler
        self._loop = loop
        self.channel = channel
        self.subscriber_id = subscriber_id
        self._label = f"{channel}/{subscriber_id}" if subscriber_id else f"{channel} (ephemeral)"
        # Weak: the engine holds this bridge, and a strong reference from it
        # to the subscription (hence to the messenger) would keep an
        # unclosed, dropped messenger and its data directory alive.
        self.subscription: weakref.ref[AsyncSubscription] | None = None
        self.loop_gone = False
        self._call: _Call | None = None

    async def _invoke(self, msg: Message) -> Any:
        _IN_HANDLER.set(self)
        call = self._call
        if call is not None:
            call.task = asyncio.current_task()
        try:
            result = self._handler(msg)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
            if cancelling is None or cancelling():
                raise  # this very task was cancelled (the loop shutting down)
            raise HandlerCancelledError(
                f"{self._label}: the handler raised CancelledError (its task was not cancelled)"
            ) from exc
        return result

    def _abandon(self, why: str = "its event loop is closed") -> EventLoopClosedError:
        """Stops the subscription (the message in hand stays unacknowledged:
        neither retried now nor dead-lettered, but delivered again to the
        subscriber id's next subscription)."""
        if not self.loop_gone:
            self.loop_gone = True
            log.warning(
                "%s: handler stopped (%s); subscription stopped, undelivered "
                "messages stay unacknowledged",
                self._label,
                why,
            )
            sub = self.subscription() if self.subscription is not None else None
            if sub is not None:
                sub._stop_from_engine_thread()
        return EventLoopClosedError(f"{self._label}: {why}")

    def run_here(self, fn: Callable[[], T]) -> asyncio.Future[T] | None:
        """Runs ``fn()`` on the delivery thread waiting for this bridge's
        handler call (called from that handler, on the loop): the engine sees
        a call from the handler itself, which it does not wait for. None when
        no call is in progress."""
        call = self._call
        if call is None:
            return None
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with call.lock:
            if call.ended:
                return None
            call.requests.append((fn, fut))
        call.wake.set()
        return fut

    def _serve(self, call: _Call) -> None:
        """Runs the requests of :meth:`run_here` queued so far."""
        while call.requests:
            fn, fut = call.requests.popleft()
            outcome: tuple[bool, Any]
            try:
                outcome = (True, fn())
            except Exception as exc:
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(_settle, fut, *outcome)

    def __call__(self, msg: Message) -> Any:
        loop = self._loop
        if self.loop_gone or loop.is_closed():
            raise self._abandon()
        if EXIT_GATE.exiting:
            raise self._abandon("the interpreter is exiting")
        call = self._call = _Call()  # before the handler starts: run_here needs it
        coro = self._invoke(msg)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed in between
            self._call = None
            coro.close()
            raise self._abandon() from None
        fut.add_done_callback(lambda _: call.wake.set())
        # Waiting on an event rather than fut.result(timeout): the handler's
        # own TimeoutError must not look like "still waiting" (it is the
        # builtin TimeoutError since Python 3.11).
        try:
            if not EXIT_GATE.enter(call.wake):
                fut.cancel()
                raise self._abandon("the interpreter is exiting")
            while True:
                if not call.wake.wait(_LOOP_CHECK_S):
                    if loop.is_closed():
                        fut.cancel()
                        raise self._abandon()
                    continue
                call.wake.clear()
                self._serve(call)
                if fut.done():
                    break
                if EXIT_GATE.exiting:
                    fut.cancel()
                    raise self._abandon("the interpreter is exiting")
        finally:
            EXIT_GATE.leave(call.wake)
            with call.lock:  # run_here queues nothing more
                call.ended = True
            self._call = None
            self._serve(call)  # still inside the engine's call of this handler
        if fut.cancelled():
            # Only the loop's shutdown (asyncio.run cancelling every task)
            # cancels a handler's own task: stop rather than retry/dead-letter.
            raise self._abandon("its task was cancelled: event loop shutting down")
        return fut.result()


class _AsyncContext:
    """``async with`` for the async classes: entering awaits :meth:`_enter`
    and gives the object itself; leaving awaits ``close()``."""

    async def _enter(self) -> None:
        """Runs when the ``async with`` block is entered (nothing by default)."""

    def __reduce__(self) -> Any:
        # Threads, an event loop and open files do not travel: say so plainly.
        raise TypeError(
            f"cannot pickle {type(self).__name__!r} object: it holds threads and open "
            "files of this process; pass its configuration instead"
        )

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self._enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class _AsyncBase(_AsyncContext, Generic[S]):
    """Thread pool, open/close life cycle and registration shared by both classes."""

    def __init__(self, config: ConfigLike, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._config_arg = config
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="keyop-aio")
        self._sync: S | None = None
        self._types: list[tuple[str, type]] = []
        self._closed = False
        self._opening: concurrent.futures.Future[S] | None = None
        self._pid = os.getpid()
        self._close_timeout = CLOSE_TIMEOUT_S
        #: The completer publish used last (its loop, itself): the fast path.
        self._completer: tuple[asyncio.AbstractEventLoop, _core.Completer] | None = None
        #: One completer per event loop that published (several loops may use
        #: this object at once, each from its own thread).
        self._completers: dict[asyncio.AbstractEventLoop, _core.Completer] = {}
        self._completers_lock = threading.Lock()
        #: The close of the underlying object, once started.
        self._closing: concurrent.futures.Future[None] | None = None
        self._subscriptions: set[AsyncSubscription] = set()

    # -- plumbing -----------------------------------------------------------

    def _submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Runs ``fn`` on the pool with the calling task's context variables."""
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        try:
            return loop.run_in_executor(self._pool, call)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            if self._closed:
                raise ClosedError(f"{type(self).__name__} is closed") from None
            raise

    async def _run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await self._submit(fn, *args, **kwargs)

    def _completer_of(self, loop: asyncio.AbstractEventLoop) -> _core.Completer:
        """The completer of ``loop`` (the running loop), made on first use;
        those of loops closed since are closed."""
        with self._completers_lock:
            completer = self._completers.get(loop)
            if completer is None:
                for other in [lp for lp in self._completers if lp.is_closed()]:
                    self._completers.pop(other).close()
                completer = self._completers[loop] = _core.Completer(loop)
        self._completer = (loop, completer)
        return completer

    def _close_completers(self) -> None:
        """Every outcome is known once the messenger closed: each completer
        hands the last ones over on its own loop, then stops watching."""
        with self._completers_lock:
            completers, self._completers = self._completers, {}
        self._completer = None
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, completer in completers.items():
            if loop is current or loop.is_closed():
                completer.close()
            else:  # another thread's loop: only it may complete its futures
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(completer.close)

    def _check_process(self) -> None:
        if _Process.pid != self._pid:  # the pool and the messenger are the parent's
            raise ForkedProcessError(
                f"this {type(self).__name__} was opened in process {self._pid}, this is "
                f"process {os.getpid()}: open a new one in the child"
            )

    def _require(self) -> S:
        self._check_process()
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        if self._sync is None:
            raise ClosedError(
                f"{type(self).__name__} is not open: use 'async with' or 'await open()'"
            )
        return self._sync

    def _make(self) -> S:
        """Builds and opens (connects) the sync object; runs on the pool."""
        raise NotImplementedError

    def _close_sync(self, sync: S) -> None:
        sync.close()  # type: ignore[attr-defined]

    def _stop_waiting(self, sync: S) -> None:
        """Makes the close running on the pool stop waiting for handlers."""

    # -- life cycle ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    async def open(self) -> None:
        """Opens the underlying messenger on the pool (idempotent). Called by
        ``async with``. If cancelled, it completes and closes what it opened
        before re-raising."""
        self._check_process()
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        if self._sync is not None:
            return
        if self._opening is not None:  # a concurrent open() (of any loop): wait for it
            await _finish(asyncio.wrap_future(self._opening))
            return
        make = functools.partial(contextvars.copy_context().run, self._make)
        opening = self._opening = self._pool.submit(make)
        try:
            self._sync = await _finish(asyncio.wrap_future(opening))
        except asyncio.CancelledError:
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                await _finish(self._submit(self._close_sync, opening.result()))
            raise
        finally:
            self._opening = None

    async def _enter(self) -> None:
        await self.open()

    async def aclose(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Same as :meth:`close` (the name ``contextlib.aclosing`` calls)."""
        await self.close(timeout)

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops every subscription, closes the underlying messenger and the
        thread pool. Idempotent: a close while another is running returns once
        that one has finished. Finishes even when the awaiting task is
        cancelled (Ctrl-C under ``asyncio.run``): it then stops waiting for
        handlers, as Ctrl-C does for :meth:`Messenger.close`, flushes and
        releases everything, and re-raises the cancellation. Called from
        inside a handler, it starts closing and returns at once (waiting
        would wait for that handler itself). A ``timeout``
        that is not a finite number >= 0 raises :class:`ValueError` and
        closes nothing.

        Waits at most ``timeout`` seconds (default 10) for handlers still
        running, as :meth:`Messenger.close` does. In a process forked after
        it was opened it releases nothing (the pool and the messenger are the
        parent's)."""
        _core.check_timeout(timeout)
        if self._closed:
            # Another close is running (one a handler started, perhaps):
            # return once it has finished, unless this is a handler itself.
            closing = self._closing
            if closing is not None and _own_bridge() is None:
                await _finish(asyncio.wrap_future(closing))
            return
        self._closed = True
        self._close_timeout = timeout
        if _Process.pid != self._pid:
            return
        opening, sync = self._opening, self._sync
        if opening is not None:  # close() during open(): wait for it, then close
            with contextlib.suppress(Exception):
                await _finish(asyncio.wrap_future(opening))
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                sync = opening.result()
        self._sync = None
        self._subscriptions.clear()
        if sync is None:
            self._pool.shutdown(wait=False)
            return
        closing = self._closing = self._pool.submit(self._close_sync, sync)
        if _own_bridge() is not None:
            self._pool.shutdown(wait=False)
            return
        try:
            # Cancelled (Ctrl-C under asyncio.run): the close stops waiting
            # for handlers, still flushes and releases, then this re-raises.
            await _finish(asyncio.wrap_future(closing), lambda: self._stop_waiting(sync))
        finally:
            self._pool.shutdown(wait=False)
            self._close_completers()

    # -- registration and publishing -----------------------------------------

    def register_payload_type(self, name: str, cls: type) -> None:
        """As :meth:`Messenger.register_payload_type`; may be called before
        :meth:`open` (the registration is applied when it opens)."""
        if self._sync is not None:
            self._sync.register_payload_type(name, cls)  # type: ignore[attr-defined]
        self._types.append((name, cls))

    def _apply_types(self, sync: Any) -> None:
        for name, cls in self._types:
            sync.register_payload_type(name, cls)

    async def flush(self, timeout: float | None = None) -> None:
        """As ``flush()`` of the sync class, waiting on a worker thread:
        returns once everything published so far is committed and
        acknowledged by the hubs, else raises :class:`KeyopTimeoutError`."""
        sync = self._require()
        await self._run(sync.flush, timeout)  # type: ignore[attr-defined]

    async def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> str:
        """Publishes one message; returns its id once committed (see the sync
        ``publish`` for the errors raised). The message is handed to the
        engine before the first await, without a worker thread; cancelling the
        awaiting task does not undo it: it still commits (at-least-once)."""
        # _require()'s checks inline, and its call only to raise: this runs
        # once per message of every task.
        sync: Any = self._sync
        if sync is None or self._closed or _Process.pid != self._pid:
            sync = self._require()
        if not isinstance(sync, _core.MessengerBase):  # the ephemeral client waits for a hub
            sent = self._submit(
                sync.publish,
                channel,
                payload_type,
                payload,
                service_name=service_name,
                correlation_id=correlation_id,
            )
            # Shielded: a cancelled wait leaves the publish queued for its
            # pool thread, so it is still made (as a durable publish).
            sent.add_done_callback(_consume)
            return await asyncio.shield(sent)
        loop = asyncio.get_running_loop()
        completer = self._completer
        if completer is None or completer[0] is not loop:
            completer = (loop, self._completer_of(loop))
        future: asyncio.Future[str] = completer[1].publish(
            sync, channel, payload_type, payload, service_name, correlation_id
        )
        return await future

    async def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]],
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
    ) -> list[str]:
        """Publishes ``(payload_type, payload)`` pairs all-or-none; returns
        their ids in order. Cancellation as for :meth:`publish`."""
        sync: Any = self._require()
        return await self._run(
            sync.publish_batch,
            channel,
            list(items),
            service_name=service_name,
            correlation_id=correlation_id,
        )

    def _bridge(
        self, handler: Callable[[Message], Any], channel: str, subscriber_id: str | None
    ) -> _Bridge:
        if not callable(handler):
            raise TypeError(f"handler must be callable, got {type(handler).__name__}")
        return _Bridge(handler, asyncio.get_running_loop(), channel, subscriber_id)

    def _track(self, sub: AsyncSubscription, bridge: _Bridge) -> AsyncSubscription:
        """Links a new subscription to its bridge (weakly) and to this object
        (strongly, so a subscription dropped by its caller can still be
        stopped by its bridge)."""
        bridge.subscription = weakref.ref(sub)
        self._subscriptions.add(sub)
        return sub


class AsyncSubscription(_AsyncContext):
    """A running subscription of an async messenger (see :meth:`AsyncMessenger.subscribe`)."""

    def __init__(
        self, owner: _AsyncBase[Any], sync: Subscription | None, bridge: _Bridge, channel: str
    ) -> None:
        self._owner = owner
        self._sync = sync
        self._bridge = bridge
        self._channel = channel
        self._closed = False

    @property
    def channel(self) -> str:
        """The channel delivered."""
        return self._channel

    @property
    def subscriber_id(self) -> str | None:
        """The subscriber id (None for an ephemeral subscription)."""
        return self._sync.subscriber_id if self._sync is not None else None

    @property
    def position(self) -> int | None:
        """Global offset of the next unacknowledged message (None if ephemeral)."""
        return self._sync.position if self._sync is not None else None

    @property
    def active(self) -> bool:
        """False once closed, or stopped because its event loop closed."""
        return not (self._closed or self._bridge.loop_gone)

    async def seek(self, position: Position) -> None:
        """As :meth:`Subscription.seek` (not for an ephemeral subscription).
        Raises :class:`ClosedError` once it or its messenger is closed."""
        if self._sync is None:
            raise SubscriptionError("an ephemeral subscription has no position to seek")
        if self._closed or self._owner._closed:
            what = (
                f"subscription {self._channel!r}/{self.subscriber_id!r}"
                if self._closed
                else type(self._owner).__name__
            )
            raise ClosedError(f"{what} is closed: seek() cannot be called")
        await self._owner._run(self._sync.seek, position)

    def _matches(self, channel: str, subscriber_id: str) -> bool:
        return self._sync is not None and (self._channel, self.subscriber_id) == (
            channel,
            subscriber_id,
        )

    def _stop_from_engine_thread(self) -> None:
        if self._sync is not None:
            self._sync.close()

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops delivery after the handler call in progress and keeps the
        subscriber's offset (subscribing again with the id resumes).
        Idempotent; may be awaited from the handler itself. Waits at most
        ``timeout`` seconds (default 10) for the handler call in progress, as
        :meth:`Subscription.close` does."""
        if self._closed:
            return
        self._closed = True
        self._owner._subscriptions.discard(self)
        self._bridge.loop_gone = True  # ephemeral: no further handler call
        sync = self._sync
        if sync is None or self._owner._closed or _Process.pid != self._owner._pid:
            return
        if _own_bridge() is not None:
            sync._deliverer.stop()
            self._owner._pool.submit(sync.close, timeout)
            return
        await _finish(self._owner._submit(sync.close, timeout))

    def __repr__(self) -> str:
        state = "active" if self.active else "closed"
        return f"<AsyncSubscription {self._channel!r}/{self.subscriber_id!r} {state}>"


class AsyncMessenger(_AsyncBase["Messenger"]):
    """A :class:`~keyop_messenger.Messenger` for asyncio code.

    ``AsyncMessenger(config)`` opens nothing yet: the data directory is opened
    by ``async with`` (or ``await open()``) and closed on exit, also when the
    block is left by an exception or a cancellation. ``max_workers`` bounds the
    threads used for blocking calls.
    """

    def __init__(self, config: ConfigLike, *, max_workers: int = DEFAULT_WORKERS) -> None:
        super().__init__(config, max_workers)
        self._streams: weakref.WeakSet[MessageStream] = weakref.WeakSet()
        # Subscriptions of streams dropped without aclose(), still closing.
        self._stream_closes: dict[tuple[str, str], concurrent.futures.Future[None]] = {}

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """As :meth:`_AsyncBase.close`; also ends every :meth:`messages` loop
        (the message in hand stays unacknowledged)."""
        for stream in list(self._streams):
            stream._end(False)
        await super().close(timeout)

    def _close_sync(self, sync: Messenger) -> None:
        sync.close(self._close_timeout)

    def _stop_waiting(self, sync: Messenger) -> None:
        sync._engine.stop_waiting()

    def _make(self) -> Messenger:
        from .messenger import Messenger

        m = Messenger(self._config_arg)
        try:
            self._apply_types(m)
        except BaseException:
            m.close()
            raise
        return m

    @property
    def messenger(self) -> Messenger:
        """The underlying sync :class:`Messenger` (for non-blocking calls such
        as ``read_channel`` or ``stream_end``). Raises :class:`ClosedError`
        when not open."""
        return self._require()

    @property
    def config(self) -> Config:
        """The configuration of the open messenger."""
        return self._require().config

    async def subscribe(
        self,
        channel: str,
        subscriber_id: str,
        handler: AsyncHandler,
        *,
        on_gap: Callable[[str, str, int, int], Any] | None = None,
        max_retries: int | None = None,
        backoff: tuple[float, float] | None = None,
        dead_letter: bool = True,
        start: Position = "latest",
        reset: bool = False,
    ) -> AsyncSubscription:
        """Delivers ``channel`` to the ``async def`` ``handler`` as subscriber
        ``subscriber_id``, on the running event loop.

        Same semantics as :meth:`Messenger.subscribe`: a new id starts at the
        current end, a known id resumes from its offset file; returning
        acknowledges, raising retries with backoff and eventually
        dead-letters. One message at a time per subscription, in order.
        ``on_gap`` (a plain function, called on an engine thread) is told of
        data gone before it was read, as with :meth:`Messenger.subscribe`;
        so are ``max_retries``, ``backoff``, ``dead_letter`` and raising
        :class:`DeadLetter`.
        ``start`` and ``reset`` choose where it starts, as there.
        """
        sync = self._require()
        bridge = self._bridge(handler, channel, subscriber_id)
        core = await self._run(
            sync.subscribe, channel, subscriber_id, bridge, on_gap=on_gap,
            max_retries=max_retries, backoff=backoff, dead_letter=dead_letter,
            start=start, reset=reset,
        )  # fmt: skip
        return self._track(AsyncSubscription(self, core, bridge, channel), bridge)

    def messages(
        self,
        channel: str,
        subscriber_id: str,
        *,
        start: Position = "latest",
        reset: bool = False,
        buffer: int = 100,
    ) -> MessageStream:
        """``async for msg in am.messages(channel, subscriber_id)``: the
        channel's messages as subscriber ``subscriber_id`` (``start`` and
        ``reset`` as for :meth:`subscribe`), at least once.

        A message is acknowledged (its offset committed) when the loop asks
        for the next one, so a body that raises leaves it unacknowledged and
        it is delivered again to the id's next subscription. Leaving the loop
        by ``break`` inside ``async with am.messages(...) as stream:``
        acknowledges the message in hand; in a bare ``async for`` it cannot be
        told from an exception, so that message is delivered again next time.
        Either way the subscription is closed. The engine's delivery thread
        waits for each body (the event loop never blocks), so at most one
        message is handed over and unanswered at a time: there is no
        read-ahead, and ``buffer`` (>= 1, the capacity of the queue between
        the two) never fills beyond that one message, so it changes neither
        memory nor throughput (it is accepted for compatibility). Closing the
        messenger ends the loop."""
        self._require()
        return MessageStream(self, channel, subscriber_id, start=start, reset=reset, buffer=buffer)

    async def unsubscribe(self, channel: str, subscriber_id: str) -> None:
        """As :meth:`Messenger.unsubscribe` (deletes the offset file). Awaited
        from that subscription's own handler it does not wait for the handler
        (as the sync call made from its handler)."""
        sync = self._require()
        for sub in [s for s in self._subscriptions if s._matches(channel, subscriber_id)]:
            sub._closed = True  # as the sync Subscription: stopped for good
            self._subscriptions.discard(sub)
        bridge = _own_bridge()
        if bridge is not None and (bridge.channel, bridge.subscriber_id) == (
            channel,
            subscriber_id,
        ):
            own = bridge.subscription() if bridge.subscription is not None else None
            if own is not None and own._owner is self:
                # On the delivery thread waiting for this very handler: the
                # engine then stops the subscription without waiting for it.
                done = bridge.run_here(functools.partial(sync.unsubscribe, channel, subscriber_id))
                if done is not None:
                    await done
                    return
        await self._run(sync.unsubscribe, channel, subscriber_id)

    async def stats(self) -> Stats:
        """As :meth:`Messenger.stats`."""
        sync: Any = self._require()
        return await self._run(sync.stats)

    async def federation_status(self) -> FederationStatus:
        """As :meth:`Messenger.federation_status`."""
        return await self._run(self._require().federation_status)

    async def set_allowed_peers(self, peers: list[AllowedPeer]) -> list[str]:
        """As :meth:`Messenger.set_allowed_peers`, on a worker thread."""
        return await self._run(self._require().set_allowed_peers, peers)

    async def set_gateway_access(
        self, allowed_peers: list[AllowedPeer], tokens: list[GatewayToken]
    ) -> None:
        """As :meth:`Messenger.set_gateway_access`, on a worker thread."""
        await self._run(self._require().set_gateway_access, allowed_peers, tokens)

    async def reload_tls(self, tls: TLSConfig) -> None:
        """As :meth:`Messenger.reload_tls` (reads files), on a worker thread."""
        await self._run(self._require().reload_tls, tls)

    async def compact(self) -> dict[str, tuple[int, int, list[str]]]:
        """As :meth:`Messenger.compact` (deletes segments), on a worker thread."""
        return await self._run(self._require().compact)

    async def stream_end(self, channel: str) -> int:
        """As :meth:`Messenger.stream_end`."""
        return await self._run(self._require().stream_end, channel)

    def read_channel(
        self,
        channel: str,
        *,
        start_offset: int = 0,
        skip_gaps: bool = False,
        since: Position | None = None,
        until: Position | None = None,
        limit: int | None = None,
    ) -> AsyncGenerator[LogEntry, None]:
        """``async for entry in am.read_channel(channel, ...)``: as
        :meth:`Messenger.read_channel` (same keywords and errors, raised at
        the first ``__anext__``), reading on a worker thread in chunks."""
        sync = self._require()
        read = functools.partial(
            sync.read_channel, channel, start_offset=start_offset, skip_gaps=skip_gaps,
            since=since, until=until, limit=limit,
        )  # fmt: skip
        return read_entries(self._run, read)

    @property
    def name(self) -> str:
        """As :attr:`Messenger.name`."""
        return self._require().name

    @property
    def hub_address(self) -> tuple[str, int] | None:
        """As :attr:`Messenger.hub_address`."""
        return self._require().hub_address

    @property
    def gateway_address(self) -> tuple[str, int] | None:
        """As :attr:`Messenger.gateway_address`."""
        return self._require().gateway_address

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """As :attr:`Messenger.metrics_address`."""
        return self._require().metrics_address

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._sync is not None else "new")
        return f"<AsyncMessenger {state}>"


class AsyncEphemeralMessenger(_AsyncBase["EphemeralMessenger"]):
    """An :class:`~keyop_messenger.EphemeralMessenger` for asyncio code.

    ``async with`` (or ``await connect()``) dials the hub; leaving the block
    closes the connection. ``publish`` returns once the hub acknowledged the
    commit, or raises ``ConnectionLostError``.
    """

    def __init__(
        self,
        config: ConfigLike,
        *,
        auto_reconnect: bool = False,
        max_workers: int = DEFAULT_WORKERS,
    ) -> None:
        super().__init__(config, max_workers)
        self._auto_reconnect = auto_reconnect

    def _make(self) -> EphemeralMessenger:
        from .ephemeral import EphemeralMessenger

        m = EphemeralMessenger(self._config_arg, auto_reconnect=self._auto_reconnect)
        try:
            self._apply_types(m)
            m.connect()
        except BaseException:
            m.close()
            raise
        return m

    async def connect(self) -> None:
        """Dials the hub (same as :meth:`open`)."""
        await self.open()

    @property
    def messenger(self) -> EphemeralMessenger:
        """The underlying sync :class:`EphemeralMessenger`."""
        return self._require()

    async def subscribe(self, channel: str, handler: AsyncHandler) -> AsyncSubscription:
        """Runs the ``async def`` ``handler`` on the running event loop for
        every live message of ``channel`` (which must be in the hub entry's
        ``subscribe`` list). There is no retry: an exception is logged."""
        sync = self._require()
        bridge = self._bridge(handler, channel, None)

        def gated(msg: Message) -> None:
            if bridge.loop_gone:
                return
            bridge(msg)

        sync.subscribe(channel, gated)  # does not block: it only adds the handler
        return self._track(AsyncSubscription(self, None, bridge, channel), bridge)

    def status(self) -> dict[str, Any]:
        """As :meth:`EphemeralMessenger.status` (non-blocking)."""
        return self._require().status()

    @property
    def name(self) -> str:
        """As :attr:`EphemeralMessenger.name`."""
        return self._require().name

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._sync is not None else "new")
        return f"<AsyncEphemeralMessenger {state}>"
