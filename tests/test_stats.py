"""Messenger.stats(): typed snapshots of channels, subscribers, latency and
federation (issue 5 part 3; shared/spec/semantics.md §8).

Every figure is checked against what is on disk: channel sizes against the
segment files' lines, lags against offset files and record lengths, pending
timestamps against ``read_channel``'s ``Message.timestamp``.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import (
    PKI,
    Inbox,
    Starter,
    client_config,
    cursor_path,
    hub_config,
    hub_port,
    peer,
    raw_records,
    read_cursor,
    stored_ids,
    wait_peers,
    wait_until,
)
from keyop_messenger import (
    ChannelStats,
    Config,
    ConnectionLostError,
    EphemeralMessenger,
    FederationStats,
    HubLinkStats,
    HubListenerStats,
    LatencyStats,
    Messenger,
    Stats,
    SubscriberStats,
    Totals,
    read_channel,
)

# Fixtures shared through fed_helpers.
pki = fed_helpers.pki
start = fed_helpers.start


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def local_config(data_dir: Path, **subscribers: object) -> Config:
    doc: dict[str, object] = {"name": "stats-node", "storage": {"data_dir": str(data_dir)}}
    if subscribers:
        doc["subscribers"] = subscribers
    return Config.from_dict(doc)


@pytest.fixture
def messenger(tmp_path: Path, start: Starter) -> Messenger:
    return start(local_config(tmp_path / "data"))


def by_name(stats: Stats) -> dict[str, ChannelStats]:
    return {c.name: c for c in stats.channels}


def channel(m: Messenger, name: str) -> ChannelStats:
    found = by_name(m.stats())
    assert name in found, f"no stats for channel {name!r}: {sorted(found)}"
    return found[name]


def subscriber(m: Messenger, chan: str, sub_id: str) -> SubscriberStats:
    subs = {s.id: s for s in channel(m, chan).subscribers}
    assert sub_id in subs, f"no subscriber {sub_id!r} on {chan!r}: {sorted(subs)}"
    return subs[sub_id]


def disk_size(data_dir: Path, chan: str) -> int:
    """Bytes of every line (newline included) of the channel's segment files."""
    return sum(len(line) + 1 for line in raw_records(data_dir, chan))


def segment_bytes(data_dir: Path, chan: str) -> int:
    return sum(p.stat().st_size for p in (data_dir / "channels" / chan).glob("*.jsonl"))


def line_lengths(data_dir: Path, chan: str) -> dict[str, int]:
    """Message id -> length of its record line, newline included."""
    ids = stored_ids(data_dir, chan)
    lines = raw_records(data_dir, chan)
    assert len(ids) == len(lines)
    return {i: len(line) + 1 for i, line in zip(ids, lines, strict=True)}


def timestamps(data_dir: Path, chan: str) -> dict[str, datetime.datetime]:
    return {e.message.id: e.message.timestamp for e in read_channel(data_dir, chan)}


def check_totals(stats: Stats) -> None:
    chans = stats.channels
    assert stats.totals == Totals(
        channels=len(chans),
        messages_published=sum(c.messages_published for c in chans),
        stream_bytes=sum(c.stream_bytes for c in chans),
        disk_bytes=sum(c.disk_bytes for c in chans),
        subscribers=sum(len(c.subscribers) for c in chans),
    )


def check_ordered(lat: LatencyStats) -> None:
    assert lat.count > 0
    assert 0 <= lat.p50_us <= lat.p90_us <= lat.p99_us, lat


# ---------------------------------------------------------------------------
# Channels and totals
# ---------------------------------------------------------------------------


def test_empty_messenger(messenger: Messenger) -> None:
    stats = messenger.stats()
    assert isinstance(stats, Stats)
    assert stats.channels == []
    assert stats.totals == Totals(0, 0, 0, 0, 0)
    assert set(stats.latency) == {"publish", "consume", "handler"}
    assert all(lat.count == 0 for lat in stats.latency.values())
    assert stats.federation == FederationStats(links=[], listener=None)


