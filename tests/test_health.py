"""Health endpoints of the metrics listener: /healthz, /readyz, /status, both
on ``keyop-messenger run`` and on a Messenger serving its own metrics."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import fed_helpers
from fed_helpers import PKI, Starter, client_config, stored_ids
from keyop_messenger import Config, Messenger, __version__
from keyop_messenger.health import Health
from keyop_messenger.metrics import MetricsServer
from run_helpers import http_get, http_json, hub_doc, poll, running, write_config

pki = fed_helpers.pki
start = fed_helpers.start


def test_run_serves_health_and_status(tmp_path: Path, pki: PKI, start: Starter) -> None:
    hub_dir = tmp_path / "hub"
    doc = hub_doc(pki, hub_dir, metrics={"listen_addr": "127.0.0.1:0"})
    cfg = write_config(tmp_path / "hub.yaml", doc)
    with running(["--config", str(cfg)]) as hub:
        hub.wait_ready()
        base = f"http://127.0.0.1:{hub.metrics_port()}"
        assert http_get(base + "/healthz")[:1] == (200,)
        assert http_get(base + "/readyz")[0] == 200
        port = hub.hub_port()
        node = start(client_config(pki, tmp_path / "node1", "node1", port, publish=["temps"]))
        ids = [node.publish("temps", "reading", {"n": i}) for i in range(3)]
        poll(lambda: stored_ids(hub_dir, "temps") == ids, "the readings on the hub")
        poll(lambda: http_json(base + "/status")["peers"] != [], "node1 in the status")
        intruder = start(client_config(pki, tmp_path / "intruder", "intruder", port))
        poll(
            lambda: http_json(base + "/status")["refused"]["connections_rejected"] >= 1,
            "the intruder refused",
        )
        intruder.close()
        status = http_json(base + "/status")
        assert status["version"] == __version__ and status["name"] == "hub1"
        assert status["state"] == "ready" and status["ready"] is True
        assert status["uptime_s"] > 0
        (temps,) = [c for c in status["channels"] if c["name"] == "temps"]
        assert temps["end_offset"] == fed_helpers.stream_end(hub_dir, "temps") > 0
        assert temps["messages_published"] == 3
        assert status["peers"] == [{"name": "node1", "state": "connected"}]
        assert status["hub"]["listen_addr"] == f"127.0.0.1:{port}"
        assert http_get(base + "/metrics")[0] == 200
        assert hub.stop(signal.SIGTERM) == 0


def _metrics_config(tmp_path: Path) -> Config:
    return Config.from_dict(
        {
            "name": "solo",
            "storage": {"data_dir": str(tmp_path / "data")},
            "metrics": {"listen_addr": "127.0.0.1:0"},
        }
    )


def test_messenger_with_metrics_serves_health(tmp_path: Path) -> None:
    with Messenger(_metrics_config(tmp_path)) as m:
        assert m.metrics_address is not None
        base = f"http://127.0.0.1:{m.metrics_address[1]}"
        m.publish("orders", "order", {"n": 1})
        received: list[Any] = []
        m.subscribe("orders", "billing", received.append)
        assert http_get(base + "/healthz")[0] == 200
        assert http_get(base + "/readyz") == (200, "text/plain; charset=utf-8", "ready\n")
        logging.getLogger("keyop_messenger.test_health").warning("disk nearly full")
        status = http_json(base + "/status")
        (orders,) = [c for c in status["channels"] if c["name"] == "orders"]
        assert orders["end_offset"] == m.stream_end("orders") > 0
        assert [s["id"] for s in orders["subscribers"]] == ["billing"]
        assert orders["subscribers"][0]["lag_bytes"] == 0
        assert status["last_error"]["message"] == "disk nearly full"
        assert status["last_error"]["logger"] == "keyop_messenger.test_health"
        # Storage failing: the data directory disappears.
        data = tmp_path / "data"
        data.rename(tmp_path / "moved")
        try:
            code, _, body = http_get(base + "/readyz")
            assert code == 503 and "storage failing" in body and str(data) in body
            assert http_get(base + "/healthz")[0] == 200
        finally:
            (tmp_path / "moved").rename(data)
        assert http_get(base + "/readyz")[0] == 200


class _Source:
    def __init__(self, messenger: Messenger) -> None:
        self.messenger = messenger
        self.config = messenger.config

    def stats(self) -> Any:
        return self.messenger.stats()


def test_readyz_is_503_while_starting_and_stopping(tmp_path: Path) -> None:
    health = Health()
    with MetricsServer(None, "127.0.0.1:0", health=health) as server:
        base = f"http://127.0.0.1:{server.address[1]}"
        assert http_get(base + "/readyz")[0::2] == (503, "starting\n")
        assert http_get(base + "/metrics")[0] == 503
        assert http_get(base + "/healthz")[0] == 200
        assert http_json(base + "/status")["state"] == "starting"
        config = Config.from_dict({"storage": {"data_dir": str(tmp_path / "d")}})
        with Messenger(config) as m:
            health.mark_ready(_Source(m))
            assert http_get(base + "/readyz")[0] == 200
            assert http_get(base + "/metrics")[0] == 200
            health.mark_stopping()
            assert http_get(base + "/readyz")[0::2] == (503, "stopping\n")
            assert http_json(base + "/status")["state"] == "stopping"
        assert http_get(base + "/nowhere")[0] == 404


class _FakeClient:
    """A client-only messenger's figures: one link whose hub refused records."""

    def stats(self) -> Any:
        from keyop_messenger.stats import FederationStats, HubLinkStats, Stats, Totals

        link = HubLinkStats(
            addr="hub:7740", connected=False, reconnects=2, unacked_bytes=10,
            rtt_p50_us=1.0, rtt_p99_us=2.0, refused={"temps": 3, "alerts": 1},
            refused_channels=["secret"],
        )  # fmt: skip
        return Stats(
            channels=[], totals=Totals(0, 0, 0, 0, 0), latency={},
            federation=FederationStats(links=[link]),
        )  # fmt: skip

    def federation_status(self) -> Any:
        from keyop_messenger import FederationStatus, HubLinkStatus

        link = HubLinkStatus(
            addr="hub:7740", connected=False, reconnects=2, failed_attempts=4,
            refused={"temps": 3, "alerts": 1}, refused_channels=["secret"],
            refused_subscriptions=[],
        )  # fmt: skip
        return FederationStatus(hub=None, clients=[link])


