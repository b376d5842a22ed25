"""Network faults between a federated client and its hub (issue 7, part 4).

A loopback fault proxy (tests/fault_proxy.py) sits between a client
``Messenger`` and a hub ``Messenger``; the client dials the proxy. Faults:
every connection cut mid-stream, a stall, added latency, connections cut
after N bytes (mid-TLS-record / mid-WebSocket-frame) in either direction, a
hub restart, and a hub that stays unreachable.

Pass criteria (federation.md §7, §9, §11 and the README):

* every message whose ``publish`` returned on one side arrives on the other
  side's disk, in publish order;
* while the hub process stays up, exactly once (the hub marks ids seen only
  after the commit, so a batch resent after a lost acknowledgement is
  deduplicated); across a hub restart (the seen-id memory is lost) at most
  one batch of duplicates per reconnect;
* nothing partial is stored: every stored line is whole JSON;
* no reconnect storm: while the hub is unreachable the client's attempts
  follow the exponential back-off (few attempts, growing gaps).

Every wait polls with a deadline; the only timing assertions are lower
bounds on back-off gaps (load can only make gaps longer) and a generous
upper bound on the attempt count.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fault_proxy import FaultProxy
from fed_helpers import (
    PKI,
    Starter,
    client_config,
    client_status,
    hub_config,
    hub_port,
    peer,
    raw_records,
    stored_ids,
    wait_connected,
    wait_peers,
    wait_stable,
    wait_until,
)
from keyop_messenger import Config, Messenger

pki = fed_helpers.pki
start = fed_helpers.start

#: Bound of the waits for everything to arrive after a fault.
ARRIVE_S = 20.0


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


@pytest.fixture
def proxies() -> Any:
    """``proxies(target_port)`` makes a FaultProxy closed after the test."""
    made: list[FaultProxy] = []

    def _make(target_port: int) -> FaultProxy:
        p = FaultProxy(target_port, lifetime_s=90)
        made.append(p)
        return p

    try:
        yield _make
    finally:
        for p in made:
            p.close()
        # Every thread a proxy started has ended.
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name.startswith("fault-proxy")],
            "fault proxy threads to end",
            timeout=10,
        )


def with_federation(cfg: Config, **federation: Any) -> Config:
    d = cfg.to_dict()
    d["federation"].update(federation)
    return Config.from_dict(d)


def linked(
    pki: PKI,
    tmp_path: Path,
    start: Starter,
    proxies: Any,
    *,
    subscribe: tuple[str, ...] = (),
    **federation: Any,
) -> tuple[Messenger, Messenger, FaultProxy]:
    """A hub, a proxy in front of it, and a client ``node1`` publishing
    ``temps`` (and subscribing to ``subscribe``) through the proxy; returns
    once the link is up."""
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1", publish=["temps"])]))
    proxy = proxies(hub_port(hub))
    cfg = client_config(
        pki, tmp_path / "node1", "node1", proxy.port, publish=["temps"], subscribe=subscribe
    )
    client = start(with_federation(cfg, **federation) if federation else cfg)
    wait_peers(hub, "node1")
    wait_connected(client)
    return hub, client, proxy


def check_whole_lines(data_dir: Path, channel: str) -> None:
    """Every segment line of ``channel`` is one whole JSON object, and every
    segment ends with a line feed (nothing partial was stored)."""
    folder = data_dir / "channels" / channel
    for seg in sorted(folder.glob("*.jsonl")):
        content = seg.read_bytes()
        assert content == b"" or content.endswith(b"\n"), f"{seg} ends inside a record"
        for line in content.split(b"\n")[:-1]:
            assert isinstance(json.loads(line), dict), f"{seg}: not an envelope: {line[:80]!r}"


def wait_arrived(data_dir: Path, channel: str, ids: list[str]) -> list[str]:
    """Waits until every id of ``ids`` is stored in ``channel`` and the record
    count stopped changing; returns the stored ids in file order."""
    wanted = set(ids)
    wait_until(
        lambda: wanted <= set(stored_ids(data_dir, channel)),
        f"all {len(ids)} acknowledged messages in {data_dir.name}/{channel}",
        timeout=ARRIVE_S,
    )
    wait_stable(lambda: len(raw_records(data_dir, channel)), f"{channel} record count", quiet=1.0)
    return stored_ids(data_dir, channel)


def assert_exactly_once_in_order(got: list[str], sent: list[str], where: str) -> None:
    dups = len(got) - len(set(got))
    assert dups == 0, f"{where}: {dups} duplicate records (the hub stayed up: dedup must hold)"
    assert set(got) == set(sent), f"{where}: lost {len(set(sent) - set(got))} acknowledged ids"
    assert got == sent, f"{where}: not in publish order"


class Publisher:
    """Publishes ``total`` messages on ``channel`` in small batches from a
    thread, recording every acknowledged id in order."""

    def __init__(self, m: Messenger, channel: str, total: int, group: int = 5) -> None:
        self.acked: list[str] = []
        self.error: BaseException | None = None
        self._m, self._channel, self._total, self._group = m, channel, total, group
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            n = 0
            while n < self._total:
                items = [
                    ("test.Reading", {"n": n + i, "pad": "p" * 200}) for i in range(self._group)
                ]
                self.acked += self._m.publish_batch(self._channel, items)
                n += self._group
                time.sleep(0.002)
        except BaseException as exc:  # reported by join()
            self.error = exc

    @property
    def count(self) -> int:
        return len(self.acked)

    def join(self) -> list[str]:
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "publisher did not finish"
        assert self.error is None, f"publish failed: {self.error!r}"
        return self.acked


# ---------------------------------------------------------------------------
# Cut, stall, delay
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch_bytes", [None, 1024], ids=["default-batches", "small-batches"])
def test_cut_connections_mid_stream(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any, max_batch_bytes: int | None
) -> None:
    """With small batches, the client reads each next batch while the hub
    stores the one before: a cut drops that read-ahead batch, and the next
    connection sends it again from the persisted cursor."""
    batches = {"max_batch_bytes": max_batch_bytes} if max_batch_bytes else {}
    hub, client, proxy = linked(pki, tmp_path, start, proxies, subscribe=("cmds",), **batches)
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    pub = Publisher(client, "temps", 600)
    cmds: list[str] = []
    cuts = 0
    for _ in range(4):
        # Let traffic flow on a fresh connection, then cut it mid-stream.
        wait_until(lambda: proxy.live >= 1 and client_status(client)["connected"], "link up")
        cmds += [hub.publish("cmds", "test.Command", {"i": len(cmds) + i}) for i in range(10)]
        time.sleep(0.2)
        cuts += proxy.cut()
    sent = pub.join()
    assert cuts >= 4, f"only {cuts} live connections were cut"

    barrier = client.publish("temps", "test.Barrier", {})
    got = wait_arrived(hub_dir, "temps", [*sent, barrier])
    assert_exactly_once_in_order(got, [*sent, barrier], "hub temps")
    got_cmds = wait_arrived(node_dir, "cmds", cmds)
    assert_exactly_once_in_order(got_cmds, cmds, "client cmds")
    check_whole_lines(hub_dir, "temps")
    check_whole_lines(node_dir, "cmds")
    assert client_status(client)["reconnects"] >= 4


def test_stall_delays_but_loses_nothing(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any
) -> None:
    hub, client, proxy = linked(pki, tmp_path, start, proxies, subscribe=("cmds",))
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    proxy.stall()
    sent = [client.publish("temps", "test.Reading", {"n": i}) for i in range(50)]
    cmds = [hub.publish("cmds", "test.Command", {"n": i}) for i in range(20)]
    time.sleep(4.0)  # well below the 45 s read timeout: the link must survive
    assert stored_ids(hub_dir, "temps") == [], "bytes crossed a stalled proxy"
    assert stored_ids(node_dir, "cmds") == [], "bytes crossed a stalled proxy"
    proxy.resume()

    assert_exactly_once_in_order(wait_arrived(hub_dir, "temps", sent), sent, "hub temps")
    assert_exactly_once_in_order(wait_arrived(node_dir, "cmds", cmds), cmds, "client cmds")
    status = client_status(client)
    assert status["connected"] and status["reconnects"] == 0, (
        f"a 4 s stall dropped the link: {status}"
    )
    assert proxy.counts["relayed"] == 1


def test_a_lost_link_is_audited_with_its_unacknowledged_records(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any
) -> None:
    """The client's ``peer_disconnected`` carries 1.4's ``unacked=<n>`` (the
    records of the batch sent and not acknowledged) before its reason."""
    _hub, client, proxy = linked(pki, tmp_path, start, proxies)
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    proxy.stall()
    # One append: the link's next batch holds all five.
    sent = client.publish_batch("temps", [("test.Reading", {"n": i}) for i in range(5)])
    wait_until(
        lambda: client.stats().federation.links[0].unacked_bytes > 0, "a batch awaiting its ack"
    )
    proxy.cut()
    proxy.resume()
    wait_until(
        lambda: fed_helpers.audit_events(node_dir, "peer_disconnected"), "the client's audit"
    )
    (gone,) = fed_helpers.audit_events(node_dir, "peer_disconnected")
    assert gone["peer_addr"] == f"127.0.0.1:{proxy.port}"
    assert gone["detail"].startswith("unacked=5 err="), gone
    assert_exactly_once_in_order(wait_arrived(hub_dir, "temps", sent), sent, "hub temps")


def test_added_latency(pki: PKI, tmp_path: Path, start: Starter, proxies: Any) -> None:
    hub, client, proxy = linked(pki, tmp_path, start, proxies, subscribe=("cmds",))
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    proxy.delay_s = 0.05
    sent: list[str] = []
    cmds: list[str] = []
    for i in range(10):
        sent += client.publish_batch(
            "temps", [("test.Reading", {"n": i, "k": k}) for k in range(10)]
        )
        cmds.append(hub.publish("cmds", "test.Command", {"n": i}))
    assert_exactly_once_in_order(wait_arrived(hub_dir, "temps", sent), sent, "hub temps")
    assert_exactly_once_in_order(wait_arrived(node_dir, "cmds", cmds), cmds, "client cmds")
    assert client_status(client)["reconnects"] == 0


# ---------------------------------------------------------------------------
# Truncation mid-frame
# ---------------------------------------------------------------------------


def test_truncated_client_to_hub_frames(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any
) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    proxy = proxies(hub_port(hub))
    # The refusing proxy keeps the client from connecting while the backlog
    # builds up, so the first real connections carry one large batch (~130 KB).
    proxy.refuse = True
    client = start(client_config(pki, node_dir, "node1", proxy.port, publish=["temps"]))
    sent: list[str] = []
    for i in range(30):
        sent += client.publish_batch(
            "temps", [("test.Reading", {"n": i, "k": k, "pad": "x" * 400}) for k in range(10)]
        )
    # Cut inside the TLS handshake, then inside the batch at several points.
    proxy.truncate_after = [700, 9_000, 40_000, 100_000]
    proxy.refuse = False

    got = wait_arrived(hub_dir, "temps", sent)
    assert proxy.counts["truncated"] == 4, proxy.counts
    assert_exactly_once_in_order(got, sent, "hub temps")
    check_whole_lines(hub_dir, "temps")
    assert hub.federation_status().hub.peers == ["node1"]


def test_truncated_hub_to_client_frames(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any
) -> None:
    hub, client, proxy = linked(pki, tmp_path, start, proxies, subscribe=("cmds",))
    node_dir = tmp_path / "node1"
    # Hub goes "down" for the client; a backlog builds up on the hub.
    proxy.refuse = True
    proxy.cut()
    wait_until(lambda: not client_status(client)["connected"], "the client to lose the link")
    cmds: list[str] = []
    for i in range(30):
        cmds += hub.publish_batch(
            "cmds", [("test.Command", {"n": i, "k": k, "pad": "y" * 400}) for k in range(10)]
        )
    proxy.truncate_down_after = [9_000, 40_000, 100_000]
    proxy.refuse = False

    got = wait_arrived(node_dir, "cmds", cmds)
    assert proxy.counts["truncated"] == 3, proxy.counts
    assert_exactly_once_in_order(got, cmds, "client cmds")
    check_whole_lines(node_dir, "cmds")


# ---------------------------------------------------------------------------
# Hub restart: duplicates bounded by one batch per reconnect
# ---------------------------------------------------------------------------


def test_hub_restart_duplicates_bounded_by_one_batch_per_reconnect(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any
) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node1"
    hub_cfg = hub_config(pki, hub_dir, [peer("node1", publish=["temps"])])
    hub = start(hub_cfg)
    port = hub_port(hub)
    hub_cfg = hub_config(pki, hub_dir, [peer("node1", publish=["temps"])], port=port)
    proxy = proxies(port)
    max_batch = 4096
    client = start(
        with_federation(
            client_config(pki, node_dir, "node1", proxy.port, publish=["temps"]),
            max_batch_bytes=max_batch,
        )
    )
    wait_connected(client)
    pub = Publisher(client, "temps", 400)
    restarts = 0
    for _ in range(2):
        wait_until(lambda: pub.count > 0 and client_status(client)["connected"], "link up")
        time.sleep(0.3)
        hub.close()  # in the middle of the stream: a batch may be committed, not acknowledged
        restarts += 1
        hub = start(hub_cfg)
    sent = pub.join()
    barrier = client.publish("temps", "test.Barrier", {})
    got = wait_arrived(hub_dir, "temps", [*sent, barrier])

    assert set(got) == {*sent, barrier}, "an acknowledged message was lost"
    firsts = list(dict.fromkeys(got))
    assert firsts == [*sent, barrier], "first copies are in publish order"
    # One batch holds at most max_batch JSON bytes (the first record always goes).
    record_len = min(len(r) for r in raw_records(hub_dir, "temps"))
    per_batch = max_batch // record_len + 1
    reconnects = client_status(client)["reconnects"]
    assert reconnects >= restarts
    dups = len(got) - len(set(got))
    assert dups <= reconnects * per_batch, (
        f"{dups} duplicates > {reconnects} reconnects x {per_batch} records per batch"
    )
    check_whole_lines(hub_dir, "temps")


# ---------------------------------------------------------------------------
# No reconnect storm
# ---------------------------------------------------------------------------

BASE_MS, MAX_MS, JITTER = 200, 2000, 0.2
WINDOW_S = 10.0


def test_no_reconnect_storm_while_the_hub_is_unreachable(
    pki: PKI, tmp_path: Path, start: Starter, proxies: Any
) -> None:
    _hub, client, proxy = linked(
        pki,
        tmp_path,
        start,
        proxies,
        reconnect_base_ms=BASE_MS,
        reconnect_max_ms=MAX_MS,
        reconnect_jitter=JITTER,
    )
    proxy.refuse = True  # the port answers, the hub behind it is "down"
    t0 = time.monotonic()
    assert proxy.cut() == 1
    time.sleep(WINDOW_S)
    attempts = [t for t in proxy.accepted_since(t0) if t < t0 + WINDOW_S]

    # Ideal schedule: 0.2 + 0.4 + 0.8 + 1.6 s, then every 2 s: 9 attempts in 10 s.
    assert 3 <= len(attempts) <= 15, f"{len(attempts)} connection attempts in {WINDOW_S:.0f} s"
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    for k, gap in enumerate(gaps, start=1):
        floor = (1 - JITTER) * min(BASE_MS * 2**k, MAX_MS) / 1000
        assert gap >= 0.9 * floor, (
            f"attempt {k + 1} came {gap:.3f}s after the previous (< {floor:.3f}s)"
        )
    assert client_status(client)["failed_attempts"] >= len(attempts) - 1

    # The hub comes back: the client reconnects within one maximal back-off.
    proxy.refuse = False
    wait_connected(client)
    msg = client.publish("temps", "test.Reading", {"after": "storm"})
    wait_until(lambda: msg in stored_ids(tmp_path / "hub", "temps"), "delivery after recovery")
