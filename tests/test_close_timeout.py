"""Bounded close and exit: a handler that never returns does not hang
``close()``, ``Subscription.close()``, ``AsyncMessenger.aclose()`` or the
interpreter's exit; Ctrl-C during a close is honoured; the unfinished
message stays unacknowledged (delivered again next time) and the data stays
valid. The ephemeral client's connect and publish are bounded too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import FAST_RECONNECT, PKI, Starter, free_port, hub_config, peer, tls_section
from keyop_messenger import (
    Config,
    ConnectionLostError,
    EphemeralMessenger,
    KeyopTimeoutError,
    Message,
    Messenger,
    read_channel,
)
from keyop_messenger.aio import AsyncMessenger

pki = fed_helpers.pki
start = fed_helpers.start

#: Bound on anything that must not hang (far above what it needs).
BOUND_S = 60.0


def bounded(fn: Callable[[], Any], bound: float = BOUND_S) -> Any:
    """Runs ``fn`` in a thread; fails the test if it does not return in ``bound``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"{fn} did not return within {bound}s (hung)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


class Stuck:
    """A handler that blocks on its first message until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.ids: list[str] = []

    def __call__(self, msg: Message) -> None:
        self.ids.append(msg.id)
        self.entered.set()
        self.release.wait()


def warnings_about(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and all(w in r.getMessage() for w in words)
    ]


@pytest.fixture
def stuck() -> Iterator[Stuck]:
    s = Stuck()
    yield s
    s.release.set()  # lets the abandoned thread end


def test_close_returns_when_a_handler_never_does(
    config: Config, stuck: Stuck, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    m = Messenger(config)
    m.subscribe("temps", "slow-sub", stuck)
    first = m.publish("temps", "test.Reading", {"n": 0})
    assert stuck.entered.wait(BOUND_S)
    bounded(lambda: m.close(timeout=0.5))
    assert warnings_about(caplog, "slow-sub", "temps"), caplog.text

    # The directory is released and valid; the unfinished message is
    # delivered again to the id's next subscription.
    again: list[str] = []
    got = threading.Event()
    with Messenger(config) as m2:
        m2.subscribe("temps", "slow-sub", lambda msg: (again.append(msg.id), got.set()))
        assert got.wait(BOUND_S)
        # The abandoned handler returning now changes nothing on disk.
        stuck.release.set()
        second = m2.publish("temps", "test.Reading", {"n": 1})
        deadline = time.monotonic() + BOUND_S
        while len(again) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert again == [first, second]
    assert [e.message.id for e in read_channel(config.storage.data_dir, "temps")] == [
        first,
        second,
    ]


def test_subscription_close_is_bounded(
    config: Config, stuck: Stuck, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with Messenger(config) as m:
        sub = m.subscribe("temps", "slow-sub", stuck)
        first = m.publish("temps", "test.Reading", {})
        assert stuck.entered.wait(BOUND_S)
        bounded(lambda: sub.close(timeout=0.3))
        assert warnings_about(caplog, "slow-sub", "temps"), caplog.text
        again = threading.Event()
        seen: list[str] = []
        m.subscribe("temps", "slow-sub", lambda msg: (seen.append(msg.id), again.set()))
        assert again.wait(BOUND_S)
        assert seen[0] == first
        stuck.release.set()
        bounded(lambda: m.close(timeout=5))


async def stuck_async_handler(config: Config, subscriber_id: str) -> AsyncMessenger:
    """An open AsyncMessenger whose subscriber ``subscriber_id`` of ``temps``
    is inside a handler that never returns."""
    entered = asyncio.Event()
    forever = asyncio.Event()

    async def handler(msg: Message) -> None:
        entered.set()
        await forever.wait()

    am = AsyncMessenger(config)
    await am.open()
    await am.subscribe("temps", subscriber_id, handler)
    await am.publish("temps", "test.Reading", {})
    await asyncio.wait_for(entered.wait(), BOUND_S)
    return am


def test_async_aclose_is_bounded(config: Config, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        am = await stuck_async_handler(config, "slow-async")
        await asyncio.wait_for(am.aclose(timeout=0.3), BOUND_S)

    bounded(lambda: asyncio.run(main()))
    assert warnings_about(caplog, "slow-async", "temps"), caplog.text


def test_async_close_cancelled_stops_waiting_and_still_releases(config: Config) -> None:
    """Cancelling the task awaiting ``close(timeout=600)`` (what Ctrl-C under
    ``asyncio.run`` does) makes the close stop waiting for the stuck handler:
    the cancellation arrives long before the timeout, and the close has
    flushed and released the directory by then."""

    async def main() -> float:
        am = await stuck_async_handler(config, "stuck")
        closing = asyncio.ensure_future(am.close(timeout=600))
        await asyncio.sleep(0.3)  # inside close, waiting for the handler
        began = time.monotonic()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        return time.monotonic() - began

    took = bounded(lambda: asyncio.run(main()))
    assert took < BOUND_S, took
    with Messenger(config) as m:  # released, and the message is delivered again
        got: list[Message] = []
        m.subscribe("temps", "stuck", got.append)
        deadline = time.monotonic() + BOUND_S
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(got) == 1


STUCK_SCRIPT = """
import logging, sys, threading
from keyop_messenger import Config, Messenger

