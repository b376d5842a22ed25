"""``federation_status()`` as typed objects, and ``on_connect(hub)``,
``on_disconnect(hub, reason)`` and ``on_refused(hub, channel, count)`` of
Messenger and EphemeralMessenger (client API issue, item 4), which are
called from an engine thread, in order; an exception in one is logged and
swallowed. Real hubs on 127.0.0.1 with the
session PKI of fed_helpers.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import (
    PKI,
    Starter,
    client_config,
    hub_config,
    hub_port,
    peer,
    stored_ids,
    wait_until,
)
from keyop_messenger import (
    EphemeralMessenger,
    FederationStatus,
    HubLinkStatus,
    HubStatus,
    Messenger,
    PolicyError,
)

pki = fed_helpers.pki
start = fed_helpers.start


class Events:
    """Records callback calls (and the thread they ran on)."""

    def __init__(self, *, raise_in_connect: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        self._raise = raise_in_connect

    def _add(self, *call: Any) -> None:
        with self._lock:
            self.calls.append(call)
            self.threads.add(threading.current_thread().name)

    def on_connect(self, hub: str) -> None:
        self._add("connect", hub)
        if self._raise:
            raise RuntimeError("callback failure")

    def on_disconnect(self, hub: str, reason: str) -> None:
        self._add("disconnect", hub, reason)

    def on_refused(self, hub: str, channel: str, count: int) -> None:
        self._add("refused", hub, channel, count)

    def kwargs(self) -> dict[str, Any]:
        return {
            "on_connect": self.on_connect,
            "on_disconnect": self.on_disconnect,
            "on_refused": self.on_refused,
        }

    def kinds(self) -> list[str]:
        with self._lock:
            return [c[0] for c in self.calls]


def test_connect_and_disconnect_callbacks_and_a_raising_callback(
    pki: PKI, tmp_path: Path, start: Starter, caplog: pytest.LogCaptureFixture
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["orders"])]))
    port = hub_port(hub)
    addr = f"127.0.0.1:{port}"
    events = Events(raise_in_connect=True)
    node = Messenger(
        client_config(pki, tmp_path / "node1", "node1", port, publish=["orders"]),
        **events.kwargs(),
    )
    try:
        wait_until(lambda: events.kinds() == ["connect"], "on_connect")
        assert events.calls[0] == ("connect", addr)
        assert threading.main_thread().name not in events.threads
        # The raising callback was logged and the link carries on.
        wait_until(
            lambda: any("on_connect callback raised" in r.getMessage() for r in caplog.records),
            "the exception logged",
        )
        mid = node.publish("orders", "t", {})
        node.flush(timeout=fed_helpers.WAIT_S)
        assert stored_ids(hub_dir, "orders") == [mid]

        hub.close()
        wait_until(lambda: "disconnect" in events.kinds(), "on_disconnect")
        kind, hub_addr, reason = events.calls[1]
        assert (kind, hub_addr) == ("disconnect", addr)
        assert "code 1001: shutting down" in reason, reason  # the hub said why
        # The hub returns on the same port: on_connect again.
        start(hub_config(pki, hub_dir, [peer("node1", publish=["orders"])], port=port))
        wait_until(lambda: events.kinds()[:3] == ["connect", "disconnect", "connect"], "reconnect")
    finally:
        node.close()


def test_on_refused_reports_records_a_hub_refuses(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    entry = {**peer("node1", publish=["one", "two"]), "max_channels": 1}
    hub = start(hub_config(pki, hub_dir, [entry]))
    port = hub_port(hub)
    events = Events()
    cfg = client_config(pki, tmp_path / "node1", "node1", port, publish=["one", "two"])
    node = Messenger(cfg, **events.kwargs())
    try:
        first = node.publish("one", "t", {})
        node.flush(timeout=fed_helpers.WAIT_S)
        assert stored_ids(hub_dir, "one") == [first]
        node.publish_batch("two", [("t", {"n": n}) for n in range(3)])
        node.flush(timeout=fed_helpers.WAIT_S)  # refused records count as answered

        def refused() -> int:
            return sum(c[3] for c in events.calls if c[0] == "refused")

        wait_until(lambda: refused() == 3, "three refusals reported")
        assert {c[1:3] for c in events.calls if c[0] == "refused"} == {(f"127.0.0.1:{port}", "two")}
    finally:
        node.close()


def test_ephemeral_callbacks(pki: PKI, tmp_path: Path, start: Starter) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [{**peer("node1"), "max_channels": 1}]))
    port = hub_port(hub)
    addr = f"127.0.0.1:{port}"
    events = Events()
    cfg = client_config(pki, tmp_path / "unused", "node1", port)
    with EphemeralMessenger(cfg, **events.kwargs()) as eph:
        wait_until(lambda: events.kinds() == ["connect"], "on_connect")
        eph.publish("one", "t", {})
        with pytest.raises(PolicyError):
            eph.publish_batch("two", [("t", {}), ("t", {})])
        wait_until(lambda: "refused" in events.kinds(), "on_refused")
        assert ("refused", addr, "two", 2) in events.calls
        hub.close()
        wait_until(lambda: "disconnect" in events.kinds(), "on_disconnect")
    assert events.calls[0] == ("connect", addr)


def test_federation_status_is_typed(pki: PKI, tmp_path: Path, start: Starter) -> None:
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1", publish=["orders"])]))
    port = hub_port(hub)
    node = start(
        client_config(pki, tmp_path / "node1", "node1", port, publish=["orders", "secret"])
    )
    wait_until(lambda: node.federation_status().clients[0].connected, "connected")
    status = node.federation_status()
    assert isinstance(status, FederationStatus) and status.hub is None
    (link,) = status.clients
    assert isinstance(link, HubLinkStatus)
    assert link.addr == f"127.0.0.1:{port}" and link.refused == {}
    assert link.refused_channels == ["secret"] and link.refused_subscriptions == []
    assert link.failed_attempts == 0 and link.reconnects == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        link.connected = False  # type: ignore[misc]
    hub_side = hub.federation_status()
    assert isinstance(hub_side.hub, HubStatus) and hub_side.clients == []
    assert hub_side.hub.peers == ["node1"] and hub_side.hub.accepted >= 1
