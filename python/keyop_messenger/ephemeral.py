"""EphemeralMessenger: a hub client with no local storage.

For short-lived processes (scripts, Spark tasks) that publish into a hub, and
for live-only listeners. ``publish()`` returns once the hub has committed the
message and acknowledged it; without a connection it raises
:class:`ConnectionLostError` at once instead of waiting.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _core
from ._callbacks import OnConnect, OnDisconnect, OnRefused, dispatcher
from ._closing import _SyncContext, refuse_when_closed
from .config import Config
from .config.loading import as_config
from .context import resolve
from .errors import ConfigError, PolicyError, SubscriptionError, send_batch, unicode_error
from .message import message_from_parts
from .payloads import PayloadRegistry, to_plain
from .subscription import Handler

__all__ = ["EphemeralMessenger"]

log = logging.getLogger("keyop_messenger")

#: Seconds ``connect()`` waits for the first connection by default.
CONNECT_TIMEOUT_S = 10.0
#: Seconds ``publish()`` waits for the hub's acknowledgement by default.
PUBLISH_TIMEOUT_S = 60.0


@refuse_when_closed(lambda e: e._closed, lambda e: f"ephemeral messenger {e.name!r}")
class EphemeralMessenger(_SyncContext):
    """A storage-less client of the first hub in ``config.client.hubs``.

    Uses the config's ``name`` (sent to the hub; should equal the certificate
    CN), ``tls`` and ``federation`` settings. Channels listed in that hub
    entry's ``subscribe`` are requested at connect time; :meth:`subscribe`
    attaches handlers to them. The hub keeps no cursor for an ephemeral
    client, so only messages stored while connected are received.

    ``auto_reconnect=True`` keeps reconnecting with backoff after a loss;
    publishes made meanwhile wait in the bounded outbound buffer
    (``federation.send_buffer_messages`` publish calls). A full buffer raises
    :class:`BufferFullError`.

    ``config`` is a :class:`Config`, a mapping in the YAML shape or the path
    of a YAML file. ``on_connect``, ``on_disconnect`` and ``on_refused`` are
    as for :class:`Messenger`. After ``close()`` every method but ``close()`` raises
    :class:`ClosedError`.
    """

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | os.PathLike[str],
        *,
        auto_reconnect: bool = False,
        on_connect: OnConnect | None = None,
        on_disconnect: OnDisconnect | None = None,
        on_refused: OnRefused | None = None,
    ) -> None:
        config = as_config(config)
        if not config.client.hubs:
            raise ConfigError(["client.hubs: an EphemeralMessenger needs at least one hub"])
        missing = [name for name in ("cert", "key", "ca") if not getattr(config.tls, name)]
        if missing:
            raise ConfigError(
                [f"tls.{name}: required by an EphemeralMessenger (federation is always TLS)"
                 for name in missing]
            )
        self._config = config
        self._registry = PayloadRegistry()
        self._handlers: dict[str, list[Handler]] = {}
        self._lock = threading.Lock()
        self._closed = False
        hub = config.client.hubs[0]
        settings = {
            "name": config.name,
            "hub": {"addr": hub.addr, "subscribe": list(hub.subscribe), "publish": []},
            "tls": {
                "cert": config.tls.cert,
                "key": config.tls.key,
                "ca": config.tls.ca,
                "min_version": config.tls.min_version,
                "expiry_warn_days": config.tls.expiry_warn_days,
            },
            "federation": {
                "reconnect_base_ms": config.federation.reconnect_base_ms,
                "reconnect_max_ms": config.federation.reconnect_max_ms,
                "reconnect_jitter": config.federation.reconnect_jitter,
                "max_batch_bytes": config.federation.max_batch_bytes,
            },
            "auto_reconnect": auto_reconnect,
            "buffer_messages": config.federation.send_buffer_messages,
        }
        self._client = _core.EphemeralClient(
            json.dumps(settings), dispatcher(on_connect, on_disconnect, on_refused)
        )
        self._client.set_handler(self._dispatch)

    @property
    def name(self) -> str:
        """The instance name written as ``origin``."""
        return self._config.name

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Dials the hub and waits up to ``timeout`` seconds for the handshake.
        Raises :class:`KeyopTimeoutError` if no connection was made in time
        (with ``auto_reconnect`` it keeps dialing in the background), and
        :class:`ConnectionLostError` if the hub refused or could not be reached
        without ``auto_reconnect``. Ctrl-C stops the waiting."""
        self._client.connect(timeout)

    def register_payload_type(self, name: str, cls: type) -> None:
        """As :meth:`Messenger.register_payload_type`."""
        self._registry.register(name, cls)

    def subscribe(self, channel: str, handler: Handler) -> None:
        """Calls ``handler(message)`` for every live message on ``channel``.

        Only channels in the hub entry's ``subscribe`` list are received:
        another raises :class:`SubscriptionError`, and one the hub's handshake
        said it will not deliver to this peer (not in its allowed subscribe
        list) raises :class:`PolicyError`. Handlers run on an engine thread
        before the hub is acknowledged; an exception is logged (there is no
        retry or dead letter for ephemeral clients)."""
        try:
            _core.validate_channel(channel)
        except UnicodeEncodeError as exc:
            raise unicode_error(exc, channel=channel) from None
        hub = self._config.client.hubs[0]
        if channel not in hub.subscribe:
            raise SubscriptionError(
                f"channel {channel!r} is not in the subscribe list of hub {hub.addr} "
                f"(client.hubs[0].subscribe: {list(hub.subscribe)}): the hub sends only the "
                "channels asked for when connecting; add it there"
            )
        if channel in self._client.status()["refused_subscriptions"]:
            raise PolicyError(
                f"hub {hub.addr} will not deliver channel {channel!r} to {self.name!r}: it is "
                "not in that peer's allowed subscribe list on the hub"
            )
        with self._lock:
            self._handlers.setdefault(channel, []).append(handler)

    def _dispatch(self, rows: list[tuple[Any, ...]]) -> None:
        for _offset, *fields in rows:
            handlers = self._handlers.get(fields[2])
            if not handlers:
                continue
            try:
                message = message_from_parts(*fields, self._registry)
            except Exception as exc:
                log.warning("ephemeral: undecodable message %s: %s", fields[0], exc)
                continue
            for handler in handlers:
                try:
                    handler(message)
                except Exception:
                    log.exception("ephemeral: handler failed on %s", message.id)

    def publish(
        self,
        channel: str,
        payload_type: str,
        payload: Any,
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
        timeout: float = PUBLISH_TIMEOUT_S,
    ) -> str:
        """Publishes one message; returns its id once the hub committed it.
        See :meth:`publish_batch` for ``timeout``.

        Raises :class:`PolicyError` (naming the channel and the hub) when the
        hub refuses the message: a channel not in this peer's allowed publish
        list (known from the hub's handshake, so nothing is sent), or a record
        the hub's acknowledgement lists as refused (policy, size, validity).
        A refused message was not stored and no id is returned."""
        return self.publish_batch(
            channel,
            [(payload_type, payload)],
            service_name=service_name,
            correlation_id=correlation_id,
            timeout=timeout,
        )[0]

    def publish_batch(
        self,
        channel: str,
        items: Iterable[tuple[str, Any]],
        *,
        service_name: str | None = None,
        correlation_id: str | None = None,
        timeout: float = PUBLISH_TIMEOUT_S,
        ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Publishes ``(payload_type, payload)`` pairs in one frame; returns
        their ids once the hub committed and acknowledged the frame.

        Raises :class:`PolicyError` when the hub refuses any of them (see
        :meth:`publish`); the others may have been stored.

        Waits at most ``timeout`` seconds (default 60) for the
        acknowledgement, also while disconnected with ``auto_reconnect``;
        then raises :class:`KeyopTimeoutError`: a publish not yet sent is
        dropped, one already sent may still have been stored by the hub
        (at-least-once). Ctrl-C stops the waiting.

        ``ids``: one id per item, chosen by the caller (1-64 bytes of
        ``A-Za-z0-9-_.:``; :class:`InvalidNameError` otherwise): the hub drops
        a record whose id it has seen recently (``dedup.seen_id_lru_size``),
        so a batch sent again with the same ids is stored once. Default: new ids."""
        pairs = list(items)
        self._registry.check_batch(pairs)
        service, corr = resolve(service_name, correlation_id)
        send = functools.partial(
            self._client.publish_batch,
            timeout_s=timeout,
            ids=None if ids is None else list(ids),
        )
        return send_batch(send, channel, pairs, service, corr, to_plain)

    def status(self) -> dict[str, Any]:
        """``connected``, ``reconnects``, ``failed_attempts``, ``unacked_bytes``,
        ``refused`` (records the hub refused, per channel) and
        ``refused_subscriptions`` (channels of the subscribe list the hub's
        handshake said it will not deliver)."""
        return self._client.status()

    def flush(self, timeout: float | None = None) -> None:
        """Returns once everything published so far is acknowledged by the hub: no
        publish (from any thread, including those waiting in the outbound
        buffer while reconnecting) is waiting for the hub's answer.

        Raises :class:`KeyopTimeoutError` after ``timeout`` seconds (None: wait
        as long as it takes), naming per hub and channel how many records and
        bytes are still pending. The GIL is released while waiting; Ctrl-C
        interrupts it (``KeyboardInterrupt``)."""
        self._client.flush(timeout)

    def close(self) -> None:
        """Closes the connection; publishes still waiting fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    def _enter(self) -> None:
        """Entering a ``with`` block connects first."""
        self.connect()

