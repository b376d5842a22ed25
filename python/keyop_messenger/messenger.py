"""The Messenger: durable local publish on top of the Rust engine."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _core
from ._callbacks import OnConnect, OnDisconnect, OnRefused, dispatcher
from ._closing import CLOSE_TIMEOUT_S, _SyncContext, refuse_when_closed
from .config import AllowedPeer, Config, GatewayToken, TLSConfig
from .config.loading import as_config
from .config.validation import MAX_U32
from .context import _CONTEXT, resolve
from .errors import ConfigError, send_batch, unicode_error
from .message import LogEntry
from .payloads import PayloadRegistry, to_plain
from .positions import Position, to_core
from .reading import check_limit, check_start_offset, entries
from .subscription import Deliverer, Handler, Subscription, in_handler

if TYPE_CHECKING:
    # Imported where used: an idle messenger needs neither (idle memory, docs/performance.md).
    from .metrics import MetricsServer
    from .stats import FederationStatus, Stats

__all__ = ["GapHandler", "Messenger"]

GapHandler = Callable[[str, str, int, int], Any]
"""``on_gap(channel, subscriber_id, from_offset, to_offset)``: bytes
``from_offset..to_offset`` of the channel were gone before the subscriber read
them (deleted by retention, a removed or truncated segment)."""

_MIB = 1024 * 1024
#: Seconds between retention passes (as in keyop-messenger 1.4).
RETENTION_INTERVAL_S = 30.0
#: Longest retry wait a subscriber's ``backoff`` may give (one day).
MAX_BACKOFF_S = 86_400.0

# Messengers still open at interpreter exit are closed first, so engine
# threads never call into a finalising interpreter. Each close waits at most
# CLOSE_TIMEOUT_S for handlers still running, so exit never hangs on them;
# in a forked child it releases nothing (the parent's messengers).
_OPEN: weakref.WeakSet[Messenger] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for m in list(_OPEN):
        m.close()


@refuse_when_closed(lambda m: m._closed, lambda m: f"messenger {m.name!r}")
class Messenger(_core.MessengerBase, _SyncContext):
    """A messenger instance owning one data directory.

    ``publish(channel, payload_type, payload, *, service_name=None,
    correlation_id=None)`` returns the message id once the message is
    committed: fdatasynced with ``storage.sync_interval_ms: 0`` (concurrent
    publishers share one fsync), or written to the file with
    ``sync_interval_ms > 0`` (a timer fsyncs). It is the hot path, so it is
    implemented in the extension (see ``MessengerBase.publish``).
    Use it as a context manager, or call :meth:`close`. After ``close()``
    every method but ``close()`` raises :class:`ClosedError`.

    ``config`` is a :class:`Config`, a mapping in the YAML shape (built with
    :meth:`Config.from_dict`) or the path of a YAML file.

    Client links report to the optional callbacks ``on_connect(hub)``,
    ``on_disconnect(hub, reason)`` and ``on_refused(hub, channel, count)``
    (``hub`` is the configured ``host:port``). They run on one engine thread,
    with the GIL, in event order; an exception in one is logged and ignored.
    """

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | os.PathLike[str],
        *,
        on_connect: OnConnect | None = None,
        on_disconnect: OnDisconnect | None = None,
        on_refused: OnRefused | None = None,
    ) -> None:
        config = as_config(config)
        config.validate()
        self._config = config
        self._registry = PayloadRegistry()
        self._lock = threading.Lock()
        self._closed = False
        self._close_done = threading.Event()
        self._pid = os.getpid()
        self._metrics: MetricsServer | None = None
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()
        storage = config.storage
        self._engine = _core.Engine(
            storage.data_dir,
            config.name,
            sync_interval_ms=storage.sync_interval_ms,
            segment_bytes=max(storage.segment_mb(), 0) * _MIB,
        )
        self._engine.start_retention(int(RETENTION_INTERVAL_S * 1000), **self._retention())
        self._bind_publish(
            self._engine, self._registry.entries, self._registry.check, _CONTEXT, to_plain,
            unicode_error,
        )
        _OPEN.add(self)
        if config.hub.enabled or config.client.enabled:
            try:
                self._engine.start_federation(
                    json.dumps(_federation_settings(config)),
                    dispatcher(on_connect, on_disconnect, on_refused),
                )
            except BaseException:
                self.close()
                raise
        if config.gateway.enabled:
            try:
                self._engine.start_gateway(json.dumps(_gateway_settings(config)))
            except BaseException:
                self.close()
                raise
        if config.metrics.listen_addr:
            from .metrics import MetricsServer

            try:
                self._metrics = MetricsServer(self, config.metrics.listen_addr).start()
            except BaseException:
                self.close()
                raise

    def _retention(self) -> dict[str, Any]:
        lag_mb = self._config.storage.max_subscriber_lag_mb
        ttl = self._config.subscribers.offset_ttl
        limits = self._config.retention
        return {
            "max_lag_bytes": lag_mb * _MIB if lag_mb > 0 else None,
            "offset_ttl_ms": _ms_or_none(ttl),
            "max_age_ms": _ms_or_none(limits.max_age),
            "max_bytes": limits.max_bytes or None,
            "channels": {
                c.name: (_ms_or_none(c.max_age), c.max_bytes or None) for c in limits.channels
            },
        }

    @property
    def config(self) -> Config:
        """The configuration this messenger was built from."""
        return self._config

    @property
    def name(self) -> str:
        """The instance name, written as ``origin`` in published envelopes."""
        return self._config.name

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the ``/metrics`` listener is bound to (useful with
        port 0), or None when ``metrics.listen_addr`` is empty."""
        return self._metrics.address if self._metrics is not None else None

    @property
    def hub_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the hub listens on (useful with port 0), or None."""
        return self._engine.hub_address

    @property
    def gateway_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the HTTP gateway listens on (useful with port 0), or
        None when ``gateway.enabled`` is false."""
        return self._engine.gateway_address

    def stats(self) -> Stats:
        """A typed snapshot: per channel (messages published since open, stream
        and disk bytes, subscribers with lag and oldest pending message),
        totals, latency percentiles (publish, consume, handler) over a window
        of recent samples, and federation links and listener."""
        from .stats import stats_from_engine

        return stats_from_engine(self._engine.stats())

    def federation_status(self) -> FederationStatus:
        """A typed snapshot: ``hub`` (:class:`HubStatus`: ``accepted``,
        ``rejected``, connected ``peers``; None when the hub is not enabled)
        and ``clients``, one :class:`HubLinkStatus` per configured hub:
        ``addr``, ``connected``, ``reconnects``, ``failed_attempts``,
        ``refused`` (records the hub refused, per channel),
        ``refused_channels`` (configured publish channels the hub's handshake
        refuses; not sent, kept here) and ``refused_subscriptions``."""
        from .stats import federation_status_from_engine

        return federation_status_from_engine(self._engine.federation_status())

    def set_allowed_peers(self, peers: list[AllowedPeer]) -> list[str]:
        """Replaces ``hub.allowed_peers`` of the running hub (``keyop-messenger
        run`` does it on SIGHUP). Connected peers whose entry went or changed
        (every connection of theirs, durable or ephemeral) are disconnected
        and reconnect under the new list; returns their names.
        Raises :class:`FederationError` when the hub is not enabled."""
        return self._engine.set_allowed_peers(json.dumps([dataclasses.asdict(p) for p in peers]))

    def set_gateway_access(
        self, allowed_peers: list[AllowedPeer], tokens: list[GatewayToken]
    ) -> None:
        """Replaces the HTTP gateway's certificate clients (``hub.allowed_peers``)
        and bearer tokens (``gateway.tokens``); ``keyop-messenger run`` does it on
        SIGHUP. Every request from now on is checked against them; event streams
        already open go on until they end. Raises :class:`ConfigError` when the
        gateway is not running."""
        self._engine.set_gateway_access(
            json.dumps([dataclasses.asdict(p) for p in allowed_peers]),
            json.dumps([dataclasses.asdict(t) for t in tokens]),
        )

    def reload_tls(self, tls: TLSConfig) -> None:
        """Loads the certificate, key and CA files of ``tls`` again (``keyop-messenger
        run`` does it on SIGHUP), with the checks made at start: connections
        accepted or dialed from now on use them, established ones stay up.
        Rotate certificates by replacing the files and calling this. Raises
        :class:`FederationError` naming the file when one does not load (the
        running certificates stay) or when no hub or client is running."""
        self._engine.reload_tls(json.dumps(dataclasses.asdict(tls)))

    def register_payload_type(self, name: str, cls: type) -> None:
        """Associates payload type ``name`` with ``cls`` (dataclass, pydantic
        model, ``dict`` or ``TypedDict``): publishes of that type are checked
        against it and delivered payloads are decoded into it."""
        self._registry.register(name, cls)

    def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]],
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
        ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Publishes ``(payload_type, payload)`` pairs with one write and one
        fsync: all are committed or none is. Returns their ids in order.

        ``ids``: one id per item, chosen by the caller (1-64 bytes of
        ``A-Za-z0-9-_.:``; :class:`InvalidNameError` otherwise), e.g. derived
        from a job so that a retried job reuses them; the messenger does not
        deduplicate them. Default: new ids."""
        pairs = list(items)
        self._registry.check_batch(pairs)
        service, corr = resolve(service_name, correlation_id)
        send = self._engine.publish_batch
        if ids is not None:
            send = functools.partial(send, ids=list(ids))
        return send_batch(send, channel, pairs, service, corr, to_plain)

    def subscribe(
        self,
        channel: str,
        subscriber_id: str,
        handler: Handler,
        *,
        on_gap: GapHandler | None = None,
        max_retries: int | None = None,
        backoff: tuple[float, float] | None = None,
        dead_letter: bool = True,
        start: Position = "latest",
        reset: bool = False,
    ) -> Subscription:
        """Delivers ``channel`` to ``handler`` as subscriber ``subscriber_id``.

        A new id (one with no offset file) starts at ``start``: ``"latest"``
        (the default: the current end, history is skipped), ``"earliest"``
        (the oldest record kept), an ``int`` byte offset that starts a record,
        or a timezone-aware ``datetime`` (the first record published at or
        after it). A known id resumes from its offset file (also after a
        crash) and ``start`` is ignored, unless ``reset=True``, which moves it
        to ``start`` anyway. An offset that is not a record boundary, or a
        naive datetime, raises :class:`ConfigError`. ``handler`` runs on an
        engine thread and receives a :class:`Message`; returning acknowledges,
        raising retries with backoff (100 ms doubling to 5 s) up to
        ``subscribers.max_retries`` times, then the message goes to
        ``<channel>.dead-letter``. A payload that does not decode into its
        registered type is dead-lettered at once, and so is a message whose
        handler raises :class:`DeadLetter` (``reason`` becomes the dead
        letter's error text); unregistered types arrive as
        plain JSON data. A record that cannot be read at all (not an envelope,
        or a payload nested too deep) is quarantined (copied to
        ``<data_dir>/quarantine/<channel>/<offset>.jsonl``) and dead-lettered
        with the reason; its neighbours are delivered as usual.

        When data the subscriber had not read is gone (deleted by retention,
        a removed or truncated segment), delivery goes on after it and the gap
        is reported: a WARNING log, ``Stats.data_loss``, and
        ``on_gap(channel, subscriber_id, from_offset, to_offset)`` if given
        (called on the delivery thread; an exception it raises is printed).

        ``max_retries`` (default ``subscribers.max_retries``) and ``backoff``
        (``(initial_s, max_s)``, default ``(0.1, 5.0)``: the first retry waits
        ``initial_s``, each next one twice as long, at most ``max_s``)
        override the configuration for this subscriber. ``dead_letter=False``
        logs (ERROR) and skips a message that failed for good instead of
        dead-lettering it; so does a subscriber of a ``.dead-letter`` channel
        (a dead letter is not dead-lettered again). A dead letter's payload has the 1.4 fields
        (``original``, ``retries``, ``last_error``, ``failed_at``) and
        ``reason`` (``"rejected"`` or ``"retries_exhausted"``), ``attempts``
        (handler calls), ``channel`` and ``offset`` of the original.

        Raises :class:`InvalidNameError` for bad names (ids starting with
        ``fed-`` are reserved) and :class:`SubscriptionError` if the id is
        already subscribed to the channel.
        """
        if not callable(handler):
            raise TypeError(
                f"subscribe({channel!r}, {subscriber_id!r}): handler must be callable, "
                f"got {type(handler).__name__}"
            )
        retries = self._config.subscribers.max_retries if max_retries is None else max_retries
        initial_s, max_s = (0.1, 5.0) if backoff is None else backoff
        if not 0 <= retries <= MAX_U32 or not 0 <= initial_s <= max_s <= MAX_BACKOFF_S:
            raise ConfigError(
                f"subscribe({channel!r}, {subscriber_id!r}): max_retries must be between 0 "
                f"and {MAX_U32} and backoff (initial_s, max_s) must have 0 <= initial_s <= "
                f"max_s <= {MAX_BACKOFF_S:g}; got max_retries={retries!r}, backoff={backoff!r}"
            )
        kind, value = to_core(start)
        deliverer = Deliverer(handler, self._registry, channel, subscriber_id)
        gap = None if on_gap is None else _gap_reporter(on_gap, channel, subscriber_id)
        try:
            core = self._engine.subscribe(
                channel,
                subscriber_id,
                deliverer,
                max_retries=retries,
                offset_flush_interval_ms=self._config.storage.offset_flush_interval_ms,
                backoff_base_ms=round(initial_s * 1000),
                backoff_max_ms=round(max_s * 1000),
                dead_letter=dead_letter,
                on_gap=gap,
                start_kind=kind,
                start_value=value,
                reset=reset,
            )
        except UnicodeEncodeError as exc:
            raise unicode_error(exc, channel=channel, subscriber_id=subscriber_id) from None
        subscription = Subscription(core, deliverer)
        self._subscriptions.add(subscription)
        return subscription

    def unsubscribe(self, channel: str, subscriber_id: str) -> None:
        """Stops ``subscriber_id`` (if running) and deletes its offset file, so
        subscribing again starts at the end. Raises :class:`SubscriptionError`
        if the subscriber does not exist.

        No message is handed to the handler once this is called. It waits up
        to 10 s for a handler call in progress, as :meth:`close` does (called
        from that handler, it does not wait); a handler still running then is
        left to finish, and no offset is written for it."""
        for subscription in list(self._subscriptions):
            if (subscription.channel, subscription.subscriber_id) == (channel, subscriber_id):
                subscription._deliverer.stop()
        try:
            self._engine.unsubscribe(channel, subscriber_id)
        except UnicodeEncodeError as exc:
            raise unicode_error(exc, channel=channel, subscriber_id=subscriber_id) from None

    def compact(self) -> dict[str, tuple[int, int, list[str]]]:
        """Runs a retention pass now (it also runs every 30 s): deletes sealed
        segments that every offset file of their channel has passed (a channel
        with no offset file keeps its data), and those the ``retention``
        section's ``max_age`` / ``max_bytes`` limits select. Returns, per
        channel where something happened, ``(segments_deleted, bytes_freed,
        removed_offset_ids)``."""
        return self._engine.compact(**self._retention())

    def read_channel(
        self,
        channel: str,
        *,
        start_offset: int = 0,
        skip_gaps: bool = False,
        since: Position | None = None,
        until: Position | None = None,
        limit: int | None = None,
    ) -> Iterator[LogEntry]:
        """Iterates the committed messages of ``channel`` from ``start_offset``
        (a global byte offset; 0 means the oldest record kept), decoding
        payloads with the registered types.

        ``since`` (instead of ``start_offset``) and ``until`` take a position
        (see :data:`~keyop_messenger.positions.Position`): an offset that
        starts a record or a timezone-aware ``datetime``; the messages read
        are those from ``since`` up to, not including, ``until`` (for a
        datetime: published before it). ``limit`` caps how many are returned.

        Unreadable records are quarantined (see :meth:`subscribe`) and passed
        over. If bytes after ``start_offset`` are gone (deleted by retention,
        a removed or truncated segment), raises :class:`DataLossError` naming
        the byte range, unless ``skip_gaps`` (then the gap is only logged and
        counted in ``Stats.data_loss``).

        Raises :class:`ChannelNotFoundError` (at the call, not at the first
        ``next()``) if the channel does not exist; nothing is created; and
        :class:`ConfigError` for a ``start_offset`` that is negative, past the
        end of the channel or not the start of a record."""
        check_limit(limit)
        check_start_offset(start_offset)
        try:
            if since is not None:
                start_offset = self._engine.resolve_position(channel, *to_core(since, "since"))
            end = None
            if until is not None:
                end = self._engine.resolve_position(channel, *to_core(until, "until"))
            rows = self._engine.read(channel, start_offset, skip_gaps=skip_gaps, until=end)
        except UnicodeEncodeError as exc:
            raise unicode_error(exc, channel=channel) from None
        return entries(rows, self._registry, limit)

    def stream_end(self, channel: str) -> int:
        """The committed end of ``channel``: the offset the next record gets.
        For a channel not created yet that is 0 (where its first record will
        go); nothing is created. The reading calls (:meth:`read_channel`,
        ``since=``) raise :class:`ChannelNotFoundError` for such a channel."""
        try:
            return self._engine.stream_end(channel)
        except UnicodeEncodeError as exc:
            raise unicode_error(exc, channel=channel) from None

    def flush(self, timeout: float | None = None) -> None:
        """Returns once everything published so far is committed locally
        (fdatasynced, also with ``storage.sync_interval_ms > 0``) and
        acknowledged by every hub it is forwarded to: each client link's
        forwarding cursor has reached, for every channel it publishes to that
        hub, the end the channel had when ``flush()`` was called. Channels a
        hub's handshake refuses (``federation_status()``'s
        ``refused_channels``) are not sent and not waited for; records a hub
        refuses count as answered (see ``refused``).

        Raises :class:`KeyopTimeoutError` after ``timeout`` seconds (None: wait
        as long as it takes), naming per hub and channel how many records and
        bytes are still pending. The GIL is released while waiting; Ctrl-C
        interrupts it (``KeyboardInterrupt``)."""
        self._engine.flush(timeout)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops every subscription (each persists its offset), then flushes
        and closes every channel. Idempotent; safe to call from a handler.

        Waits at most ``timeout`` seconds (default 10) for handlers still
        running. A handler that has not returned by then is left running: a
        WARNING names its subscriber and channel, and its message stays
        unacknowledged (the offset does not move past it), so it is
        delivered again next time; the channels are still flushed and
        closed, and the data directory is released. Ctrl-C stops the waiting
        (the close still finishes) and raises :class:`KeyboardInterrupt`.

        A ``close()`` while another thread's is in progress returns once that
        one has finished (the data directory is then released), except in a
        handler, which must not wait for its own return.

        In a process forked after this messenger was opened, ``close()``
        releases nothing and touches no file (they are the parent's); every
        other call there raises :class:`ForkedProcessError`.

        A ``timeout`` that is not a finite number >= 0 raises
        :class:`ValueError` and closes nothing.
        """
        _core.check_timeout(timeout)
        with self._lock:
            first = not self._closed
            self._closed = True
        if not first:
            if os.getpid() == self._pid and not in_handler():
                self._close_done.wait()
            return
        _OPEN.discard(self)
        if os.getpid() != self._pid:
            return
        try:
            for subscription in list(self._subscriptions):
                subscription._deliverer.stop()
            if self._metrics is not None:
                self._metrics.close()
            self._engine.close(timeout)
        finally:
            self._close_done.set()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Messenger {self.name!r} data_dir={self._config.storage.data_dir!r} {state}>"