def test_channel_counts_and_sizes(tmp_path: Path, messenger: Messenger) -> None:
    data_dir = tmp_path / "data"
    inbox_a, inbox_b = Inbox(), Inbox()
    messenger.subscribe("a", "reader", inbox_a)  # creates a.dead-letter
    messenger.subscribe("b", "reader", inbox_b)
    n, m = 25, 40
    for i in range(n):
        messenger.publish("a", "test.Reading", {"n": i, "pad": "x" * i})
    messenger.publish_batch("b", [("test.Reading", {"n": i}) for i in range(m)])

    stats = messenger.stats()
    chans = by_name(stats)
    assert {"a", "b", "a.dead-letter", "b.dead-letter"} <= set(chans)
    a, b = chans["a"], chans["b"]
    assert (a.messages_published, b.messages_published) == (n, m)
    for c in (a, b):
        on_disk = disk_size(data_dir, c.name)
        assert c.stream_bytes == c.disk_bytes == on_disk > 0, c
        assert c.stream_bytes == messenger.stream_end(c.name)
        assert c.disk_bytes == segment_bytes(data_dir, c.name)
    for dl in ("a.dead-letter", "b.dead-letter"):
        assert chans[dl].messages_published == 0
        assert chans[dl].stream_bytes == chans[dl].disk_bytes == 0
        assert chans[dl].subscribers == []
    check_totals(stats)
    assert stats.totals.messages_published == n + m
    assert stats.totals.channels == len(chans) == 4

    # Snapshots follow further publishes.
    messenger.publish("a", "test.Reading", {"n": n})
    a2 = channel(messenger, "a")
    assert a2.messages_published == n + 1
    assert a2.stream_bytes == a2.disk_bytes == disk_size(data_dir, "a") > a.stream_bytes
    inbox_a.wait_count(n + 1)
    inbox_b.wait_count(m)


def test_disk_bytes_after_segment_rolls_and_compaction(tmp_path: Path, start: Starter) -> None:
    """stream_bytes is the stream end; disk_bytes only what is still on disk."""
    data_dir = tmp_path / "data"
    m = start(
        Config.from_dict(
            {
                "name": "stats-node",
                "storage": {"data_dir": str(data_dir), "segment_size_mb": 1},
            }
        )
    )
    inbox = Inbox()
    m.subscribe("big", "reader", inbox)
    pad = "x" * 1000
    for _ in range(3):
        m.publish_batch("big", [("test.Blob", {"n": i, "pad": pad}) for i in range(900)])
    inbox.wait_count(2700)
    wait_until(lambda: subscriber(m, "big", "reader").lag_bytes == 0, "reader at the end")
    segments = sorted((data_dir / "channels" / "big").glob("*.jsonl"))
    assert len(segments) >= 2, "expected the channel to roll segments"
    big = channel(m, "big")
    assert big.messages_published == 2700
    assert big.stream_bytes == big.disk_bytes == segment_bytes(data_dir, "big")
    assert big.stream_bytes == m.stream_end("big") == disk_size(data_dir, "big")

    m.compact()
    after = channel(m, "big")
    assert len(list((data_dir / "channels" / "big").glob("*.jsonl"))) < len(segments)
    assert after.stream_bytes == big.stream_bytes, "the stream end does not move"
    assert after.disk_bytes == segment_bytes(data_dir, "big") < after.stream_bytes
    assert after.messages_published == 2700
    assert subscriber(m, "big", "reader").lag_bytes == 0
    check_totals(m.stats())


def test_reopened_channel_counts_from_zero(tmp_path: Path, start: Starter) -> None:
    data_dir = tmp_path / "data"
    cfg = local_config(data_dir)
    first = Messenger(cfg)
    try:
        inbox = Inbox()
        sub = first.subscribe("a", "reader", inbox)
        ids = [first.publish("a", "test.Reading", {"n": i}) for i in range(5)]
        first.publish_batch("b", [("test.Reading", {"n": i}) for i in range(3)])
        inbox.wait_count(5)
        wait_until(lambda: subscriber(first, "a", "reader").lag_bytes == 0, "reader caught up")
        sub.close()
    finally:
        first.close()
    assert stored_ids(data_dir, "a") == ids

    second = start(cfg)
    chans = by_name(second.stats())
    for name in ("a", "b"):
        c = chans[name]
        assert c.messages_published == 0, "counts restart with the messenger"
        assert c.stream_bytes == c.disk_bytes == disk_size(data_dir, name) > 0
    (reader,) = chans["a"].subscribers
    assert reader == SubscriberStats("reader", 0, None, False)
    check_totals(second.stats())

    extra = second.publish("a", "test.Reading", {"n": 5})
    a = channel(second, "a")
    assert a.messages_published == 1
    assert a.stream_bytes == a.disk_bytes == disk_size(data_dir, "a")
    # The closed reader now lags by exactly the new record.
    reader = subscriber(second, "a", "reader")
    assert reader.lag_bytes == line_lengths(data_dir, "a")[extra]
    assert reader.oldest_pending == timestamps(data_dir, "a")[extra]
    assert reader.active is False


