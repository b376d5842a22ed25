"""keyop_messenger.aio: AsyncMessenger and AsyncEphemeralMessenger under asyncio.run.

No pytest asyncio plugin: every test is a sync test running its own
``asyncio.run(...)``. Waits are bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import PKI, Starter, client_config, hub_config, hub_port, peer, stored_ids
from keyop_messenger import ClosedError, Config, Message, Messenger, context, read_channel
from keyop_messenger.aio import AsyncEphemeralMessenger, AsyncMessenger, AsyncSubscription

pki = fed_helpers.pki
start = fed_helpers.start

#: Bound on every wait of these tests.
WAIT_S = 15.0


def make_config(tmp_path: Path, **subscribers: Any) -> Config:
    return Config.from_dict(
        {
            "name": "aio-node",
            "storage": {"data_dir": str(tmp_path / "data")},
            "subscribers": subscribers,
        }
    )


def lock_is_free(config: Config) -> bool:
    """True if a new messenger can open the data directory."""
    try:
        Messenger(config).close()
    except Exception:
        return False
    return True


def test_publish_and_subscribe_on_the_callers_loop(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> tuple[list[str], list[str], set[int], int]:
        received: list[str] = []
        threads: set[int] = set()
        done = asyncio.Event()

        async def handler(msg: Message) -> None:
            threads.add(threading.get_ident())
            await asyncio.sleep(0)  # really a coroutine on the loop
            received.append(msg.id)
            if len(received) == 12:
                done.set()

        async with AsyncMessenger(config) as m:
            sub = await m.subscribe("temps", "recorder", handler)
            assert sub.subscriber_id == "recorder" and sub.active
            ids = [await m.publish("temps", "t.Reading", {"i": i}) for i in range(2)]
            ids += await asyncio.gather(
                *(m.publish("temps", "t.Reading", {"i": i}) for i in range(2, 7))
            )
            ids += await m.publish_batch("temps", [("t.Reading", {"i": i}) for i in range(7, 12)])
            await asyncio.wait_for(done.wait(), WAIT_S)
            await sub.close()
            assert not sub.active
        return ids, received, threads, threading.get_ident()

    ids, received, threads, loop_thread = asyncio.run(main())
    assert len(ids) == 12 and len(set(ids)) == 12
    assert sorted(received) == sorted(ids)
    assert threads == {loop_thread}, "handlers must run on the caller's event loop"
    stored = [e.message.id for e in read_channel(tmp_path / "data", "temps")]
    assert sorted(stored) == sorted(ids)
    assert lock_is_free(config)


def test_registered_payload_types_and_context(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    class Reading(dict):  # type: ignore[type-arg]
        pass

    async def main() -> Message:
        got: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        async def handler(msg: Message) -> None:
            if not got.done():
                got.set_result(msg)

        m = AsyncMessenger(config)
        m.register_payload_type("t.Reading", dict)  # before open: applied on open
        async with m:
            await m.subscribe("c", "s", handler)
            with context(service_name="svc", correlation_id="corr-1"):
                await m.publish("c", "t.Reading", {"x": 1})
            return await asyncio.wait_for(got, WAIT_S)

    msg = asyncio.run(main())
    assert msg.payload == {"x": 1}
    assert (msg.service_name, msg.correlation_id) == ("svc", "corr-1")


def test_raising_async_handler_is_retried(tmp_path: Path) -> None:
    config = make_config(tmp_path, max_retries=5)

    async def main() -> tuple[int, int, int]:
        attempts = 0
        done = asyncio.Event()

        async def flaky(msg: Message) -> None:
            nonlocal attempts
            attempts += 1
            if attempts < 3:
                raise RuntimeError("not yet")
            done.set()

        async with AsyncMessenger(config) as m:
            sub = await m.subscribe("jobs", "worker", flaky)
            await m.publish("jobs", "t.Job", {"n": 1})
            await asyncio.wait_for(done.wait(), WAIT_S)
            deadline = time.monotonic() + WAIT_S
            end = m.messenger.stream_end("jobs")
            while sub.position != end and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return attempts, sub.position or 0, end

    attempts, position, end = asyncio.run(main())
    assert attempts == 3
    assert position == end, "the message is acknowledged once the handler succeeded"
    assert stored_ids(tmp_path / "data", "jobs.dead-letter") == []


def test_handler_always_raising_is_dead_lettered(tmp_path: Path) -> None:
    config = make_config(tmp_path, max_retries=1)

    async def main() -> str:
        async def broken(msg: Message) -> None:
            raise ValueError("boom")

        async with AsyncMessenger(config) as m:
            await m.subscribe("jobs", "worker", broken)
            msg_id = await m.publish("jobs", "t.Job", {"n": 1})
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                if list(m.messenger.read_channel("jobs.dead-letter")):
                    break
                await asyncio.sleep(0.05)
            return msg_id

    msg_id = asyncio.run(main())
    [dead] = [e.message for e in read_channel(tmp_path / "data", "jobs.dead-letter")]
    assert dead.payload["original"]["id"] == msg_id
    assert "ValueError: boom" in dead.payload["last_error"]


def test_async_with_closes_on_exception_and_on_cancellation(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def failing() -> AsyncMessenger:
        m = AsyncMessenger(config)
        with pytest.raises(KeyError):
            async with m:
                await m.publish("c", "t", 1)
                raise KeyError("leave the block")
        return m

    m = asyncio.run(failing())
    assert m.closed and lock_is_free(config)

    async def cancelled() -> tuple[AsyncMessenger, bool]:
        m = AsyncMessenger(config)
        entered = asyncio.Event()

        async def body() -> None:
            async with m:
                await m.subscribe("c", "s", _noop)
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(body())
        await asyncio.wait_for(entered.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return m, m.closed

    m, closed = asyncio.run(cancelled())
    assert closed and lock_is_free(config)

    async def use_after_close() -> None:
        with pytest.raises(ClosedError):
            await m.publish("c", "t", 1)
        await m.close()  # idempotent

    asyncio.run(use_after_close())


def test_cancelled_open_leaves_nothing_open(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> None:
        m = AsyncMessenger(config)
        task = asyncio.create_task(m.open())
        await asyncio.sleep(0)  # the open is on the pool now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await m.close()

    asyncio.run(main())
    assert lock_is_free(config)


async def _noop(msg: Message) -> None:
    return None


def test_cancelling_publishes_does_not_break_the_messenger(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> tuple[list[str], list[str]]:
        async with AsyncMessenger(config, max_workers=2) as m:
            tasks = [asyncio.create_task(m.publish("c", "t.N", {"i": i})) for i in range(40)]
            await asyncio.sleep(0.001)
            for task in tasks[::2]:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            acked = [r for r in results if isinstance(r, str)]
            assert all(isinstance(r, (str, asyncio.CancelledError)) for r in results), results
            after = await m.publish("c", "t.N", {"i": "after"})
            more = await m.publish_batch("c", [("t.N", {"i": "batch"})] * 3)
            return acked, [after, *more]

    acked, later = asyncio.run(main())
    stored = stored_ids(tmp_path / "data", "c")
    assert len(stored) == len(set(stored)), "no record is written twice"
    assert set(acked) | set(later) <= set(stored), "every acknowledged id is stored"
    assert stored[-4:] == later
    # Cancelled ones were either never made or committed all the same (at-least-once).
    assert len(acked) + 4 <= len(stored) <= 44
    assert lock_is_free(config)


def test_close_from_inside_a_handler_does_not_deadlock(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> bool:
        closed = asyncio.Event()
        m = AsyncMessenger(config)

        async def handler(msg: Message) -> None:
            await m.close()
            closed.set()

        async with m:
            await m.subscribe("c", "s", handler)
            await m.publish("c", "t", 1)
            await asyncio.wait_for(closed.wait(), WAIT_S)
        return m.closed

    assert asyncio.run(main())
    deadline = time.monotonic() + WAIT_S
    while not lock_is_free(config):  # closing finishes on the pool
        assert time.monotonic() < deadline, "the data directory stayed locked"
        time.sleep(0.05)


def test_subscription_close_from_inside_its_handler(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> list[Any]:
        seen: list[Any] = []
        holder: dict[str, Any] = {}
        first = asyncio.Event()

        async def handler(msg: Message) -> None:
            seen.append(msg.payload)
            await holder["sub"].close()
            first.set()

        async with AsyncMessenger(config) as m:
            holder["sub"] = sub = await m.subscribe("c", "s", handler)
            await m.publish_batch("c", [("t", 1), ("t", 2), ("t", 3)])
            await asyncio.wait_for(first.wait(), WAIT_S)
            await asyncio.sleep(0.3)
            assert not sub.active
            return seen

    seen = asyncio.run(main())
    assert seen == [1], "no message is handed over after close()"
    # The subscriber resumes at message 2 next time.
    with Messenger(config) as m:
        got: list[Any] = []
        event = threading.Event()

        def handler(msg: Message) -> None:
            got.append(msg.payload)
            if len(got) == 2:
                event.set()

        m.subscribe("c", "s", handler)
        assert event.wait(WAIT_S)
        assert got == [2, 3]


def test_closed_event_loop_leaves_the_message_unacknowledged(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> tuple[AsyncMessenger, AsyncSubscription]:
        m = AsyncMessenger(config)
        await m.open()
        sub = await m.subscribe("c", "s", _noop)
        return m, sub  # returned without close(): the loop ends, the messenger stays open

    am, sub = asyncio.run(main())
    sync = am.messenger
    try:
        msg_id = sync.publish("c", "t", "kept")
        deadline = time.monotonic() + WAIT_S
        while sub.active:  # the bridge notices the closed loop and stops the subscription
            assert time.monotonic() < deadline, "the subscription kept running"
            time.sleep(0.02)
        path = tmp_path / "data" / "subscribers" / "c" / "s.offset"
        assert int(path.read_text()) == 0, "nothing acknowledged without a handler run"
        assert stored_ids(tmp_path / "data", "c.dead-letter") == []
    finally:
        sync.close()
    with Messenger(config) as m:
        got: list[str] = []
        event = threading.Event()

        def handler(msg: Message) -> None:
            got.append(msg.id)
            event.set()

        m.subscribe("c", "s", handler)
        assert event.wait(WAIT_S)
        assert got == [msg_id], "delivered again on the next subscribe"


def test_subscription_stopped_by_its_loop_ending_frees_its_id(tmp_path: Path) -> None:
    config = make_config(tmp_path)

    async def main() -> tuple[AsyncMessenger, AsyncSubscription]:
        m = AsyncMessenger(config)
        await m.open()
        return m, await m.subscribe("c", "s", _noop)  # the loop ends without close()

    am, sub = asyncio.run(main())
    sync = am.messenger
    try:
        msg_id = sync.publish("c", "t", "after the loop")
        deadline = time.monotonic() + WAIT_S
        while sub.active:
            assert time.monotonic() < deadline, "the subscription kept running"
            time.sleep(0.02)
        got: list[str] = []
        event = threading.Event()

        def handler(msg: Message) -> None:
            got.append(msg.id)
            event.set()

        # Same messenger, same id: the stopped subscription must not keep it registered.
        sync.subscribe("c", "s", handler)
        assert event.wait(WAIT_S), "the new subscription of the same id got nothing"
        assert got == [msg_id]
    finally:
        sync.close()


def test_loop_ending_mid_handler_neither_acknowledges_nor_dead_letters(tmp_path: Path) -> None:
    config = make_config(tmp_path, max_retries=0)  # a failure would dead-letter at once
    started = threading.Event()

    async def slow(msg: Message) -> None:
        started.set()
        await asyncio.sleep(3600)

    async def main() -> tuple[AsyncMessenger, AsyncSubscription, str]:
        m = AsyncMessenger(config)
        await m.open()
        sub = await m.subscribe("c", "s", slow)
        msg_id = await m.publish("c", "t", "kept")
        while not started.is_set():
            await asyncio.sleep(0.01)
        return m, sub, msg_id  # asyncio.run now cancels the running handler

    am, sub, msg_id = asyncio.run(main())
    sync = am.messenger
    try:
        deadline = time.monotonic() + WAIT_S
        while sub.active:
            assert time.monotonic() < deadline, "the subscription kept running"
            time.sleep(0.02)
        time.sleep(0.3)
        path = tmp_path / "data" / "subscribers" / "c" / "s.offset"
        assert int(path.read_text()) == 0
        assert stored_ids(tmp_path / "data", "c.dead-letter") == []
    finally:
        sync.close()
    with Messenger(config) as m:
        event = threading.Event()
        got: list[str] = []

        def handler(msg: Message) -> None:
            got.append(msg.id)
            event.set()

        m.subscribe("c", "s", handler)
        assert event.wait(WAIT_S)
        assert got == [msg_id]


# ---------------------------------------------------------------------------
# AsyncEphemeralMessenger against a hub
# ---------------------------------------------------------------------------


def test_ephemeral_publish_and_live_subscribe(pki: PKI, tmp_path: Path, start: Starter) -> None:
    hub = start(
        hub_config(pki, tmp_path / "hub", [peer("node1", subscribe=["news"], publish=["up"])])
    )
    hub_dir = tmp_path / "hub"
    config = client_config(
        pki, tmp_path / "unused", "node1", hub_port(hub), subscribe=["news"], publish=["up"]
    )

    async def main() -> tuple[list[str], list[str], list[str], set[int], int]:
        received: list[str] = []
        threads: set[int] = set()
        got = asyncio.Event()

        async def handler(msg: Message) -> None:
            threads.add(threading.get_ident())
            received.append(msg.id)
            got.set()

        async with AsyncEphemeralMessenger(config) as m:
            await m.subscribe("news", handler)
            ids = [await m.publish("up", "t.Up", {"i": 0})]
            ids += await m.publish_batch("up", [("t.Up", {"i": 1}), ("t.Up", {"i": 2})])
            # Live only: publish on the hub until one arrives (the hub starts
            # the ephemeral reader at the end once the handshake is done).
            hub_ids: list[str] = []
            deadline = time.monotonic() + WAIT_S
            while not got.is_set():
                assert time.monotonic() < deadline, "no live message reached the handler"
                hub_ids.append(hub.publish("news", "t.News", {"n": len(hub_ids)}))
                try:
                    await asyncio.wait_for(got.wait(), 0.3)
                except asyncio.TimeoutError:
                    pass
        return ids, received, hub_ids, threads, threading.get_ident()

    ids, received, hub_ids, threads, loop_thread = asyncio.run(main())
    assert stored_ids(hub_dir, "up") == ids, "acknowledged only once stored by the hub"
    assert received and set(received) <= set(hub_ids)
    assert threads == {loop_thread}
    assert not (hub_dir / "subscribers" / "news" / "fed-node1.offset").exists()
