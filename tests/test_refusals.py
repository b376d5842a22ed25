"""Refusals reach the publisher (loss issue, item 1).

A hub tells a client that asked (handshake ``features: ["refusals"]``) which
channels it may publish and subscribe, and lists refused records in its
acknowledgements; a Go 1.4 peer, which does not ask, gets the 1.4 bytes.
The durable client keeps refused records on its own disk, counts, logs (once
per channel and connection) and audits them; a channel the hub's handshake
refuses is not sent and keeps its cursor, so it goes out once the hub allows
it. ``EphemeralMessenger.publish`` to a refused channel raises PolicyError.
A hub that cannot store a batch does not acknowledge it; the client resends.

Hubs are real messengers on 127.0.0.1 with the session PKI of fed_helpers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import (
    PKI,
    RawPeer,
    Starter,
    audit_events,
    batch,
    client_config,
    client_status,
    cursor_path,
    envelope,
    free_port,
    hub_config,
    hub_port,
    peer,
    read_cursor,
    stored_ids,
    wait_connected,
    wait_peers,
    wait_until,
)
from keyop_messenger import (
    Config,
    ConfigError,
    EphemeralMessenger,
    PayloadTypeError,
    PolicyError,
)
from keyop_messenger.metrics import render
from keyop_messenger.stats import FederationStats, HubLinkStats, Stats, Totals

pki = fed_helpers.pki
start = fed_helpers.start

HUB_14 = {"instance_name": "hub1", "role": "hub", "version": "1"}


def hello(name: str, *, features: bool) -> str:
    doc: dict[str, Any] = {"instance_name": name, "role": "client", "version": "1"}
    if features:
        doc["features"] = ["refusals"]
    return json.dumps(doc, separators=(",", ":"))


def msg_id(record: bytes) -> str:
    return str(json.loads(record)["id"])


def hub_cursor(node_dir: Path, channel: str, port: int) -> int | None:
    return read_cursor(cursor_path(node_dir, channel, f"hub-127.0.0.1_{port}"))


# ---------------------------------------------------------------------------
# Wire: extension keys only for peers that asked
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("features", [False, True], ids=["go-1.4-peer", "refusals-peer"])
def test_wire_handshake_and_ack_list_refusals_as_extra_keys(
    pki: PKI, tmp_path: Path, start: Starter, features: bool
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(
        hub_config(pki, hub_dir, [peer("node1", subscribe=["cmds"], publish=["temps"])])
    )
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        raw.send_text(hello("node1", features=features))
        welcome = raw.recv_text()
        ok = envelope("temps", "node1", {"t": 1})
        refused = envelope("debug", "node1", {})
        raw.send_binary(batch(ok, refused))
        ack = raw.recv_text()
    doc = json.loads(welcome)
    extra = {k: doc.pop(k) for k in list(doc) if k not in HUB_14}
    assert doc == HUB_14, "the 1.4 keys are unchanged"
    assert list(json.loads(welcome))[:3] == list(HUB_14), "and come first, in 1.4 order"
    ack_doc = json.loads(ack)
    assert ack_doc.pop("last_id") == msg_id(refused), "last_id keeps its 1.4 meaning"
    if not features:
        assert extra == {} and ack_doc == {}
        assert ack == json.dumps({"last_id": msg_id(refused)}, separators=(",", ":"))
    else:
        assert extra == {
            "features": ["refusals"],
            "publish_allowed": ["temps"],
            "subscribe_allowed": ["cmds"],
        }
        assert ack_doc == {
            "refused": [{"id": msg_id(refused), "channel": "debug", "reason": "policy"}]
        }
    assert stored_ids(hub_dir, "temps") == [msg_id(ok)]
    (violation,) = audit_events(hub_dir, "policy_violation", channel="debug")
    assert violation["message_id"] == msg_id(refused)


def test_wire_unrestricted_peer_gets_no_allow_lists(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node2")]))
    with RawPeer(hub_port(hub), pki["node2"], pki.ca) as raw:
        raw.send_text(hello("node2", features=True))
        assert json.loads(raw.recv_text()) == {**HUB_14, "features": ["refusals"]}


def test_hub_audits_every_refusal_but_logs_them_rate_limited(
    pki: PKI, tmp_path: Path, start: Starter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    records = [envelope("debug", "node1", {"i": i}) for i in range(50)]
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        raw.send_binary(batch(*records))
        raw.recv_text()
    assert len(audit_events(hub_dir, "policy_violation", channel="debug")) == 50
    logged = [r for r in caplog.records if "refused a record" in r.getMessage()]
    assert len(logged) <= 1, "at most one report per interval (lograte::RateLimit)"


# ---------------------------------------------------------------------------
# Durable client
# ---------------------------------------------------------------------------


def test_client_learns_a_refused_channel_at_connect_and_forwards_it_once_allowed(
    pki: PKI, tmp_path: Path, start: Starter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    port = free_port()
    allow = [peer("node1", publish=["temps"], subscribe=["cmds"])]
    hub = start(hub_config(pki, hub_dir, allow, port=port))
    client = start(
        client_config(
            pki, node_dir, "node1", port, publish=["temps", "debug"], subscribe=["cmds", "secret"]
        )
    )
    wait_peers(hub, "node1")
    wait_until(lambda: client_status(client)["refused_channels"] == ["debug"], "refusal known")
    assert client_status(client)["refused_subscriptions"] == ["secret"]
    (sub_audit,) = wait_until(
        lambda: audit_events(node_dir, "subscribe_refused", channel="secret"), "sub audit"
    )
    assert sub_audit["detail"] == "reason=policy at=handshake"
    (audit,) = wait_until(
        lambda: audit_events(node_dir, "publish_refused", channel="debug"), "audit"
    )
    assert (audit["detail"], audit["peer"]) == ("reason=policy at=handshake", f"127.0.0.1:{port}")
    warnings = [r for r in caplog.records if "refuses channel \"debug\"" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert client.stats().federation.links[0].refused_channels == ["debug"]
    sample = f'keyop_federation_link_refused_channel{{hub="127.0.0.1:{port}",channel="debug"}} 1'
    assert sample in render(client.stats()).splitlines()

    start_debug = hub_cursor(node_dir, "debug", port)
    debug_id = client.publish("debug", "test.Debug", {"x": 1})
    temps_id = client.publish("temps", "test.Reading", {"x": 2})
    wait_until(lambda: stored_ids(hub_dir, "temps") == [temps_id], "temps on the hub")
    assert stored_ids(hub_dir, "debug") == [], "a refused channel is not sent"
    assert not audit_events(hub_dir, "policy_violation")
    assert stored_ids(node_dir, "debug") == [debug_id], "kept on the client"
    assert hub_cursor(node_dir, "debug", port) == start_debug, "its cursor stays"

    # The hub's policy changes: the waiting message goes out.
    hub.close()
    allow = [peer("node1", publish=["temps", "debug"], subscribe=["cmds"])]
    start(hub_config(pki, hub_dir, allow, port=port))
    wait_until(lambda: stored_ids(hub_dir, "debug") == [debug_id], "debug forwarded once allowed")
    wait_until(lambda: client_status(client)["refused_channels"] == [], "refusal cleared")


def test_client_counts_warns_once_and_audits_records_the_hub_refuses(
    pki: PKI, tmp_path: Path, start: Starter, caplog: pytest.LogCaptureFixture
) -> None:
    """Records in the client's own files that the hub finds invalid (here:
    payloads nested deeper than the limit, as a Go 1.4 writer sharing the data
    directory could leave, and a payload cut short on disk) are refused in the
    acknowledgement: kept on the client, counted per (hub, channel), one
    warning per channel and connection, one audit record each; the link
    carries on. The client reads only a record's id and origin to send it: the
    hub's check of the whole record is what finds it invalid."""
    caplog.set_level(logging.WARNING)
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    port = hub_port(hub)
    cfg = client_config(pki, node_dir, "node1", port, publish=["temps"])
    client = start(cfg)
    first = client.publish("temps", "test.Reading", {"n": 1})
    wait_until(lambda: stored_ids(hub_dir, "temps") == [first], "first forwarded")
    client.close()

    deep = b"[" * 150 + b"]" * 150
    bad = []
    segment = sorted((node_dir / "channels" / "temps").glob("*.jsonl"))[-1]
    with segment.open("ab") as f:
        for _ in range(3):
            rec = envelope("temps", "node1", 0).replace(b'"payload":0', b'"payload":' + deep)
            bad.append(msg_id(rec))
            f.write(rec + b"\n")
        cut_id = "0197a3c5-5e21-7b4f-8c2d-00000000c0de"
        cut = envelope("temps", "node1", 0, msg_id=cut_id)
        f.write(cut.replace(b'"payload":0}', b'"payload":{"x":}') + b"\n")
        bad.append(cut_id)

    client = start(cfg)
    wait_until(
        lambda: client_status(client)["refused"] == {"temps": 4}, "four refusals counted"
    )
    last = client.publish("temps", "test.Reading", {"n": 2})
    wait_until(lambda: stored_ids(hub_dir, "temps") == [first, last], "the link carries on")
    assert client.stats().federation.links[0].refused == {"temps": 4}
    refusals = audit_events(node_dir, "publish_refused", channel="temps")
    assert sorted(r["message_id"] for r in refusals) == sorted(bad)
    assert {r["detail"] for r in refusals} == {"reason=invalid"}
    assert not audit_events(node_dir, "forward", direction="outbound", message_id=bad[0])
    warned = [r for r in caplog.records if "refused records of channel" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert len(audit_events(hub_dir, "record_refused")) == 4
    kept = segment.read_bytes()
    assert all(mid.encode() in kept for mid in bad), "kept in the client's channel file"


def test_hub_that_cannot_store_does_not_acknowledge_and_the_client_resends(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    client = start(client_config(pki, node_dir, "node1", hub_port(hub), publish=["temps"]))
    wait_connected(client)
    first = client.publish("temps", "test.Reading", {"n": 1})
    wait_until(lambda: stored_ids(hub_dir, "temps") == [first], "first forwarded")
    hub._engine._inject_fault("temps", "write", 1)  # the next append fails once
    second = client.publish("temps", "test.Reading", {"n": 2})
    wait_until(lambda: stored_ids(hub_dir, "temps") == [first, second], "resent and stored")
    assert client_status(client)["reconnects"] >= 1, "the unacknowledged batch was resent"
    assert client_status(client)["refused"] == {}, "a storage failure is not a refusal"
    wait_until(
        lambda: audit_events(hub_dir, "forward", message_id=second, direction="inbound"),
        "the forward audited",
    )
    assert len(audit_events(hub_dir, "forward", message_id=second, direction="inbound")) == 1


# ---------------------------------------------------------------------------
# Ephemeral client
# ---------------------------------------------------------------------------


def test_ephemeral_publish_to_a_refused_channel_raises_policy_error(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    port = hub_port(hub)
    cfg = client_config(pki, tmp_path / "unused", "node1", port)
    with EphemeralMessenger(cfg) as eph:
        with pytest.raises(PolicyError) as err:
            eph.publish("debug", "test.Debug", {"x": 1})
        assert "debug" in str(err.value) and f"127.0.0.1:{port}" in str(err.value)
        with pytest.raises(PolicyError):
            eph.publish_batch("debug", [("test.Debug", {"x": 2})])
        deep: Any = 1
        for _ in range(101):
            deep = [deep]
        with pytest.raises(PayloadTypeError, match="nested deeper than 100"):
            eph.publish("temps", "test.Deep", deep)  # the record rules apply here too
        ok = eph.publish("temps", "test.Reading", {"x": 3})
    assert stored_ids(hub_dir, "temps") == [ok]
    assert stored_ids(hub_dir, "debug") == []
    assert not (tmp_path / "unused").exists()


def test_go_14_shaped_client_still_works_against_a_restricting_hub(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """A 1.4 client (no features) gets plain acknowledgements whose last_id
    releases refused records, exactly as 1.4 hubs did."""
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        assert json.loads(raw.handshake("node1")) == HUB_14
        recs = [envelope("debug", "node1", {}), envelope("temps", "node1", {})]
        raw.send_binary(batch(*recs))
        assert raw.recv_text() == json.dumps({"last_id": msg_id(recs[1])}, separators=(",", ":"))
    assert stored_ids(hub_dir, "temps") == [msg_id(recs[1])]



# ---------------------------------------------------------------------------
# Prometheus counter and the max_channels key
# ---------------------------------------------------------------------------


def test_prometheus_counts_refusals_per_hub_and_channel() -> None:
    link = HubLinkStats(
        addr="hub1:7443",
        connected=True,
        reconnects=0,
        unacked_bytes=0,
        rtt_p50_us=0.0,
        rtt_p99_us=0.0,
        refused={"debug": 3, "temps": 1},
        refused_channels=["debug"],
    )
    stats = Stats(
        channels=[],
        totals=Totals(
            channels=0, messages_published=0, stream_bytes=0, disk_bytes=0, subscribers=0
        ),
        latency={},
        federation=FederationStats(links=[link]),
    )
    lines = render(stats).splitlines()
    assert "# TYPE keyop_federation_refused_total counter" in lines
    assert 'keyop_federation_refused_total{hub="hub1:7443",channel="debug"} 3' in lines
    assert 'keyop_federation_refused_total{hub="hub1:7443",channel="temps"} 1' in lines


def test_max_channels_key_reaches_the_hub(pki: PKI, tmp_path: Path, start: Starter) -> None:
    """``hub.allowed_peers[].max_channels``: past it, new channels are refused
    (reason channel_limit) and the ephemeral publisher gets PolicyError."""
    hub_dir = tmp_path / "hub"
    entry = {**peer("node1"), "max_channels": 1}
    hub = start(hub_config(pki, hub_dir, [entry]))
    port = hub_port(hub)
    with EphemeralMessenger(client_config(pki, tmp_path / "unused", "node1", port)) as eph:
        first = eph.publish("one", "test.X", {})
        with pytest.raises(PolicyError, match="channel_limit") as err:
            eph.publish("two", "test.X", {})
        assert '"two"' in str(err.value)
        assert eph.status()["refused"] == {"two": 1}
    assert stored_ids(hub_dir, "one") == [first]
    assert not (hub_dir / "channels" / "two").exists()
    (audit,) = audit_events(hub_dir, "record_refused", channel="two")
    assert audit["detail"].startswith("reason=channel_limit")
    with pytest.raises(ConfigError, match="max_channels"):
        Config.from_dict({**hub_config(pki, hub_dir, [{**entry, "max_channels": -1}]).to_dict()})