def test_dead_letters_count_on_their_own_channel(tmp_path: Path, start: Starter) -> None:
    data_dir = tmp_path / "data"
    m = start(local_config(data_dir, max_retries=0))
    failed = threading.Event()

    def failing(msg: object) -> None:
        failed.set()
        raise RuntimeError("always")

    m.subscribe("a", "bad", failing)
    m.publish_batch("a", [("test.Reading", {"n": i}) for i in range(3)])
    # The records are in the file a moment before the writer's counters move:
    # wait for both, then compare.
    wait_until(
        lambda: len(raw_records(data_dir, "a.dead-letter")) == 3
        and channel(m, "a.dead-letter").messages_published == 3,
        "3 dead letters, counted",
    )
    dl = channel(m, "a.dead-letter")
    assert dl.stream_bytes == dl.disk_bytes == disk_size(data_dir, "a.dead-letter") > 0
    assert channel(m, "a").messages_published == 3
    # Every append counts on the channel it lands in: the dead letters on
    # a.dead-letter (1.4 did not count them anywhere), never on "a" twice.
    assert dl.messages_published == 3


# ---------------------------------------------------------------------------
# Subscribers: lag and oldest pending
# ---------------------------------------------------------------------------


def test_subscriber_lag_and_oldest_pending(tmp_path: Path, messenger: Messenger) -> None:
    data_dir = tmp_path / "data"
    live, gone = Inbox(), Inbox()
    messenger.subscribe("a", "live", live)
    gone_sub = messenger.subscribe("a", "gone", gone)
    first = [messenger.publish("a", "test.Reading", {"n": i}) for i in range(10)]
    live.wait_count(10)
    gone.wait_count(10)
    wait_until(
        lambda: all(s.lag_bytes == 0 for s in channel(messenger, "a").subscribers),
        "both subscribers at the end",
    )
    gone_sub.close()
    offset_file = cursor_path(data_dir, "a", "gone")
    assert read_cursor(offset_file) == messenger.stream_end("a")

    missed = [messenger.publish("a", "test.Reading", {"n": i}) for i in range(10, 17)]
    missed.append(messenger.publish_batch("a", [("test.Reading", {"n": 17})])[0])
    live.wait_count(18)
    wait_until(lambda: subscriber(messenger, "a", "live").lag_bytes == 0, "live at the end")

    a = channel(messenger, "a")
    subs = {s.id: s for s in a.subscribers}
    assert set(subs) == {"live", "gone"}
    assert subs["live"] == SubscriberStats("live", 0, None, True)
    lengths = line_lengths(data_dir, "a")
    assert stored_ids(data_dir, "a") == first + missed
    g = subs["gone"]
    assert g.active is False
    assert g.lag_bytes == sum(lengths[i] for i in missed)
    assert g.lag_bytes == a.stream_bytes - read_cursor(offset_file)  # type: ignore[operator]
    ts = timestamps(data_dir, "a")
    assert g.oldest_pending == ts[missed[0]]
    assert g.oldest_pending is not None and g.oldest_pending.tzinfo is not None
    check_totals(messenger.stats())
    assert messenger.stats().totals.subscribers == 2


def test_an_unreadable_offset_file_is_left_out_with_a_warning(
    tmp_path: Path, messenger: Messenger, caplog: pytest.LogCaptureFixture
) -> None:
    messenger.publish("a", "test.Reading", {"n": 1})
    broken = cursor_path(tmp_path / "data", "a", "broken")
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text("not a number\n")
    with caplog.at_level("WARNING", logger="keyop_messenger"):
        subs = channel(messenger, "a").subscribers
    assert [s.id for s in subs] == []
    warned = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warned) == 1 and str(broken) in warned[0], caplog.text
    assert "retention keeps the channel's data" in warned[0]


