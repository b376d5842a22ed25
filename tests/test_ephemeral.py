# why this file is long: 24 end-to-end tests of EphemeralMessenger sharing one hub fixture and
# its certificates.
"""EphemeralMessenger: a storage-less hub client (issue 5 part 1).

Spec: shared/spec/semantics.md §7 and federation.md §10, with the deliberate
differences of this implementation (issue 5):

* ``publish()`` returns only once the hub committed the message and
  acknowledged the frame that carried it;
* without ``auto_reconnect`` a missing or lost connection is an immediate
  :class:`ConnectionLostError` (no waiting);
* the outbound buffer is bounded by ``federation.send_buffer_messages``
  publish calls and a full buffer is a :class:`BufferFullError`;
* the hub keeps no cursor file for an ephemeral peer, so subscriptions are
  live only (nothing stored while the client was away is replayed).

Hubs are real ``Messenger`` instances on 127.0.0.1 (port 0, or a remembered
port for restarts) with mutual TLS from the session PKI of fed_helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import (
    FAST_RECONNECT,
    PKI,
    WAIT_S,
    Inbox,
    Starter,
    audit_events,
    client_config,
    free_port,
    hub_config,
    hub_port,
    hub_status,
    peer,
    stored,
    stored_ids,
    tls_section,
    wait_peers,
    wait_stable,
    wait_until,
)
from keyop_messenger import (
    BufferFullError,
    ClosedError,
    Config,
    ConnectionLostError,
    EphemeralMessenger,
    InvalidNameError,
    KeyopError,
    KeyopTimeoutError,
    MessageTooLargeError,
    Messenger,
    PayloadTypeError,
    PolicyError,
    SubscriptionError,
    context,
    read_channel,
)

# Fixtures shared through fed_helpers.
pki = fed_helpers.pki
start = fed_helpers.start

#: Bound on calls that must fail or return "promptly".
PROMPT_S = 5.0
#: Bound on calls that must fail "at once" (no network wait involved).
AT_ONCE_S = 1.5


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def eph_config(
    pki: PKI,
    tmp_path: Path,
    port: int,
    *,
    name: str = "node1",
    cert_name: str | None = None,
    subscribe: Sequence[str] = (),
    **federation: Any,
) -> Config:
    """A configuration for an ephemeral client ``name`` of the hub on ``port``.

    ``storage.data_dir`` points at ``tmp_path/<name>-unused``: an ephemeral
    messenger must never create it."""
    return Config.from_dict(
        {
            "name": name,
            "storage": {"data_dir": str(tmp_path / f"{name}-unused")},
            "client": {
                "enabled": True,
                "hubs": [
                    {"addr": f"127.0.0.1:{port}", "subscribe": list(subscribe), "publish": []}
                ],
            },
            "tls": tls_section(pki, cert_name or name),
            "federation": {**FAST_RECONNECT, **federation},
        }
    )


EphStarter = Callable[..., EphemeralMessenger]


@pytest.fixture
def ephemeral() -> Iterator[EphStarter]:
    """``ephemeral(config, auto_reconnect=...)`` builds an (unconnected)
    EphemeralMessenger that is closed after the test."""
    opened: list[EphemeralMessenger] = []

    def _make(config: Config, *, auto_reconnect: bool = False) -> EphemeralMessenger:
        e = EphemeralMessenger(config, auto_reconnect=auto_reconnect)
        opened.append(e)
        return e

    try:
        yield _make
    finally:
        for e in reversed(opened):
            e.close()


class Call:
    """Runs ``fn()`` on a daemon thread and records its outcome, so that a
    call that should return or fail promptly can never hang the test run."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self._done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:
                self.error = exc
            finally:
                self.finished_at = time.monotonic()
                self._done.set()

        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float = WAIT_S) -> Call:
        assert self._done.wait(timeout), f"call still running after {timeout:.0f}s"
        return self

    def value(self, timeout: float = WAIT_S) -> Any:
        self.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.result

    def elapsed(self) -> float:
        assert self.finished_at is not None
        return self.finished_at - self.started_at


def bounded(fn: Callable[[], Any], timeout: float = PROMPT_S) -> Any:
    """``fn()``, which must finish (return or raise) within ``timeout``."""
    return Call(fn).value(timeout)


def hub_for(
    pki: PKI, hub_dir: Path, start: Starter, *, port: int = 0, peers: Sequence[str] = ("node1",)
) -> Messenger:
    return start(hub_config(pki, hub_dir, [peer(p) for p in peers], port=port))


HubAndClient = Callable[..., tuple[Path, Messenger, EphemeralMessenger]]


