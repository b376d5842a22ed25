"""keyop_messenger.metrics: Prometheus text format and the /metrics HTTP server.

The output is parsed with ``prometheus_client``'s own text parser (a test
extra), so what we check is what a Prometheus server would read.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from keyop_messenger import Config, Message, Messenger
from keyop_messenger.metrics import CONTENT_TYPE, MetricsError, MetricsServer, render
from keyop_messenger.stats import (
    ChannelStats,
    FederationStats,
    HubLinkStats,
    HubListenerStats,
    LatencyStats,
    Stats,
    SubscriberStats,
    Totals,
)

parser = pytest.importorskip("prometheus_client.parser")
pki = fed_helpers.pki

WAIT_S = 15.0
PENDING = datetime.datetime(2026, 3, 31, 14, 22, 1, 500000, tzinfo=datetime.timezone.utc)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """``({family name: type}, {(sample name, labels): value})``."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def sample_stats() -> Stats:
    """A snapshot with every kind of figure, and label values needing escapes."""
    weird_peer = 'we"ird\\peer\nname'
    return Stats(
        channels=[
            ChannelStats(
                name="orders",
                messages_published=42,
                stream_bytes=8400,
                disk_bytes=8400,
                subscribers=[
                    SubscriberStats("billing", 200, PENDING, True),
                    SubscriberStats("audit", 0, None, False),
                ],
            ),
            ChannelStats("orders.dead-letter", 0, 0, 0, []),
        ],
        totals=Totals(
            channels=2, messages_published=42, stream_bytes=8400, disk_bytes=8400, subscribers=2
        ),
        latency={
            "publish": LatencyStats(count=42, p50_us=150.0, p90_us=900.0, p99_us=2500.0),
            "consume": LatencyStats(count=0, p50_us=0.0, p90_us=0.0, p99_us=0.0),
            "handler": LatencyStats(count=3, p50_us=10.0, p90_us=20.0, p99_us=30.0),
        },
        federation=FederationStats(
            links=[
                HubLinkStats(
                    addr="hub1:7443",
                    connected=True,
                    reconnects=3,
                    unacked_bytes=512,
                    rtt_p50_us=1000.0,
                    rtt_p99_us=5000.0,
                    refused={"temps": 2},
                    refused_channels=["secret"],
                )
            ],
            listener=HubListenerStats(
                listen_addr="0.0.0.0:7443",
                peers=["node1", weird_peer],
                records_received=17,
                connections_accepted=5,
                connections_rejected=2,
                records_refused={"policy": 4, "too_large": 0},
                connections_failed={"tls": 7, "timeout": 1},
            ),
        ),
    )


def test_render_families_types_and_values() -> None:
    text = render(sample_stats())
    assert text.endswith("\n")
    types, samples = parse(text)
    assert types["keyop_messages_published"] == "counter"  # the parser strips _total
    for gauge in (
        "keyop_stream_bytes",
        "keyop_disk_bytes",
        "keyop_subscriber_lag_bytes",
        "keyop_subscriber_oldest_pending_timestamp_seconds",
        "keyop_latency_seconds",
        "keyop_federation_link_connected",
        "keyop_hub_peers",
    ):
        assert types[gauge] == "gauge", gauge
    assert value(samples, "keyop_messages_published_total", channel="orders") == 42
    assert value(samples, "keyop_messages_published_total", channel="orders.dead-letter") == 0
    assert value(samples, "keyop_stream_bytes", channel="orders") == 8400
    assert value(samples, "keyop_disk_bytes", channel="orders") == 8400
    assert (
        value(samples, "keyop_subscriber_lag_bytes", channel="orders", subscriber="billing") == 200
    )
    assert value(samples, "keyop_subscriber_lag_bytes", channel="orders", subscriber="audit") == 0
    ts = value(
        samples,
        "keyop_subscriber_oldest_pending_timestamp_seconds",
        channel="orders",
        subscriber="billing",
    )
    assert ts == PENDING.timestamp()
    # Nothing pending: no sample rather than a made-up value.
    assert not any(
        name == "keyop_subscriber_oldest_pending_timestamp_seconds"
        and ("subscriber", "audit") in lb
        for name, lb in samples
    )
    assert value(samples, "keyop_subscriber_active", channel="orders", subscriber="audit") == 0
    assert value(samples, "keyop_channels") == 2
    assert value(samples, "keyop_latency_seconds", stage="publish", quantile="0.5") == 150e-6
    assert value(samples, "keyop_latency_seconds", stage="publish", quantile="0.9") == 900e-6
    assert value(samples, "keyop_latency_seconds", stage="handler", quantile="0.99") == 30e-6
    assert value(samples, "keyop_latency_samples", stage="consume") == 0
    assert (
        "keyop_latency_seconds",
        frozenset({("stage", "consume"), ("quantile", "0.5")}),
    ) not in (samples), "an empty window has no quantiles"
    assert value(samples, "keyop_federation_link_connected", hub="hub1:7443") == 1
    assert value(samples, "keyop_federation_link_reconnects_total", hub="hub1:7443") == 3
    assert value(samples, "keyop_federation_link_unacked_bytes", hub="hub1:7443") == 512
    assert value(
        samples, "keyop_federation_link_rtt_seconds", hub="hub1:7443", quantile="0.99"
    ) == (5000e-6)
    assert value(samples, "keyop_federation_refused_total", hub="hub1:7443", channel="temps") == 2
    assert (
        value(samples, "keyop_federation_link_refused_channel", hub="hub1:7443", channel="secret")
        == 1
    )
    assert value(samples, "keyop_hub_peers") == 2
    assert value(samples, "keyop_hub_peer_connected", peer='we"ird\\peer\nname') == 1
    assert value(samples, "keyop_hub_records_received_total") == 17
    assert value(samples, "keyop_hub_connections_accepted_total") == 5
    assert value(samples, "keyop_hub_connections_rejected_total") == 2
    assert value(samples, "keyop_hub_records_refused_total", reason="policy") == 4
    assert value(samples, "keyop_hub_records_refused_total", reason="too_large") == 0
    assert value(samples, "keyop_hub_connections_failed_total", stage="tls") == 7
    assert value(samples, "keyop_hub_connections_failed_total", stage="timeout") == 1


