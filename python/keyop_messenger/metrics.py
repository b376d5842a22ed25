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
``keyop_latency_seconds``                                       gauge    stage, quantile
``keyop_latency_samples``                                       gauge    stage
``keyop_federation_link_connected``                             gauge    hub
``keyop_federation_link_reconnects_total``                      counter  hub
``keyop_federation_link_unacked_bytes``                         gauge    hub
``keyop_federation_link_rtt_seconds``                           gauge    hub, quantile
``keyop_hub_peers``                                             gauge
``keyop_hub_peer_connected``                                    gauge    peer
``keyop_hub_records_received_total``                            counter
``keyop_hub_connections_accepted_total``                        counter
``keyop_hub_connections_rejected_total``                        counter
==============================================================  =======  ====================

Counters count since the messenger opened (they restart at 0 with the
process, which Prometheus' ``rate()`` handles). Latency quantiles are over the
engine's sliding window of recent samples, so they are gauges (a summary's
``_sum``/``_count`` would have to be cumulative); ``keyop_latency_samples`` is
the number of samples in the window. A subscriber with nothing pending has no
``oldest_pending_timestamp`` sample. The ``keyop_federation_link_*`` families
appear when client links are configured, the ``keyop_hub_*`` ones when the hub
listener is on.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from .errors import MetricsError
from .stats import HubLinkStats, HubListenerStats, Stats

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

log = logging.getLogger("keyop_messenger")

#: Content type of the Prometheus text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_QUANTILES = (("0.5", "p50_us"), ("0.9", "p90_us"), ("0.99", "p99_us"))
_RTT_QUANTILES = (("0.5", "rtt_p50_us"), ("0.99", "rtt_p99_us"))

_Labels = tuple[tuple[str, str], ...]



def _escape_label(value: str) -> str:
    """A label value as the text format wants it: ``\\``, ``"`` and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value: integers without a fraction, ``NaN``/``+Inf``/``-Inf`` spelled out."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Writer:
    """Accumulates families: HELP and TYPE once, then the samples."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[_Labels, float]]
    ) -> None:
        """Writes one family; one written with no sample still gets HELP/TYPE."""
        self._lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if labels:
                text = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
                self._lines.append(f"{name}{{{text}}} {_number(value)}")
            else:
                self._lines.append(f"{name} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render(stats: Stats) -> str:
    """``stats`` in the Prometheus text exposition format (ends with a newline)."""
    out = _Writer()
    channels = stats.channels
    out.family(
        "keyop_messages_published_total",
        "counter",
        "Records appended to the channel since the messenger opened (local, batch and federated).",
        [((("channel", c.name),), c.messages_published) for c in channels],
    )
    out.family(
        "keyop_stream_bytes",
        "gauge",
        "Stream end of the channel: the global byte offset the next record gets.",
        [((("channel", c.name),), c.stream_bytes) for c in channels],
    )
    out.family(
        "keyop_disk_bytes",
        "gauge",
        "Bytes of the channel's segment files on disk.",
        [((("channel", c.name),), c.disk_bytes) for c in channels],
    )
    subs = [(c.name, s) for c in channels for s in c.subscribers]
    out.family(
        "keyop_subscriber_lag_bytes",
        "gauge",
        "Bytes between the subscriber's position and the stream end.",
        [((("channel", ch), ("subscriber", s.id)), s.lag_bytes) for ch, s in subs],
    )
    out.family(
        "keyop_subscriber_oldest_pending_timestamp_seconds",
        "gauge",
        "Publish time (Unix seconds) of the oldest message the subscriber has not "
        "acknowledged; absent when nothing is pending.",
        (
            ((("channel", ch), ("subscriber", s.id)), s.oldest_pending.timestamp())
            for ch, s in subs
            if s.oldest_pending is not None
        ),
    )
    out.family(
        "keyop_subscriber_active",
        "gauge",
        "1 if the subscriber is subscribed in this process, 0 if only its offset file exists.",
        [((("channel", ch), ("subscriber", s.id)), int(s.active)) for ch, s in subs],
    )
    out.family(
        "keyop_channels",
        "gauge",
        "Channels in the data directory.",
        [((), stats.totals.channels)],
    )
    stages = sorted(stats.latency.items())
    out.family(
        "keyop_latency_seconds",
        "gauge",
        "Latency quantiles over a sliding window of recent samples, per stage: publish "
        "(append to commit), consume (commit to handler start), handler (run time).",
        (
            ((("stage", stage), ("quantile", q)), getattr(lat, attr) / 1e6)
            for stage, lat in stages
            if lat.count > 0
            for q, attr in _QUANTILES
        ),
    )
    out.family(
        "keyop_latency_samples",
        "gauge",
        "Samples in the latency window, per stage.",
        [((("stage", stage),), lat.count) for stage, lat in stages],
    )
    links = stats.federation.links
    if links:
        _link_families(out, links)
    listener = stats.federation.listener
    if listener is not None:
        _listener_families(out, listener)
    return out.text()


def _link_families(out: _Writer, links: list[HubLinkStats]) -> None:
    out.family(
        "keyop_federation_link_connected",
        "gauge",
        "1 while the link to the hub is connected.",
        [((("hub", link.addr),), int(link.connected)) for link in links],
    )
    out.family(
        "keyop_federation_link_reconnects_total",
        "counter",
        "Successful reconnects of the link to the hub (the first connection not counted).",
        [((("hub", link.addr),), link.reconnects) for link in links],
    )
    out.family(
        "keyop_federation_link_unacked_bytes",
        "gauge",
        "Bytes sent to the hub and not yet acknowledged.",
        [((("hub", link.addr),), link.unacked_bytes) for link in links],
    )
    out.family(
        "keyop_federation_link_rtt_seconds",
        "gauge",
        "Round trip from sending a batch to the hub to its acknowledgement (quantiles).",
        (
            ((("hub", link.addr), ("quantile", q)), getattr(link, attr) / 1e6)
            for link in links
            for q, attr in _RTT_QUANTILES
        ),
    )


def _listener_families(out: _Writer, listener: HubListenerStats) -> None:
    out.family(
        "keyop_hub_peers",
        "gauge",
        "Peers connected to the hub listener.",
        [((), len(listener.peers))],
    )
    out.family(
        "keyop_hub_peer_connected",
        "gauge",
        "1 for each peer connected to the hub listener.",
        [((("peer", name),), 1) for name in sorted(set(listener.peers))],
    )
    out.family(
        "keyop_hub_records_received_total",
        "counter",
        "Records received from peers by the hub listener.",
        [((), listener.records_received)],
    )
    out.family(
        "keyop_hub_connections_accepted_total",
        "counter",
        "Peer connections accepted by the hub listener.",
        [((), listener.connections_accepted)],
    )
    out.family(
        "keyop_hub_connections_rejected_total",
        "counter",
        "Connections rejected by the hub listener (TLS, handshake or policy).",
        [((), listener.connections_rejected)],
    )


class StatsSource(Protocol):
    """Anything with a ``stats()`` method, e.g. a :class:`~keyop_messenger.Messenger`."""

    def stats(self) -> Stats: ...


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
    """Serves ``GET /metrics`` (404 elsewhere) from ``source.stats()`` on
    ``listen_addr`` (``host:port``; port 0 picks a free port, see
    :attr:`address`). Runs in a daemon thread; :meth:`close` stops it."""

    def __init__(self, source: StatsSource, listen_addr: str) -> None:
        self._source = source
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
            server.source = self._source
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
