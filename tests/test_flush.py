"""``flush(timeout=None)`` of Messenger and EphemeralMessenger (client API
issue, item 3).

A durable client's flush returns once everything published so far is
committed locally (fdatasynced, also in relaxed mode) and acknowledged by
every hub it is forwarded to; an ephemeral client's once no publish waits for
the hub's answer. Otherwise :class:`KeyopTimeoutError` names, per hub and
channel, the records and bytes still pending. Hubs are real messengers on
127.0.0.1 with the session PKI of fed_helpers.
"""

from __future__ import annotations

import _thread
import asyncio
import threading
import time
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import (
    FAST_RECONNECT,
    PKI,
    WAIT_S,
    Starter,
    client_config,
    free_port,
    hub_config,
    hub_port,
    peer,
    stored_ids,
    tls_section,
    wait_until,
)
from keyop_messenger import Config, EphemeralMessenger, KeyopTimeoutError, Messenger

pki = fed_helpers.pki
start = fed_helpers.start


def test_flush_returns_once_the_hub_acknowledged(pki: PKI, tmp_path: Path, start: Starter) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["orders"])]))
    node = start(client_config(pki, tmp_path / "node1", "node1", hub_port(hub), publish=["orders"]))
    ids = [node.publish("orders", "t", {"n": n}) for n in range(20)]
    ids += node.publish_batch("orders", [("t", {"n": n}) for n in range(20, 40)])
    node.flush(timeout=WAIT_S)
    # No polling: flush() returning means the hub has committed every one.
    assert stored_ids(hub_dir, "orders") == ids
    node.flush(timeout=WAIT_S)  # nothing new: returns at once


def test_flush_timeout_names_hub_channel_and_counts(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    port = free_port()
    node = start(client_config(pki, tmp_path / "node1", "node1", port, publish=["orders"]))
    node.publish("orders", "t", {"n": 1})
    node.publish_batch("orders", [("t", {"n": 2}), ("t", {"n": 3})])
    with pytest.raises(KeyopTimeoutError) as info:
        node.flush(timeout=0.3)
    text = str(info.value)
    assert f"127.0.0.1:{port}" in text and '"orders"' in text, text
    assert "3 records" in text and "bytes" in text, text

    # The hub comes up on that port: the same records are forwarded and flush succeeds.
    hub_dir = tmp_path / "hub"
    start(hub_config(pki, hub_dir, [peer("node1", publish=["orders"])], port=port))
    node.flush(timeout=WAIT_S)
    assert len(stored_ids(hub_dir, "orders")) == 3


def test_flush_without_federation_returns(tmp_path: Path) -> None:
    with Messenger(Config.from_dict({"name": "solo", "storage": {"data_dir": str(tmp_path)}})) as m:
        m.publish("c", "t", {})
        m.flush()
        m.flush(timeout=0)


def test_flush_makes_relaxed_mode_durable(tmp_path: Path) -> None:
    def open_relaxed() -> Messenger:
        # A sync interval far longer than the test: only flush() syncs.
        storage = {"data_dir": str(tmp_path / "d"), "sync_interval_ms": 600_000}
        return Messenger(Config.from_dict({"name": "relaxed", "storage": storage}))

    m = open_relaxed()
    flushed = [m.publish("c", "t", {"n": n}) for n in range(5)]
    m.flush(timeout=WAIT_S)
    unflushed = m.publish("c", "t", {"n": 5})
    m._engine._simulate_power_loss(0)
    m.close()
    with open_relaxed() as again:
        kept = [e.message.id for e in again.read_channel("c")]
    assert kept[:5] == flushed, "a flushed message was lost in the power loss"
    assert unflushed not in kept, "the test did not exercise the relaxed mode"


def test_ctrl_c_interrupts_a_waiting_flush(pki: PKI, tmp_path: Path, start: Starter) -> None:
    node = start(client_config(pki, tmp_path / "n", "node1", free_port(), publish=["orders"]))
    node.publish("orders", "t", {})
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        # The bound keeps a broken signal check from hanging the run; it must not be reached.
        with pytest.raises(KeyboardInterrupt):
            node.flush(timeout=WAIT_S)
    finally:
        timer.cancel()


def eph_config(pki: PKI, tmp_path: Path, port: int) -> Config:
    return Config.from_dict(
        {
            "name": "node1",
            "storage": {"data_dir": str(tmp_path / "unused")},
            "client": {"enabled": True, "hubs": [{"addr": f"127.0.0.1:{port}"}]},
            "tls": tls_section(pki, "node1"),
            "federation": FAST_RECONNECT,
        }
    )


def test_ephemeral_flush_waits_for_publishes_in_flight(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1")]))
    port = hub_port(hub)
    with EphemeralMessenger(eph_config(pki, tmp_path, port), auto_reconnect=True) as eph:
        eph.publish("temps", "t", {"n": 0})
        eph.flush(timeout=WAIT_S)  # nothing in flight
        hub.close()
        wait_until(lambda: not eph.status()["connected"], "the client to see the hub go")
        results: list[object] = []
        waiting = threading.Thread(
            target=lambda: results.append(eph.publish("temps", "t", {"n": 1})), daemon=True
        )
        waiting.start()
        time.sleep(0.3)  # the publish is queued, waiting for the hub
        assert waiting.is_alive()
        with pytest.raises(KeyopTimeoutError) as info:
            eph.flush(timeout=0.5)
        text = str(info.value)
        assert "1 records" in text and '"temps"' in text and f"127.0.0.1:{port}" in text, text

        start(hub_config(pki, hub_dir, [peer("node1")], port=port))
        eph.flush(timeout=WAIT_S)
        waiting.join(WAIT_S)
        assert len(results) == 1 and results[0] in stored_ids(hub_dir, "temps")


def test_async_flush(pki: PKI, tmp_path: Path, start: Starter) -> None:
    from keyop_messenger.aio import AsyncMessenger

    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["orders"])]))
    cfg = client_config(pki, tmp_path / "node1", "node1", hub_port(hub), publish=["orders"])

    async def main() -> str:
        async with AsyncMessenger(cfg) as m:
            mid = await m.publish("orders", "t", {})
            await m.flush(timeout=WAIT_S)
            return mid

    mid = asyncio.run(main())
    assert stored_ids(hub_dir, "orders") == [mid]