@pytest.fixture
def hub_and_client(pki: PKI, tmp_path: Path, start: Starter, ephemeral: EphStarter) -> HubAndClient:
    """``hub_and_client(connect=True, auto_reconnect=False, **options)`` starts
    a hub in ``tmp_path/hub`` that allows ``node1`` and an ephemeral client of
    it (``options`` go to :func:`eph_config`), connected unless
    ``connect=False``; returns ``(hub_dir, hub, eph)``. Both are closed after
    the test."""

    def _make(
        *, connect: bool = True, auto_reconnect: bool = False, **options: Any
    ) -> tuple[Path, Messenger, EphemeralMessenger]:
        hub_dir = tmp_path / "hub"
        hub = hub_for(pki, hub_dir, start)
        eph = ephemeral(
            eph_config(pki, tmp_path, hub_port(hub), **options), auto_reconnect=auto_reconnect
        )
        if connect:
            eph.connect()
        return hub_dir, hub, eph

    return _make


def no_fed_cursor_files(hub_dir: Path) -> list[Path]:
    """Every ``fed-*`` file anywhere under the hub's subscribers/ tree."""
    root = hub_dir / "subscribers"
    return sorted(root.rglob("fed-*")) if root.exists() else []


@dataclasses.dataclass
class Reading:
    n: int
    unit: str = "C"


# ---------------------------------------------------------------------------
# Publishing: acknowledged only after the hub committed
# ---------------------------------------------------------------------------


def test_publish_returns_after_hub_commit(tmp_path: Path, hub_and_client: HubAndClient) -> None:
    hub_dir, hub, eph = hub_and_client()
    assert eph.status()["connected"] is True

    ids: list[str] = []
    for i in range(40):
        msg_id = eph.publish("temps", "test.Reading", {"n": i})
        ids.append(msg_id)
        # Already committed on the hub at the moment publish() returned.
        assert stored_ids(hub_dir, "temps") == ids, f"publish {i} returned before the commit"
        assert hub.stream_end("temps") > 0

    batch = [("test.Reading", {"n": i}) for i in range(40, 1040)]
    batch_ids = eph.publish_batch("temps", batch)
    assert len(batch_ids) == 1000 and len(set(batch_ids)) == 1000
    on_hub = stored(hub_dir, "temps")
    assert [m.id for m in on_hub] == ids + batch_ids, "all 1000 on the hub at once, in order"
    assert [m.payload["n"] for m in on_hub] == list(range(1040))
    assert {m.origin for m in on_hub} == {"node1"}
    assert {m.payload_type for m in on_hub} == {"test.Reading"}
    # The hub Messenger's own reader agrees with the file reader.
    assert [e.message.id for e in hub.read_channel("temps")] == ids + batch_ids

    # An empty batch sends nothing and returns no ids.
    assert eph.publish_batch("temps", []) == []
    assert len(stored_ids(hub_dir, "temps")) == 1040
    assert eph.status()["unacked_bytes"] == 0
    # No local storage at all.
    assert not (tmp_path / "node1-unused").exists()


def test_concurrent_publishes_are_each_acknowledged(hub_and_client: HubAndClient) -> None:
    """Publishes from several threads share frames; every call returns its
    own ids, each one committed on the hub exactly once."""
    hub_dir, _hub, eph = hub_and_client()

    results: dict[int, list[str]] = {}

    def worker(t: int) -> None:
        mine = []
        for i in range(50):
            msg_id = eph.publish("temps", "test.Reading", {"t": t, "n": i})
            assert msg_id in stored_ids(hub_dir, "temps"), "returned before the commit"
            mine.append(msg_id)
        results[t] = mine

    calls = [Call(functools.partial(worker, t)) for t in range(4)]
    for c in calls:
        c.value(WAIT_S)
    on_hub = stored(hub_dir, "temps")
    assert len(on_hub) == 200 and len({m.id for m in on_hub}) == 200
    for t, mine in results.items():
        # Each thread's messages keep their order on the hub.
        assert [m.id for m in on_hub if m.payload["t"] == t] == mine


def test_metadata_travels_to_the_hub(hub_and_client: HubAndClient) -> None:
    hub_dir, _hub, eph = hub_and_client()
    assert eph.name == "node1"

    plain = eph.publish("temps", "test.Reading", {"n": 0})
    explicit = eph.publish(
        "temps", "test.Reading", {"n": 1}, service_name="svc-x", correlation_id="corr-1"
    )
    with context(service_name="ctx-svc", correlation_id="ctx-corr"):
        from_ctx = eph.publish("temps", "test.Reading", {"n": 2})
        batch_ids = eph.publish_batch("temps", [("test.Reading", {"n": 3})] * 2)
        overridden = eph.publish("temps", "test.Reading", {"n": 4}, correlation_id="own")
        with context(correlation_id="inner"):
            nested = eph.publish("temps", "test.Reading", {"n": 5})
    after = eph.publish("temps", "test.Reading", {"n": 6})

    got = {m.id: m for m in stored(hub_dir, "temps")}
    meta = {k: (m.service_name, m.correlation_id) for k, m in got.items()}
    assert meta[plain] == (None, None)
    assert meta[explicit] == ("svc-x", "corr-1")
    assert meta[from_ctx] == ("ctx-svc", "ctx-corr")
    assert [meta[i] for i in batch_ids] == [("ctx-svc", "ctx-corr")] * 2
    assert meta[overridden] == ("ctx-svc", "own")
    assert meta[nested] == ("ctx-svc", "inner")
    assert meta[after] == (None, None)
    assert {m.origin for m in got.values()} == {"node1"}, "origin = config name"
    assert {m.channel for m in got.values()} == {"temps"}
    # Timestamps are set by the publisher and are recent.
    now = time.time()
    assert all(abs(m.timestamp.timestamp() - now) < 60 for m in got.values())