def test_busy_subscriber_reports_its_pending_message(tmp_path: Path, messenger: Messenger) -> None:
    """An active subscriber stuck in its handler lags by the unacknowledged
    records, and its oldest pending time is the message being handled."""
    data_dir = tmp_path / "data"
    release, entered = threading.Event(), threading.Event()
    seen = Inbox()

    def slow(msg: object) -> None:
        entered.set()
        release.wait(15)
        seen(msg)  # type: ignore[arg-type]

    messenger.subscribe("a", "slow", slow)
    try:
        ids = [messenger.publish("a", "test.Reading", {"n": i}) for i in range(4)]
        assert entered.wait(15), "handler never called"
        s = subscriber(messenger, "a", "slow")
        assert s.active is True
        assert s.lag_bytes == sum(line_lengths(data_dir, "a").values())
        assert s.oldest_pending == timestamps(data_dir, "a")[ids[0]]
    finally:
        release.set()
    seen.wait_count(4)
    wait_until(lambda: subscriber(messenger, "a", "slow").lag_bytes == 0, "slow caught up")
    assert subscriber(messenger, "a", "slow").oldest_pending is None


# ---------------------------------------------------------------------------
# Latency
# ---------------------------------------------------------------------------


def test_latency_windows(messenger: Messenger) -> None:
    before = messenger.stats().latency
    assert all(lat.count == 0 for lat in before.values())
    inbox = Inbox()
    messenger.subscribe("a", "reader", inbox)
    for i in range(20):
        messenger.publish("a", "test.Reading", {"n": i})
    messenger.publish_batch("a", [("test.Reading", {"n": i}) for i in range(20, 30)])
    inbox.wait_count(30)
    wait_until(lambda: messenger.stats().latency["handler"].count > 0, "handler samples")
    lat = messenger.stats().latency
    assert set(lat) == {"publish", "consume", "handler"}
    for stage in ("publish", "consume", "handler"):
        check_ordered(lat[stage])
        assert isinstance(lat[stage], LatencyStats)
    # One sample per publish call (the batch is one call).
    assert lat["publish"].count == 21
    assert lat["consume"].count <= 30 and lat["handler"].count <= 30


# ---------------------------------------------------------------------------
# Federation
# ---------------------------------------------------------------------------


@pytest.fixture
def hub_and_client(
    pki: PKI, tmp_path: Path, start: Starter
) -> Iterator[tuple[Messenger, Messenger, int]]:
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1"), peer("node2")]))
    port = hub_port(hub)
    client = start(
        client_config(pki, tmp_path / "node1", "node1", port, subscribe=["cmds"], publish=["temps"])
    )
    wait_peers(hub, "node1")
    yield hub, client, port