def _ms_or_none(d: datetime.timedelta) -> int | None:
    """Milliseconds of a positive duration; None (off) for zero or less."""
    return int(d.total_seconds() * 1000) if d.total_seconds() > 0 else None


def _gap_reporter(
    on_gap: GapHandler, channel: str, subscriber_id: str
) -> Callable[[int, int], None]:
    """The engine's ``on_gap(from, to)`` calling the user's with the names."""

    def gap(start: int, end: int) -> None:
        on_gap(channel, subscriber_id, start, end)

    return gap


def _federation_settings(config: Config) -> dict[str, Any]:
    """The engine's federation settings, from a validated config."""
    ttl = config.hub.fed_client_offset_ttl.total_seconds()
    return {
        "name": config.name,
        "hub": {
            "enabled": config.hub.enabled,
            "listen_addr": config.hub.listen_addr,
            "allowed_peers": [dataclasses.asdict(p) for p in config.hub.allowed_peers],
            "fed_client_offset_ttl_s": ttl,
        },
        "client": {
            "enabled": config.client.enabled,
            "hubs": [dataclasses.asdict(h) for h in config.client.hubs],
        },
        "tls": dataclasses.asdict(config.tls),
        "federation": {
            "reconnect_base_ms": config.federation.reconnect_base_ms,
            "reconnect_max_ms": config.federation.reconnect_max_ms,
            "reconnect_jitter": config.federation.reconnect_jitter,
            "max_batch_bytes": config.federation.max_batch_bytes,
        },
        "seen_id_lru_size": config.dedup.seen_id_lru_size,
        "audit_max_size_mb": config.audit.max_size_mb,
        "audit_max_files": config.audit.max_files,
    }


def _gateway_settings(config: Config) -> dict[str, Any]:
    """The engine's gateway settings, from a validated config."""
    gw = config.gateway
    return {
        "listen_addr": gw.listen_addr,
        "tls": dataclasses.asdict(config.tls),
        "allowed_peers": [dataclasses.asdict(p) for p in config.hub.allowed_peers],
        "tokens": [dataclasses.asdict(t) for t in gw.tokens],
        "max_body_bytes": gw.max_body_bytes,
        "rate_limit_per_s": float(gw.rate_limit_per_s),
        "rate_limit_burst": gw.rate_limit_burst,
        "max_streams": gw.max_streams,
        "max_connections": gw.max_connections,
        "header_timeout_ms": _ms(gw.header_timeout),
        "idle_timeout_ms": _ms(gw.idle_timeout),
        "max_wait_ms": _ms(gw.max_wait),
    }


def _ms(d: datetime.timedelta) -> int:
    return max(1, int(d.total_seconds() * 1000))