def test_origin_is_the_config_name(hub_and_client: HubAndClient) -> None:
    """The hub identifies the peer by certificate CN; ``origin`` is the
    configured instance name."""
    hub_dir, hub, eph = hub_and_client(name="script-7", cert_name="node1")
    wait_peers(hub, "node1")
    msg_id = eph.publish("temps", "test.Reading", {"n": 1})
    (m,) = stored(hub_dir, "temps")
    assert (m.id, m.origin) == (msg_id, "script-7")


# ---------------------------------------------------------------------------
# Subscribing: live only, no cursor files on the hub
# ---------------------------------------------------------------------------


def test_subscribe_receives_live_messages_only(
    pki: PKI, tmp_path: Path, start: Starter, ephemeral: EphStarter
) -> None:
    hub_dir = tmp_path / "hub"
    hub = hub_for(pki, hub_dir, start)
    port = hub_port(hub)
    before = [hub.publish("cmds", "test.Command", {"n": i}) for i in range(5)]

    cfg = eph_config(pki, tmp_path, port, subscribe=["cmds", "alerts"])
    eph = ephemeral(cfg)
    inbox, second, alerts = Inbox(), Inbox(), Inbox()
    eph.subscribe("cmds", inbox)
    eph.subscribe("cmds", second)  # several handlers per channel
    eph.subscribe("alerts", alerts)
    eph.register_payload_type("test.Reading", Reading)
    eph.connect()
    wait_peers(hub, "node1")

    live = hub.publish("cmds", "test.Command", {"n": 5}, correlation_id="c-5")
    (got,) = inbox.wait_count(1, "live cmds")
    assert (got.id, got.origin, got.channel, got.payload) == (live, "hub1", "cmds", {"n": 5})
    assert got.correlation_id == "c-5"
    assert live not in before
    second.wait_count(1)
    assert second.ids() == [live]

    # A batch arrives whole, in order, decoded into the registered type.
    readings = hub.publish_batch(
        "alerts", [("test.Reading", {"n": i, "unit": "K"}) for i in (1, 2)]
    )
    got_alerts = alerts.wait_count(2, "alerts")
    assert [m.id for m in got_alerts] == readings
    assert [m.payload for m in got_alerts] == [Reading(1, "K"), Reading(2, "K")]

    # A channel the client did not request is not delivered: barrier on cmds.
    hub.publish("other", "test.Command", {})
    barrier = hub.publish("cmds", "test.Command", {"barrier": True})
    inbox.wait_count(2)
    assert inbox.ids() == [live, barrier], "stored-before messages are not replayed"
    assert alerts.ids() == readings

    # Messages stored while the client is away are not delivered after it
    # connects again (live only: the hub kept no position for it).
    eph.close()
    wait_peers(hub)
    missed = [hub.publish("cmds", "test.Command", {"missed": i}) for i in range(3)]
    again = ephemeral(cfg)
    inbox2 = Inbox()
    again.subscribe("cmds", inbox2)
    again.connect()
    wait_peers(hub, "node1")
    live2 = hub.publish("cmds", "test.Command", {"n": 6})
    inbox2.wait_count(1)
    wait_stable(lambda: len(inbox2.messages), "the second client's inbox", quiet=0.3)
    assert inbox2.ids() == [live2], f"missed {missed} must not be delivered"
    assert inbox.ids() == [live, barrier], "a closed client receives nothing"

    # The hub kept no cursor for the ephemeral peer, on any channel.
    assert no_fed_cursor_files(hub_dir) == []