def test_status_counts_refusals_of_client_links() -> None:
    status = Health(_FakeClient(), ready=True).status()
    assert status["links"] == [
        {
            "addr": "hub:7740", "state": "disconnected", "reconnects": 2,
            "failed_attempts": 4, "unacked_bytes": 10, "refused": {"temps": 3, "alerts": 1},
            "refused_channels": ["secret"], "refused_subscriptions": [],
        }
    ]  # fmt: skip
    assert status["refused"] == {
        "connections_rejected": 0, "connections_failed": 0, "records_refused_from_peers": 0,
        "client_failed_attempts": 4, "records_refused_by_hubs": 4,
    }  # fmt: skip
    assert status["peers"] == [] and "hub" not in status


def test_status_rates_come_from_successive_requests() -> None:
    from keyop_messenger.health import RATE_WINDOW_S, _Rates

    rates = _Rates()
    none = (None, None)
    assert rates.update(100.0, {"a": (0, 0)}) == {"a": none}  # nothing to compare with
    assert rates.update(102.0, {"a": (10, 1000), "b": (1, 5)}) == {
        "a": (5.0, 500.0), "b": none,  # b is new
    }  # fmt: skip
    # Within the window the rate spans from its oldest sample.
    assert rates.update(104.0, {"a": (20, 2000)})["a"] == (5.0, 500.0)
    # Requests further apart than the window: from the newest sample, however old.
    later = 104.0 + 4 * RATE_WINDOW_S
    assert rates.update(later, {"a": (60, 2000)})["a"] == (1.0, 0.0)
    # Counters that went back (the process restarted): no rate.
    assert rates.update(later + 1, {"a": (0, 0)})["a"] == none


def test_status_shows_last_message_rates_and_lag(tmp_path: Path) -> None:
    with Messenger(_metrics_config(tmp_path)) as m:
        assert m.metrics_address is not None
        base = f"http://127.0.0.1:{m.metrics_address[1]}"
        m.publish("orders", "order", {"n": 0})
        sub = m.subscribe("orders", "billing", lambda _: None, start="earliest")
        poll(lambda: sub.position == m.stream_end("orders"), "billing caught up")
        sub.close()
        first = http_json(base + "/status")
        (orders,) = [c for c in first["channels"] if c["name"] == "orders"]
        assert orders["messages_per_s"] is None  # the first request has nothing before it
        m.publish("orders", "order", {"n": 1})
        m.publish("orders", "order", {"n": 2})
        time.sleep(0.3)  # the next request must be a new sample (0.2 s apart at least)
        status = http_json(base + "/status")
        (orders,) = [c for c in status["channels"] if c["name"] == "orders"]
        *_, last = m.read_channel("orders")
        stamp = last.message.timestamp.isoformat().replace("+00:00", "Z")
        assert orders["last_message_at"] == stamp
        (stats,) = [c for c in m.stats().channels if c.name == "orders"]
        assert stats.last_message == last.message.timestamp
        assert orders["messages_per_s"] > 0 and orders["bytes_per_s"] > 0
        (billing,) = orders["subscribers"]
        assert billing["lag_bytes"] == m.stream_end("orders") - sub.position > 0
        assert billing["lag_s"] is not None and billing["lag_s"] >= 0
        assert billing["active"] is False
        assert status["rate_window_s"] > 0 and status["now"].endswith("Z")
