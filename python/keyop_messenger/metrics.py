"""Prometheus metrics: the :class:`~keyop_messenger.stats.Stats` snapshot in the
Prometheus text exposition format (version 0.0.4), and a small HTTP server for it.

With ``metrics.listen_addr: "127.0.0.1:9464"`` in the configuration a
:class:`~keyop_messenger.Messenger` serves ``GET /metrics`` itself; otherwise::

    server = MetricsServer(messenger, "0.0.0.0:9464")
    server.start()
    ...
    server.close()

Families (every value comes from one ``Messenger.stats()`` call per scrape):

==============================================================  =======  ====================
name                                                            type     labels
==============================================================  =======  ====================
``keyop_messages_published_total``                              counter  channel
``keyop_stream_bytes``                                          gauge    channel
``keyop_disk_bytes``                                            gauge    channel
``keyop_subscriber_lag_bytes``                                  gauge    channel, subscriber
``keyop_subscriber_oldest_pending_timestamp_seconds``           gauge    channel, subscriber
``keyop_subscriber_active``                                     gauge    channel, subscriber
``keyop_channels``                                              gauge
``keyop_data_loss_total``                                       counter  kind (gap, quarantined)
``keyop_data_loss_bytes_total``                                 counter
``keyop_latency_seconds``                                       gauge    stage, quantile
``keyop_latency_samples``                                       gauge    stage
``keyop_federation_link_connected``                             gauge    hub
``keyop_federation_link_reconnects_total``                      counter  hub
``keyop_federation_link_unacked_bytes``                         gauge    hub
``keyop_federation_link_rtt_seconds``                           gauge    hub, quantile
``keyop_federation_refused_total``                              counter  hub, channel
``keyop_federation_link_refused_channel``                       gauge    hub, channel
``keyop_hub_peers``                                             gauge
``keyop_hub_peer_connected``                                    gauge    peer
``keyop_hub_records_received_total``                            counter
``keyop_hub_connections_accepted_total``                        counter
``keyop_hub_connections_rejected_total``                        counter
``keyop_hub_connections_failed_total``                          counter  stage
``keyop_hub_records_refused_total``                             counter  reason
==============================================================  =======  ====================

Counters count since the messenger opened (they restart at 0 with the
process, which Prometheus' ``rate()`` handles). Latency quantiles are over the
engine's sliding window of recent samples, so they are gauges (a summary's
``_sum``/``_count`` would have to be cumulative); ``keyop_latency_samples`` is
the number of samples in the window. A subscriber with nothing pending has no
``oldest_pending_timestamp`` sample. The ``keyop_federation_link_*`` families
appear when client links are configured, the ``keyop_hub_*`` ones when the hub
listener is on. The ``keyop_data_loss_*`` counters are process-wide (every
reader in the process adds to them, see ``Stats.data_loss``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ._prometheus import CONTENT_TYPE, StatsSource, render
from .errors import MetricsError
from .health import Health

if TYPE_CHECKING:
    from ._metrics_http import Server

__all__ = [
    "CONTENT_TYPE",
    "MetricsError",
    "MetricsServer",
    "StatsSource",
    "parse_listen_addr",
    "render",
]


def parse_listen_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` / ``":port"`` -> ``(host, port)``; an empty
    host means every interface. Raises :class:`MetricsError` otherwise."""
    if addr.startswith("["):
        host, sep, port_text = addr[1:].partition("]:")
    else:
        host, sep, port_text = addr.rpartition(":")
        if ":" in host:
            sep = ""
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise MetricsError(f"metrics listen address must be host:port, got {addr!r}")
    return host, int(port_text)


class MetricsServer:
    """Serves ``GET /metrics`` from ``source.stats()`` and the health endpoints
    ``/healthz``, ``/readyz`` and ``/status`` (:mod:`keyop_messenger.health`;
    404 elsewhere) on ``listen_addr`` (``host:port``; port 0 picks a free
    port, see :attr:`address`). Runs in a daemon thread; :meth:`close` stops it.

    Without ``health`` the source counts as ready from the start (a messenger
    starts its own listener once it is open); ``keyop-messenger run`` passes
    its own :class:`~keyop_messenger.health.Health` (source None until the
    messenger is open) to answer 503 on ``/readyz`` while starting and stopping.
    """

    def __init__(
        self, source: StatsSource | None, listen_addr: str, *, health: Health | None = None
    ) -> None:
        self.health = health if health is not None else Health(source, ready=True)
        self._host, self._port = parse_listen_addr(listen_addr)
        self._listen_addr = listen_addr
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> MetricsServer:
        """Binds the address and starts serving; returns ``self``. Raises
        :class:`MetricsError` if the address cannot be bound."""
        with self._lock:
            if self._closed:
                raise MetricsError("metrics server is closed")
            if self._server is not None:
                return self
            # http.server (and the ssl module it pulls in) costs ~9 MB of RSS:
            # imported only by messengers that serve metrics.
            from ._metrics_http import Handler, Server, Server6

            host = self._host
            server_class = Server6 if ":" in host else Server
            try:
                server = server_class((host, self._port), Handler)
            except OSError as exc:
                raise MetricsError(
                    f"metrics: cannot listen on {self._listen_addr}: {exc.strerror or exc}"
                ) from exc
            server.health = self.health
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="keyop-metrics",
                daemon=True,
            )
            self._thread.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound (useful with port 0)."""
        server = self._server
        if server is None:
            raise MetricsError("metrics server is not started")
        host, port = server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` of the running server."""
        host, port = self.address
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        """Stops serving and releases the port. Idempotent."""
        self.health.mark_stopping()
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
            thread, self._thread = self._thread, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