def test_a_record_published_once_connect_returns_is_delivered(
    pki: PKI, tmp_path: Path, start: Starter, ephemeral: EphStarter
) -> None:
    """Whatever is published after ``connect()`` returns reaches a live
    listener: the hub starts the peer's readers before it welcomes the peer.
    Repeated, since the window it closes was short (the hub once welcomed
    first, then started reading at the end)."""
    hub = hub_for(pki, tmp_path / "hub", start)
    # Many subscribed channels make the hub's start of the peer's readers
    # take a while; the record goes to the last of them.
    channels = [f"cmds-{i:03}" for i in range(200)]
    for channel in channels:
        hub.publish(channel, "test.Command", {})
    for n in range(5):
        eph = ephemeral(eph_config(pki, tmp_path, hub_port(hub), subscribe=channels))
        inbox = Inbox()
        for channel in channels:
            eph.subscribe(channel, inbox)
        eph.connect()
        sent = hub.publish(channels[-1], "test.Command", {"n": n})
        inbox.wait_count(1, f"command {n}")
        assert inbox.ids() == [sent]
        eph.close()


def test_publish_from_inside_a_handler(hub_and_client: HubAndClient) -> None:
    """Request/reply: a live listener answers each command with a publish."""
    hub_dir, hub, eph = hub_and_client(subscribe=["cmds"], connect=False)
    outcomes: list[Any] = []

    def reply(msg: Any) -> None:
        try:
            outcomes.append(eph.publish("replies", "test.Reply", {"to": msg.id}))
        except Exception as exc:
            outcomes.append(exc)

    eph.subscribe("cmds", reply)
    eph.connect()
    wait_peers(hub, "node1")
    cmd = hub.publish("cmds", "test.Command", {})
    # The reply must be acknowledged promptly, like any publish.
    wait_until(lambda: outcomes, "the reply publish to return", timeout=PROMPT_S)
    (reply_id,) = outcomes
    assert isinstance(reply_id, str), reply_id
    (stored_reply,) = stored(hub_dir, "replies")
    assert (stored_reply.id, stored_reply.payload) == (reply_id, {"to": cmd})


def test_handler_error_does_not_stop_delivery(hub_and_client: HubAndClient) -> None:
    hub_dir, hub, eph = hub_and_client(subscribe=["cmds"], connect=False)
    inbox = Inbox()
    calls: list[str] = []

    def failing(msg: Any) -> None:
        calls.append(msg.id)
        raise RuntimeError("boom")

    eph.subscribe("cmds", failing)
    eph.subscribe("cmds", inbox)
    eph.connect()
    wait_peers(hub, "node1")
    ids = [hub.publish("cmds", "test.Command", {"n": i}) for i in range(3)]
    inbox.wait_count(3)
    assert inbox.ids() == ids
    assert calls == ids, "no retry of a failed ephemeral handler"
    # The connection survived and publishing still works.
    assert eph.status()["connected"] is True
    msg_id = eph.publish("temps", "test.Reading", {})
    assert stored_ids(hub_dir, "temps") == [msg_id]
    assert no_fed_cursor_files(hub_dir) == []


# ---------------------------------------------------------------------------
# Connection failures without auto-reconnect
# ---------------------------------------------------------------------------


def test_connect_to_a_down_hub_fails_fast(pki: PKI, tmp_path: Path, ephemeral: EphStarter) -> None:
    eph = ephemeral(eph_config(pki, tmp_path, free_port()))
    call = Call(eph.connect).wait(PROMPT_S)
    assert isinstance(call.error, ConnectionLostError), call.error
    assert call.elapsed() < PROMPT_S
    assert eph.status()["connected"] is False
    # Still failing afterwards, also for publishes.
    with pytest.raises(ConnectionLostError):
        bounded(eph.connect)
    with pytest.raises(ConnectionLostError):
        bounded(lambda: eph.publish("temps", "test.Reading", {}))


def test_publish_before_connect_fails(hub_and_client: HubAndClient) -> None:
    hub_dir, _hub, eph = hub_and_client(connect=False)
    with pytest.raises(ConnectionLostError):
        bounded(lambda: eph.publish("temps", "test.Reading", {}))
    with pytest.raises(ConnectionLostError):
        bounded(lambda: eph.publish_batch("temps", [("test.Reading", {})]))
    assert stored_ids(hub_dir, "temps") == []
    # Connecting afterwards works, and connect() is idempotent once connected.
    eph.connect()
    eph.connect()
    msg_id = eph.publish("temps", "test.Reading", {})
    assert stored_ids(hub_dir, "temps") == [msg_id]


def test_publish_after_hub_closes_fails_promptly(hub_and_client: HubAndClient) -> None:
    hub_dir, hub, eph = hub_and_client()
    first = eph.publish("temps", "test.Reading", {"n": 0})
    hub.close()

    # Whether or not the client noticed the loss yet, publish must not hang.
    call = Call(lambda: eph.publish("temps", "test.Reading", {"n": 1})).wait(PROMPT_S)
    assert isinstance(call.error, ConnectionLostError), call.error
    wait_until(lambda: eph.status()["connected"] is False, "the client to see the loss")
    for _ in range(3):
        call = Call(lambda: eph.publish("temps", "test.Reading", {"n": 2})).wait(PROMPT_S)
        assert isinstance(call.error, ConnectionLostError), call.error
        assert call.elapsed() < AT_ONCE_S, "a lost connection fails at once"
    # Without auto_reconnect it stays lost, even when the hub comes back.
    with pytest.raises(ConnectionLostError):
        bounded(eph.connect)
    assert stored_ids(hub_dir, "temps") == [first]
    assert eph.status()["reconnects"] == 0