def test_hub_listener_and_client_link(
    pki: PKI, tmp_path: Path, hub_and_client: tuple[Messenger, Messenger, int]
) -> None:
    hub, client, port = hub_and_client
    hub_dir = tmp_path / "hub"
    addr = f"127.0.0.1:{port}"

    inbox = Inbox()
    client.subscribe("cmds", "app", inbox)
    sent = [client.publish("temps", "test.Reading", {"n": i}) for i in range(6)]
    sent += client.publish_batch("temps", [("test.Reading", {"n": i}) for i in range(6, 12)])
    wait_until(lambda: stored_ids(hub_dir, "temps") == sent, "12 records on the hub")

    # An ephemeral client's records count too.
    eph_cfg = client_config(pki, tmp_path / "eph", "node2", port)
    with EphemeralMessenger(eph_cfg) as eph:
        sent += eph.publish_batch("temps", [("test.Reading", {"n": 12}), ("test.Reading", {})])
    assert stored_ids(hub_dir, "temps") == sent

    listener = wait_until(
        lambda: (s := hub.stats().federation.listener) and s.records_received == 14 and s,
        "records_received == 14",
    )
    assert isinstance(listener, HubListenerStats)
    assert listener.listen_addr == addr
    assert listener.connections_accepted >= 2
    assert listener.connections_rejected == 0
    wait_until(lambda: hub.stats().federation.listener.peers == ["node1"], "node1 only")  # type: ignore[union-attr]
    assert hub.stats().federation.links == []
    # Federated records count as published on the hub.
    temps = channel(hub, "temps")
    assert temps.messages_published == 14
    assert temps.stream_bytes == temps.disk_bytes == disk_size(hub_dir, "temps")

    # An allow-listed CA but unknown CN is rejected and counted.
    intruder = client_config(pki, tmp_path / "intruder", "intruder", port)
    with pytest.raises(ConnectionLostError):
        EphemeralMessenger(intruder).__enter__()
    wait_until(
        lambda: hub.stats().federation.listener.connections_rejected == 1,  # type: ignore[union-attr]
        "one rejected connection",
    )
    assert hub.stats().federation.listener.peers == ["node1"]  # type: ignore[union-attr]

    # The client's link: connected, round trips measured, nothing unacknowledged.
    link = wait_until(
        lambda: [
            lk
            for lk in client.stats().federation.links
            if lk.rtt_p50_us > 0 and lk.unacked_bytes == 0
        ],
        "a measured round trip",
    )
    (lk,) = link
    assert isinstance(lk, HubLinkStats)
    assert lk.addr == addr
    assert lk.connected is True
    assert lk.reconnects == 0
    assert 0 < lk.rtt_p50_us <= lk.rtt_p99_us
    assert client.stats().federation.listener is None

    # Hub -> client: the fed-node1 cursor shows up on the hub's channel.
    cmds = [hub.publish("cmds", "test.Command", {"n": i}) for i in range(3)]
    inbox.wait_count(3)
    assert inbox.ids() == cmds
    wait_until(lambda: subscriber(hub, "cmds", "fed-node1").lag_bytes == 0, "fed cursor at end")
    # Federation cursors are active while their link is connected.
    assert subscriber(hub, "cmds", "fed-node1").active is True
    forwarding = f"hub-127.0.0.1_{port}"
    wait_until(lambda: subscriber(client, "temps", forwarding).lag_bytes == 0, "forwarded")
    assert subscriber(client, "temps", forwarding).active is True


def test_federation_cursor_lag_while_client_is_away(
    pki: PKI, tmp_path: Path, hub_and_client: tuple[Messenger, Messenger, int]
) -> None:
    hub, client, _port = hub_and_client
    hub_dir = tmp_path / "hub"
    inbox = Inbox()
    client.subscribe("cmds", "app", inbox)
    first = hub.publish("cmds", "test.Command", {"n": 0})
    inbox.wait_count(1)
    wait_until(lambda: subscriber(hub, "cmds", "fed-node1").lag_bytes == 0, "fed cursor at end")

    client.close()
    wait_peers(hub)
    assert hub.stats().federation.listener.peers == []  # type: ignore[union-attr]
    missed = [hub.publish("cmds", "test.Command", {"n": i}) for i in range(1, 4)]
    fed = subscriber(hub, "cmds", "fed-node1")
    lengths = line_lengths(hub_dir, "cmds")
    assert stored_ids(hub_dir, "cmds") == [first, *missed]
    assert fed.lag_bytes == sum(lengths[i] for i in missed)
    assert fed.oldest_pending == timestamps(hub_dir, "cmds")[missed[0]]
    assert fed.active is False


def test_client_link_to_a_down_hub(pki: PKI, tmp_path: Path, start: Starter) -> None:
    port = fed_helpers.free_port()
    client = start(client_config(pki, tmp_path / "node1", "node1", port, publish=["temps"]))
    (lk,) = client.stats().federation.links
    assert lk.addr == f"127.0.0.1:{port}"
    assert lk.connected is False
    assert lk.reconnects == 0
    assert (lk.rtt_p50_us, lk.rtt_p99_us) == (0.0, 0.0)
    client.publish("temps", "test.Reading", {})
    temps = channel(client, "temps")
    assert temps.messages_published == 1


def test_stats_types_are_frozen(messenger: Messenger) -> None:
    messenger.publish("a", "test.Reading", {})
    stats = messenger.stats()
    with pytest.raises(AttributeError):
        stats.channels[0].messages_published = 5  # type: ignore[misc]
