"""``Messenger.set_allowed_peers`` (what SIGHUP applies) also covers
ephemeral clients: every ephemeral connection of a peer whose entry was
removed is closed, and one whose entry changed reconnects under the new
entry. Hubs are real messengers on 127.0.0.1 with the fed_helpers PKI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import (
    FAST_RECONNECT,
    PKI,
    Starter,
    hub_config,
    hub_port,
    peer,
    stored_ids,
    tls_section,
    wait_peers,
    wait_until,
)
from keyop_messenger import (
    AllowedPeer,
    Config,
    ConnectionLostError,
    EphemeralMessenger,
    KeyopTimeoutError,
    PolicyError,
)

pki = fed_helpers.pki
start = fed_helpers.start


def eph_config(pki: PKI, tmp_path: Path, port: int, name: str) -> Config:
    return Config.from_dict(
        {
            "name": name,
            "storage": {"data_dir": str(tmp_path / f"{name}-unused")},
            "client": {
                "enabled": True,
                "hubs": [{"addr": f"127.0.0.1:{port}", "subscribe": [], "publish": []}],
            },
            "tls": tls_section(pki, name),
            "federation": dict(FAST_RECONNECT),
        }
    )


@pytest.fixture
def opened() -> Iterator[list[EphemeralMessenger]]:
    """Ephemeral messengers appended here are closed after the test."""
    clients: list[EphemeralMessenger] = []
    try:
        yield clients
    finally:
        for c in reversed(clients):
            c.close()


def test_removed_peer_loses_its_ephemeral_connections(
    tmp_path: Path, pki: PKI, start: Starter, opened: list[EphemeralMessenger]
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"]), peer("node2")]))
    port = hub_port(hub)
    # Two ephemeral connections under the same peer name (Spark tasks do that).
    first = EphemeralMessenger(eph_config(pki, tmp_path, port, "node1"))
    second = EphemeralMessenger(eph_config(pki, tmp_path / "b", port, "node1"))
    opened += [first, second]
    first.connect()
    second.connect()
    sent = first.publish("temps", "t", 1)
    wait_until(lambda: sent in stored_ids(hub_dir, "temps"), "node1's record")
    wait_peers(hub, "node1")

    assert hub.set_allowed_peers([AllowedPeer("node2")]) == ["node1"]
    for eph in (first, second):
        wait_until(lambda eph=eph: not eph.status()["connected"], "node1 disconnected")
    wait_peers(hub)
    before = stored_ids(hub_dir, "temps")
    with pytest.raises((ConnectionLostError, PolicyError, KeyopTimeoutError)):
        first.publish("temps", "t", 2, timeout=5)
    with pytest.raises((ConnectionLostError, PolicyError, KeyopTimeoutError)):
        second.connect(timeout=5)
    assert stored_ids(hub_dir, "temps") == before


def test_changed_peer_reconnects_with_its_new_channels(
    tmp_path: Path, pki: PKI, start: Starter, opened: list[EphemeralMessenger]
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["other"]), peer("node2")]))
    eph = EphemeralMessenger(eph_config(pki, tmp_path, hub_port(hub), "node1"), auto_reconnect=True)
    opened.append(eph)
    eph.connect()
    with pytest.raises(PolicyError):
        eph.publish("temps", "t", 1, timeout=5)

    assert hub.set_allowed_peers(
        [AllowedPeer("node1", publish=["temps"]), AllowedPeer("node2")]
    ) == ["node1"]
    wait_until(
        lambda: eph.status()["reconnects"] >= 1 and eph.status()["connected"],
        "node1 reconnected under its new entry",
    )
    sent = eph.publish("temps", "t", 2, timeout=5)
    assert stored_ids(hub_dir, "temps") == [sent]