# ---------------------------------------------------------------------------
# Auto-reconnect and the bounded buffer
# ---------------------------------------------------------------------------


def test_auto_reconnect_across_hub_restart(
    pki: PKI, start: Starter, hub_and_client: HubAndClient
) -> None:
    hub_dir, hub, eph = hub_and_client(subscribe=["cmds"], auto_reconnect=True, connect=False)
    port = hub_port(hub)
    inbox = Inbox()
    eph.subscribe("cmds", inbox)
    eph.connect()
    first = eph.publish("temps", "test.Reading", {"n": 0})

    hub.close()
    wait_until(lambda: eph.status()["connected"] is False, "the client to see the hub go")
    pending = Call(lambda: eph.publish("temps", "test.Reading", {"n": 1}))
    time.sleep(0.5)
    assert not pending.done, f"publish returned while the hub was down: {pending.error!r}"
    wait_until(lambda: eph.status()["failed_attempts"] >= 1, "a failed redial")

    assert not pending.done
    restart_at = time.monotonic()
    hub = hub_for(pki, hub_dir, start, port=port)
    msg_id = pending.value(WAIT_S)
    assert pending.finished_at is not None and pending.finished_at >= restart_at
    assert stored_ids(hub_dir, "temps") == [first, msg_id], "the queued publish, once"
    status = eph.status()
    assert status["connected"] is True and status["reconnects"] >= 1

    # Live delivery resumes on the new connection.
    wait_peers(hub, "node1")
    cmd = hub.publish("cmds", "test.Command", {})
    inbox.wait_count(1)
    assert inbox.ids() == [cmd]
    later = eph.publish("temps", "test.Reading", {"n": 2})
    assert stored_ids(hub_dir, "temps") == [first, msg_id, later]
    assert no_fed_cursor_files(hub_dir) == []


def test_connect_with_auto_reconnect_waits_for_the_hub(
    pki: PKI, tmp_path: Path, start: Starter, ephemeral: EphStarter
) -> None:
    port = free_port()
    hub_dir = tmp_path / "hub"
    eph = ephemeral(eph_config(pki, tmp_path, port), auto_reconnect=True)
    connecting = Call(lambda: eph.connect(timeout=WAIT_S))
    wait_until(lambda: eph.status()["failed_attempts"] >= 1, "a failed dial")
    assert not connecting.done
    hub_for(pki, hub_dir, start, port=port)
    connecting.value(WAIT_S)
    msg_id = eph.publish("temps", "test.Reading", {})
    assert stored_ids(hub_dir, "temps") == [msg_id]


@pytest.mark.parametrize("capacity", [1, 3])
def test_full_buffer_raises_at_once(
    pki: PKI, start: Starter, hub_and_client: HubAndClient, capacity: int
) -> None:
    hub_dir, hub, eph = hub_and_client(send_buffer_messages=capacity, auto_reconnect=True)
    port = hub_port(hub)
    eph.publish("temps", "test.Reading", {"n": 0})
    hub.close()
    wait_until(lambda: eph.status()["connected"] is False, "the client to see the hub go")

    queued: list[Call] = []
    for n in range(1, capacity + 1):
        publish = functools.partial(eph.publish, "temps", "test.Reading", {"n": n})
        queued.append(Call(publish))
        time.sleep(0.2)  # keep the queue order deterministic
    time.sleep(0.2)
    for q in queued:
        assert not q.done, f"publishes within capacity wait in the buffer: {q.error!r}"
    overflow = Call(lambda: eph.publish("temps", "test.Reading", {"n": -1})).wait(PROMPT_S)
    assert isinstance(overflow.error, BufferFullError), overflow.error
    assert overflow.elapsed() < AT_ONCE_S, "a full buffer is an immediate error"
    with pytest.raises(BufferFullError):  # a batch counts as one publish and is refused too
        bounded(lambda: eph.publish_batch("temps", [("test.Reading", {"n": -2})]))
    assert not any(q.done for q in queued)

    # The queued ones still go through once the hub is back; the refused ones never do.
    hub_for(pki, hub_dir, start, port=port)
    for q in queued:
        q.value(WAIT_S)
    assert [m.payload["n"] for m in stored(hub_dir, "temps")] == list(range(capacity + 1))
    # Room again.
    eph.publish("temps", "test.Reading", {"n": 99})