logging.basicConfig(level=logging.WARNING)  # the warning naming the stuck handler

mode = sys.argv[2]
m = Messenger(Config.from_dict({"name": "n", "storage": {"data_dir": sys.argv[1]}}))
entered = threading.Event()
def handler(msg):
    entered.set()
    threading.Event().wait()  # never returns
m.subscribe("temps", "stuck", handler)
m.publish("temps", "test.Reading", {})
entered.wait()
if mode == "close":
    m.close(timeout=0.5)
elif mode == "sigint":
    print("closing", flush=True)
    m.close(timeout=600)
print("main done", flush=True)
"""


def run_script(data: Path, mode: str) -> subprocess.Popen[str]:
    """Starts STUCK_SCRIPT with Ctrl-C (SIGINT) delivered as a terminal
    would, even when pytest runs in a background job that ignores it."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-c", STUCK_SCRIPT, str(data), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("mode", ["close", "no-close"])
def test_exit_does_not_hang_on_a_stuck_handler(tmp_path: Path, mode: str) -> None:
    """After its main code ends the interpreter exits (without close, the
    exit's close waits its default 10 s for the handler, then goes on)."""
    proc = run_script(tmp_path / "data", mode)
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "main done" in out
    assert "stuck" in err and "temps" in err, err  # the warning naming it
    assert len(list(read_channel(tmp_path / "data", "temps"))) == 1


def test_ctrl_c_during_close(tmp_path: Path) -> None:
    proc = run_script(tmp_path / "data", "sigint")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "closing"
        time.sleep(0.3)  # inside close(), waiting for the handler
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "KeyboardInterrupt" in err, err
    # The close still finished: the directory is released and valid.
    with Messenger(
        Config.from_dict({"name": "n", "storage": {"data_dir": str(tmp_path / "data")}})
    ) as m:
        assert len(list(m.read_channel("temps"))) == 1


# ---------------------------------------------------------------------------
# Ephemeral client: bounded connect and publish
# ---------------------------------------------------------------------------


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


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 that accepts and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        done.set()
        t.join(5)
        for c in held:
            c.close()
        srv.close()


@pytest.mark.parametrize("auto_reconnect", [False, True])
def test_connect_to_a_silent_listener_times_out(
    pki: PKI, tmp_path: Path, silent_listener: int, auto_reconnect: bool
) -> None:
    eph = EphemeralMessenger(eph_config(pki, tmp_path, silent_listener),
                             auto_reconnect=auto_reconnect)
    try:
        with pytest.raises(KeyopTimeoutError, match="within"):
            bounded(lambda: eph.connect(timeout=0.5))
        if auto_reconnect:  # the publish waits for a connection, bounded
            with pytest.raises(KeyopTimeoutError) as info:
                bounded(lambda: eph.publish("temps", "test.Reading", {}, timeout=0.5))
            assert isinstance(info.value, TimeoutError)
        else:  # no connection and none coming: at once
            with pytest.raises(ConnectionLostError, match="within"):
                bounded(lambda: eph.publish("temps", "test.Reading", {}, timeout=0.5))
    finally:
        bounded(eph.close)