def test_label_values_and_help_are_escaped_per_the_format() -> None:
    text = render(sample_stats())
    assert 'peer="we\\"ird\\\\peer\\nname"' in text
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ", "keyop_")), line
    # Every family has exactly one HELP and one TYPE line, in that order.
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert len(names) == len(set(names))
    for name in names:
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text


def test_render_without_federation_has_no_hub_families() -> None:
    stats = Stats(
        channels=[],
        totals=Totals(0, 0, 0, 0, 0),
        latency={},
        federation=FederationStats(),
    )
    types, samples = parse(render(stats))
    assert "keyop_hub_peers" not in types
    assert "keyop_federation_link_connected" not in types
    assert value(samples, "keyop_channels") == 0


# ---------------------------------------------------------------------------
# Figures of a real messenger
# ---------------------------------------------------------------------------


def _stream_end(data_dir: Path, channel: str) -> int:
    segments = sorted((data_dir / "channels" / channel).glob("*.jsonl"))
    return int(segments[-1].stem) + segments[-1].stat().st_size


def test_rendered_figures_match_what_was_published_and_consumed(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    config = Config.from_dict({"name": "metrics-node", "storage": {"data_dir": str(data_dir)}})
    with Messenger(config) as m:
        got: list[str] = []
        done = threading.Event()

        def handler(msg: Message) -> None:
            got.append(msg.id)
            if len(got) == 7:
                done.set()

        m.subscribe("orders", "billing", handler)
        for i in range(5):
            m.publish("orders", "t.Order", {"i": i})
        m.publish_batch("orders", [("t.Order", {"i": 5}), ("t.Order", {"i": 6})])
        m.publish_batch("events", [("t.Event", {"e": i}) for i in range(3)])
        assert done.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:  # the acknowledgement follows the handler call
            types, samples = parse(render(m.stats()))
            lag = value(
                samples, "keyop_subscriber_lag_bytes", channel="orders", subscriber="billing"
            )
            if lag == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        orders_end = _stream_end(data_dir, "orders")
        events_end = _stream_end(data_dir, "events")

    assert value(samples, "keyop_messages_published_total", channel="orders") == 7
    assert value(samples, "keyop_messages_published_total", channel="events") == 3
    assert value(samples, "keyop_stream_bytes", channel="orders") == orders_end
    assert value(samples, "keyop_stream_bytes", channel="events") == events_end
    assert value(samples, "keyop_disk_bytes", channel="orders") == orders_end
    assert lag == 0
    assert value(samples, "keyop_subscriber_active", channel="orders", subscriber="billing") == 1
    assert value(samples, "keyop_latency_samples", stage="publish") >= 1
    p50 = value(samples, "keyop_latency_seconds", stage="publish", quantile="0.5")
    p99 = value(samples, "keyop_latency_seconds", stage="publish", quantile="0.99")
    assert 0 < p50 <= p99 < 10
    assert value(samples, "keyop_latency_samples", stage="handler") >= 1
    assert types["keyop_messages_published"] == "counter"


# ---------------------------------------------------------------------------
# The HTTP server
# ---------------------------------------------------------------------------


class FakeSource:
    def __init__(self, stats: Stats | Exception) -> None:
        self.result = stats

    def stats(self) -> Stats:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_server_serves_metrics_and_404s_elsewhere() -> None:
    source = FakeSource(sample_stats())
    with MetricsServer(source, "127.0.0.1:0") as server:
        host, port = server.address
        assert host == "127.0.0.1" and port > 0
        status, ctype, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and ctype == CONTENT_TYPE
        assert body == render(sample_stats())
        _, samples = parse(body)
        assert value(samples, "keyop_messages_published_total", channel="orders") == 42
        assert get(f"http://127.0.0.1:{port}/metrics?x=1")[0] == 200
        for path in ("/metricsx", "/favicon.ico", "/static/status.html"):
            assert get(f"http://127.0.0.1:{port}{path}")[0] == 404, path
        # "/" is the status page (tests/test_status_page.py).
        assert get(f"http://127.0.0.1:{port}/")[:2] == (200, "text/html; charset=utf-8")
        source.result = RuntimeError("closed")
        assert get(server.url)[0] == 503
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    server.close()  # idempotent


def test_server_address_errors() -> None:
    with pytest.raises(MetricsError):
        MetricsServer(FakeSource(sample_stats()), "no-port")
    with MetricsServer(FakeSource(sample_stats()), "127.0.0.1:0") as first:
        taken = f"127.0.0.1:{first.address[1]}"
        with pytest.raises(MetricsError, match="cannot listen"):
            MetricsServer(FakeSource(sample_stats()), taken).start()


def test_server_over_a_real_messenger(tmp_path: Path) -> None:
    config = Config.from_dict({"name": "n", "storage": {"data_dir": str(tmp_path / "data")}})
    with Messenger(config) as m, MetricsServer(m, "127.0.0.1:0") as server:
        m.publish_batch("c", [("t", i) for i in range(4)])
        status, _, body = get(server.url)
    assert status == 200
    _, samples = parse(body)
    assert value(samples, "keyop_messages_published_total", channel="c") == 4


def test_metrics_listen_addr_config_key(tmp_path: Path) -> None:
    doc: dict[str, Any] = {
        "name": "n",
        "storage": {"data_dir": str(tmp_path / "data")},
        "metrics": {"listen_addr": "127.0.0.1:0"},
    }
    config = Config.from_dict(doc)
    with Messenger(config) as m:
        addr = m.metrics_address
        assert addr is not None
        m.publish("c", "t", 1)
        status, _, body = get(f"http://127.0.0.1:{addr[1]}/metrics")
        assert status == 200
        _, samples = parse(body)
        assert value(samples, "keyop_messages_published_total", channel="c") == 1
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", addr[1]), timeout=2).close()
    # Off by default.
    del doc["metrics"]
    with Messenger(Config.from_dict(doc)) as m:
        assert m.metrics_address is None


def test_federation_figures_of_a_hub_and_a_client(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    hub_cfg = fed_helpers.hub_config(
        pki, tmp_path / "hub", [fed_helpers.peer("node1", publish=["up"])]
    )
    with Messenger(hub_cfg) as hub:
        port = fed_helpers.hub_port(hub)
        client_cfg = fed_helpers.client_config(
            pki, tmp_path / "node1", "node1", port, publish=["up"]
        )
        with Messenger(client_cfg) as client:
            client.publish_batch("up", [("t", i) for i in range(3)])
            fed_helpers.wait_until(
                lambda: len(fed_helpers.stored_ids(tmp_path / "hub", "up")) == 3,
                "3 records on the hub",
            )
            fed_helpers.wait_until(
                lambda: client.stats().federation.links[0].unacked_bytes == 0, "acked"
            )
            _, client_samples = parse(render(client.stats()))
            _, hub_samples = parse(render(hub.stats()))
    addr = f"127.0.0.1:{port}"
    assert value(client_samples, "keyop_federation_link_connected", hub=addr) == 1
    assert value(client_samples, "keyop_federation_link_reconnects_total", hub=addr) == 0
    assert value(client_samples, "keyop_federation_link_unacked_bytes", hub=addr) == 0
    rtt = value(client_samples, "keyop_federation_link_rtt_seconds", hub=addr, quantile="0.99")
    assert 0 <= rtt < 10
    assert value(hub_samples, "keyop_hub_peers") == 1
    assert value(hub_samples, "keyop_hub_peer_connected", peer="node1") == 1
    assert value(hub_samples, "keyop_hub_records_received_total") == 3
    assert value(hub_samples, "keyop_hub_connections_accepted_total") == 1
    assert value(hub_samples, "keyop_hub_connections_rejected_total") == 0
    assert value(hub_samples, "keyop_messages_published_total", channel="up") == 3


def test_messengers_without_metrics_or_yaml_do_not_import_them(tmp_path: Path) -> None:
    """Footprint on small boards: http.server (with ssl) and yaml are imported
    only by messengers that serve metrics or read a configuration file."""
    import subprocess
    import sys

    heavy = ("http.server", "ssl", "yaml")
    probe = (
        "import sys, keyop_messenger as km\n"
        f"m = km.Messenger(km.Config.from_dict({{'name': 'n', 'storage': "
        f"{{'data_dir': {str(tmp_path / 'data')!r}}}}}))\n"
        "m.publish('c', 't', {}); m.close()\n"
        f"print(sorted(name for name in {heavy!r} if name in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "[]", f"a local messenger imported {out}; these should load only when used"