def test_close_fails_pending_publishes(hub_and_client: HubAndClient) -> None:
    _hub_dir, hub, eph = hub_and_client(auto_reconnect=True)
    hub.close()
    wait_until(lambda: eph.status()["connected"] is False, "the client to see the hub go")
    pending = [Call(lambda: eph.publish("temps", "test.Reading", {})) for _ in range(3)]
    time.sleep(0.3)
    assert not any(p.done for p in pending)

    bounded(eph.close)
    for p in pending:
        p.wait(PROMPT_S)
        assert isinstance(p.error, ConnectionLostError), p.error
    bounded(eph.close)  # idempotent
    with pytest.raises(ClosedError):
        bounded(lambda: eph.publish("temps", "test.Reading", {}))
    with pytest.raises(ClosedError):
        eph.status()


def test_close_interrupts_a_waiting_connect(
    pki: PKI, tmp_path: Path, ephemeral: EphStarter
) -> None:
    eph = ephemeral(eph_config(pki, tmp_path, free_port()), auto_reconnect=True)
    connecting = Call(lambda: eph.connect(timeout=WAIT_S))
    wait_until(lambda: eph.status()["failed_attempts"] >= 1, "a failed dial")
    bounded(eph.close)
    connecting.wait(PROMPT_S)
    assert isinstance(connecting.error, ConnectionLostError), connecting.error


def test_connect_timeout_is_honoured(pki: PKI, tmp_path: Path, ephemeral: EphStarter) -> None:
    eph = ephemeral(eph_config(pki, tmp_path, free_port()), auto_reconnect=True)
    call = Call(lambda: eph.connect(timeout=0.5)).wait(PROMPT_S)
    assert isinstance(call.error, KeyopTimeoutError), call.error
    assert 0.4 <= call.elapsed() < 3.0


def test_context_manager_connects_and_closes(pki: PKI, tmp_path: Path, start: Starter) -> None:
    hub_dir = tmp_path / "hub"
    hub = hub_for(pki, hub_dir, start)
    cfg = eph_config(pki, tmp_path, hub_port(hub))
    with EphemeralMessenger(cfg) as eph:
        assert eph.status()["connected"] is True
        wait_peers(hub, "node1")
        msg_id = eph.publish("temps", "test.Reading", {})
    assert stored_ids(hub_dir, "temps") == [msg_id]
    with pytest.raises(ClosedError):  # closed on exit: no method answers any more
        eph.status()
    wait_peers(hub)
    eph.close()  # closing again is fine

    # An exception in the block still closes the connection.
    with pytest.raises(RuntimeError, match="inside"), EphemeralMessenger(cfg) as eph2:
        wait_peers(hub, "node1")
        raise RuntimeError("inside")
    wait_peers(hub)
    with pytest.raises(ClosedError):
        eph2.status()

    # Entering with the hub down raises from connect().
    down = eph_config(pki, tmp_path, free_port())
    with pytest.raises(ConnectionLostError):
        bounded(lambda: EphemeralMessenger(down).__enter__())


def test_config_file_path_is_accepted(
    pki: PKI, tmp_path: Path, start: Starter, ephemeral: EphStarter
) -> None:
    hub_dir = tmp_path / "hub"
    hub = hub_for(pki, hub_dir, start)
    tls = tls_section(pki, "node1")
    path = tmp_path / "eph.yaml"
    path.write_text(
        "name: node1\n"
        f"storage:\n  data_dir: {tmp_path / 'node1-unused'}\n"
        "client:\n"
        "  enabled: true\n"
        f"  hubs:\n    - addr: 127.0.0.1:{hub_port(hub)}\n"
        f"tls:\n  cert: {tls['cert']}\n  key: {tls['key']}\n  ca: {tls['ca']}\n"
    )
    eph = ephemeral(path)
    eph.connect()
    msg_id = eph.publish("temps", "test.Reading", {})
    assert stored_ids(hub_dir, "temps") == [msg_id]
    assert not (tmp_path / "node1-unused").exists()


# ---------------------------------------------------------------------------
# Validation and rejection
# ---------------------------------------------------------------------------