def test_connect_with_auto_reconnect_to_a_down_hub_times_out(pki: PKI, tmp_path: Path) -> None:
    eph = EphemeralMessenger(eph_config(pki, tmp_path, free_port()), auto_reconnect=True)
    try:
        with pytest.raises(KeyopTimeoutError, match="still dialing"):
            bounded(lambda: eph.connect(timeout=0.5))
    finally:
        bounded(eph.close)


def test_publish_while_the_hub_is_down_times_out(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """auto_reconnect: a publish waiting for a hub that went away raises
    KeyopTimeoutError after its timeout, and is not sent later."""
    port = free_port()
    hub_dir = tmp_path / "hub"
    hub_cfg = hub_config(pki, hub_dir, [peer("node1", publish=["temps"])], port=port)
    hub = start(hub_cfg)
    eph = EphemeralMessenger(eph_config(pki, tmp_path, port), auto_reconnect=True)
    try:
        eph.connect(timeout=BOUND_S)
        first = eph.publish("temps", "test.Reading", {"n": 0})
        hub.close()
        deadline = time.monotonic() + BOUND_S
        while eph.status()["connected"] and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(KeyopTimeoutError):
            bounded(lambda: eph.publish("temps", "test.Reading", {"n": 1}, timeout=0.5))
        # The hub comes back: the timed-out publish is not sent after all.
        hub = start(hub_cfg)
        deadline = time.monotonic() + BOUND_S
        while not eph.status()["connected"] and time.monotonic() < deadline:
            time.sleep(0.02)
        last = eph.publish("temps", "test.Reading", {"n": 2}, timeout=BOUND_S)
    finally:
        bounded(eph.close)
    hub.close()
    assert [e.message.id for e in read_channel(hub_dir, "temps")] == [first, last]


# -- a second close, and bad timeouts ------------------------------------------


def test_a_second_close_returns_once_the_first_has_released_the_directory(
    tmp_path: Path,
) -> None:
    """close() from another thread while one is waiting for a slow handler
    returns only once the data directory is free (reopening works at once)."""
    cfg = {"name": "twice", "storage": {"data_dir": str(tmp_path / "data")}}
    m = Messenger(cfg)
    started = threading.Event()

    def slow(msg: Message) -> None:
        started.set()
        time.sleep(1.0)

    m.subscribe("c", "s", slow)
    m.publish("c", "t", 1)
    assert started.wait(BOUND_S)
    first = threading.Thread(target=m.close)
    first.start()
    time.sleep(0.2)  # the first close is waiting for the handler
    bounded(m.close)
    Messenger(cfg).close()  # not DataDirLockedError
    first.join(BOUND_S)


def test_a_close_after_a_handler_closed_waits_for_that_close(tmp_path: Path) -> None:
    """A handler closes its AsyncMessenger (which starts the close and returns);
    leaving ``async with`` then returns once the directory is released."""
    cfg = {"name": "inner", "storage": {"data_dir": str(tmp_path / "data")}}

    async def main() -> None:
        closed = asyncio.Event()
        async with AsyncMessenger(cfg) as am:

            async def closer(msg: Message) -> None:
                await am.close()
                closed.set()

            await am.subscribe("k", "s", closer)
            await am.publish("k", "t", 1)
            await asyncio.wait_for(closed.wait(), BOUND_S)
        async with AsyncMessenger(cfg):  # not DataDirLockedError
            pass

    asyncio.run(asyncio.wait_for(main(), BOUND_S))


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf")])
def test_close_with_a_bad_timeout_raises_and_closes_nothing(
    tmp_path: Path, timeout: float
) -> None:
    cfg = {"name": "bad", "storage": {"data_dir": str(tmp_path / "data")}}
    m = Messenger(cfg)
    got: list[Any] = []
    sub = m.subscribe("c", "s", lambda msg: got.append(msg.payload))
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        sub.close(timeout)
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        m.close(timeout)
    assert not m.closed
    m.publish("c", "t", 1)
    fed_helpers.wait_until(lambda: got == [1], "delivered after the refused closes")
    m.close()
    Messenger(cfg).close()  # released by the real close

    async def main() -> None:
        am = AsyncMessenger(cfg)
        await am.open()
        with pytest.raises(ValueError, match="timeout must be a finite number"):
            await am.close(timeout)
        assert not am.closed
        await am.publish("c", "t", 2)
        await am.close()

    asyncio.run(asyncio.wait_for(main(), BOUND_S))
    Messenger(cfg).close()