def test_invalid_channel_and_payload_type(hub_and_client: HubAndClient) -> None:
    hub_dir, _hub, eph = hub_and_client(connect=False)
    # Names are checked before anything else, connected or not.
    for bad in ("", "a/b", "..", "x.dead-letter", "sp ace"):
        with pytest.raises(InvalidNameError):
            eph.publish(bad, "test.Reading", {})
        with pytest.raises(InvalidNameError):
            eph.publish_batch(bad, [("test.Reading", {})])
    for bad in ("", "a/b", ".."):
        with pytest.raises(InvalidNameError):
            eph.subscribe(bad, Inbox())

    eph.register_payload_type("test.Reading", Reading)
    with pytest.raises(PayloadTypeError):
        eph.register_payload_type("test.Reading", Reading)
    eph.connect()
    with pytest.raises(PayloadTypeError):
        eph.publish("temps", "test.Reading", {"n": 1})
    with pytest.raises(PayloadTypeError):
        eph.publish_batch("temps", [("test.Reading", Reading(1)), ("test.Reading", "nope")])
    with pytest.raises(PayloadTypeError):
        eph.publish("temps", "test.Other", object())  # not JSON-encodable
    assert stored_ids(hub_dir, "temps") == [], "nothing of a refused batch was sent"

    msg_id = eph.publish("temps", "test.Reading", Reading(7, "K"))
    (m,) = read_channel(hub_dir, "temps")
    assert (m.message.id, m.message.payload) == (msg_id, {"n": 7, "unit": "K"})
    assert eph.status()["connected"] is True, "refused publishes do not hurt the link"


def test_publish_outside_the_peer_policy_is_not_stored(
    pki: PKI, tmp_path: Path, start: Starter, ephemeral: EphStarter
) -> None:
    """The hub drops records outside ``allowed_peers[].publish``; the publish
    must not hang and the link stays usable."""
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    eph = ephemeral(eph_config(pki, tmp_path, hub_port(hub)))
    eph.connect()
    call = Call(lambda: eph.publish("secret", "test.Reading", {})).wait(PROMPT_S)
    assert call.error is None or isinstance(call.error, KeyopError), call.error
    allowed = eph.publish("temps", "test.Reading", {})
    assert stored_ids(hub_dir, "secret") == []
    assert stored_ids(hub_dir, "temps") == [allowed]


def test_unknown_peer_is_rejected(
    pki: PKI, tmp_path: Path, ephemeral: EphStarter, hub_and_client: HubAndClient
) -> None:
    hub_dir, hub, eph = hub_and_client(name="intruder", connect=False)
    call = Call(eph.connect).wait(PROMPT_S)
    assert isinstance(call.error, ConnectionLostError), call.error
    assert "reject" in str(call.error).lower(), str(call.error)
    assert hub_status(hub)["peers"] == []
    with pytest.raises(ConnectionLostError):
        bounded(lambda: eph.publish("temps", "test.Reading", {}))
    assert stored_ids(hub_dir, "temps") == []

    # A certificate from an untrusted CA (CN node1, allow-listed) never connects,
    # and the error says which certificate the hub refused.
    foreign = ephemeral(eph_config(pki, tmp_path, hub_port(hub), cert_name="foreign"))
    call = Call(foreign.connect).wait(PROMPT_S)
    assert isinstance(call.error, ConnectionLostError), call.error
    assert "the hub refused this instance's certificate" in str(call.error), str(call.error)
    assert hub_status(hub)["peers"] == []
    # Trusting another CA than the hub's: the hub's certificate is the one refused.
    doc = eph_config(pki, tmp_path, hub_port(hub)).to_dict()
    doc["tls"]["ca"] = str(pki.foreign_ca)
    wrong_ca = ephemeral(Config.from_dict(doc))
    call = Call(wrong_ca.connect).wait(PROMPT_S)
    assert isinstance(call.error, ConnectionLostError), call.error
    assert "the hub's certificate is not signed by this instance's tls.ca" in str(call.error)


def test_subscribe_to_a_channel_the_client_does_not_receive_is_refused(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """Not asked for when connecting (not in client.hubs[0].subscribe), or
    refused by the hub's allowlist: an error at subscribe(), not a handler
    that is never called."""
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1", subscribe=["news"])]))
    cfg = eph_config(pki, tmp_path, hub_port(hub), subscribe=["news", "secret"])
    with EphemeralMessenger(cfg) as eph:
        eph.subscribe("news", lambda msg: None)
        with pytest.raises(SubscriptionError, match="not in the subscribe list of hub"):
            eph.subscribe("other", lambda msg: None)
        with pytest.raises(PolicyError, match="will not deliver channel 'secret'"):
            eph.subscribe("secret", lambda msg: None)
        assert eph.status()["refused_subscriptions"] == ["secret"]


def test_two_ephemeral_clients_with_one_name_coexist(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """Spark tasks share one config: ephemeral connections of the same peer
    must not replace each other (only durable ones do, for their cursors)."""
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1")]))
    cfg = client_config(pki, tmp_path / "unused", "node1", hub_port(hub))
    with EphemeralMessenger(cfg) as a, EphemeralMessenger(cfg) as b:
        ids = []
        for i in range(5):
            ids.append(a.publish("two", "t", {"a": i}))
            ids.append(b.publish("two", "t", {"b": i}))
        assert a.status()["connected"] and b.status()["connected"]
    assert sorted(stored_ids(tmp_path / "hub", "two")) == sorted(ids)


# ---------------------------------------------------------------------------
# Weak spot 5: every write to the connection goes through one lock
# ---------------------------------------------------------------------------


def blob_payload(rng: random.Random, **fields: Any) -> dict[str, Any]:
    """A payload of random size (up to 64 KiB) carrying its own digest."""
    blob = rng.randbytes(rng.randint(0, 32 * 1024)).hex()
    return {**fields, "blob": blob, "sha": hashlib.sha256(blob.encode()).hexdigest()}


def intact(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and hashlib.sha256(payload["blob"].encode()).hexdigest() == payload["sha"]
    )


def test_concurrent_publishes_deliveries_and_acks_keep_the_stream_intact(
    hub_and_client: HubAndClient,
) -> None:
    """The original ephemeral client wrote frames without the connection write
    lock, racing the acknowledgements of received frames (concurrent WebSocket
    writes corrupt the stream). Here four threads publish frames of up to
    64 KiB while the hub streams batches the client acknowledges and a handler
    publishes replies: every message must arrive intact both ways, and the one
    connection must never drop (no reconnect, no peer_disconnected)."""
    hub_dir, hub, eph = hub_and_client(subscribe=["cmds"], connect=False)
    inbox = Inbox()
    replies: list[str] = []

    def reply_to_some(msg: Any) -> None:
        if msg.payload["n"] % 10 == 0:
            replies.append(eph.publish("replies", "test.Reply", {"to": msg.id}))

    eph.subscribe("cmds", inbox)
    eph.subscribe("cmds", reply_to_some)
    eph.connect()
    wait_peers(hub, "node1")

    threads, per_thread, from_hub = 4, 60, 400
    published: dict[int, list[str]] = {}

    def client_worker(t: int) -> None:
        rng = random.Random(t)
        published[t] = [
            eph.publish("temps", "test.Blob", blob_payload(rng, t=t, i=i))
            for i in range(per_thread)
        ]

    def hub_worker() -> list[str]:
        rng = random.Random("hub")
        return [hub.publish("cmds", "test.Blob", blob_payload(rng, n=n)) for n in range(from_hub)]

    calls = [Call(functools.partial(client_worker, t)) for t in range(threads)]
    hub_call = Call(hub_worker)
    for c in [*calls, hub_call]:
        c.wait(WAIT_S * 4)
        assert c.error is None, (
            f"every publish returns, acknowledged over the one connection: {c.error!r}"
        )
    hub_ids = hub_call.result

    on_hub = stored(hub_dir, "temps")
    assert sorted(m.id for m in on_hub) == sorted(i for ids in published.values() for i in ids), (
        "every client publish is stored on the hub exactly once"
    )
    assert all(intact(m.payload) for m in on_hub), "every stored payload is intact"
    got = inbox.wait_count(from_hub, "hub messages at the client")
    wait_stable(lambda: len(inbox.messages), "the client's inbox", quiet=0.3)
    assert [m.id for m in inbox.messages] == hub_ids, "every hub message arrives once, in order"
    assert all(intact(m.payload) for m in got), "every delivered payload is intact"
    wait_until(lambda: len(replies) == from_hub // 10, "the handler's replies")
    assert sorted(stored_ids(hub_dir, "replies")) == sorted(replies), "every reply is stored"

    status = eph.status()
    assert (status["connected"], status["reconnects"], status["failed_attempts"]) == (
        True,
        0,
        0,
    ), f"the one connection never dropped: {status}"
    assert audit_events(hub_dir, "peer_disconnected") == [], (
        "the hub never saw the connection fail (a corrupt frame ends it)"
    )


def test_frames_stay_within_the_hubs_message_limit(hub_and_client: HubAndClient) -> None:
    """Weak spot 18 of 1.4: a frame over the hub's WebSocket limit costs the
    connection and every publish merged into it. A batch that cannot fit one
    frame is refused before it is sent; concurrent big publishes are merged
    only up to max_batch_bytes, the rest carried to the next frame, and all
    are acknowledged."""
    hub_dir, _hub, eph = hub_and_client()
    big = {"b": "x" * (5 * 2**20)}  # three of these exceed one frame's limit
    with pytest.raises(MessageTooLargeError):
        eph.publish_batch("temps", [("t", big)] * 3)
    assert eph.status()["connected"], "the refused batch was never sent"

    # Six 3 MiB publishes at once: merged frames would pass the limit.
    ids: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: ids.append(eph.publish("temps", "t", {"b": "y" * 3 * 2**20}))
        )
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(ids) == 6, "every concurrent publish was acknowledged"
    assert sorted(stored_ids(hub_dir, "temps")) == sorted(ids)
    assert eph.status()["reconnects"] == 0, "the connection never dropped"
