"""Corner cases of keyop_messenger.aio: handlers raising TimeoutError or
CancelledError, exit with a handler left running, two event loops at once,
garbage collection, calls after close, re-entrant unsubscribe, cancelled
ephemeral publishes, stream stops, pickling.

No pytest asyncio plugin: every test runs its own ``asyncio.run(...)``; every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
import keyop_messenger as km
from fed_helpers import PKI, Starter, client_config, hub_config, hub_port, peer, stored_ids
from keyop_messenger import ClosedError, Config, Message, Messenger, read_channel
from keyop_messenger.aio import AsyncEphemeralMessenger, AsyncMessenger

pki = fed_helpers.pki
start = fed_helpers.start

#: Bound on every wait of these tests.
WAIT_S = 15.0


def make_config(tmp_path: Path, **subscribers: Any) -> Config:
    return Config.from_dict(
        {
            "name": "aio-corners",
            "storage": {"data_dir": str(tmp_path / "data")},
            "subscribers": subscribers,
        }
    )


def count(tmp_path: Path, channel: str) -> int:
    try:
        return sum(1 for _ in read_channel(tmp_path / "data", channel))
    except km.ChannelNotFoundError:
        return 0


async def wait_for_count(tmp_path: Path, channel: str, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while count(tmp_path, channel) < n:
        assert time.monotonic() < deadline, f"{channel}: fewer than {n} records"
        await asyncio.sleep(0.02)


def lock_is_free(config: Config) -> bool:
    try:
        Messenger(config).close()
    except km.DataDirLockedError:
        return False
    return True


# -- handlers raising TimeoutError / CancelledError ------------------------------


def _raise_builtin(msg: Message) -> None:
    raise TimeoutError("upstream timed out")


def _raise_keyop(msg: Message) -> None:
    raise km.KeyopTimeoutError("hub flush timed out")


def _raise_asyncio(msg: Message) -> None:
    raise asyncio.TimeoutError("asyncio.timeout expired")


@pytest.mark.parametrize("raising", [_raise_builtin, _raise_keyop, _raise_asyncio])
@pytest.mark.parametrize("is_async", [True, False], ids=["async", "plain"])
def test_handler_raising_timeout_error_is_retried_then_dead_lettered(
    tmp_path: Path, raising: Callable[[Message], None], is_async: bool
) -> None:
    """The handler's own TimeoutError is a failure like any other (it used to
    be taken for the bridge's poll timeout: the subscription spun forever)."""
    calls: list[str] = []

    def plain(msg: Message) -> None:
        calls.append(msg.id)
        raising(msg)

    async def handler(msg: Message) -> None:
        await asyncio.sleep(0)
        plain(msg)

    async def main() -> bool:
        async with AsyncMessenger(make_config(tmp_path, max_retries=1)) as m:
            sub = await m.subscribe(
                "jobs", "w", handler if is_async else plain, backoff=(0.01, 0.01)
            )
            await m.publish("jobs", "t.Job", {"n": 1})
            await wait_for_count(tmp_path, "jobs.dead-letter", 1)
            return sub.active

    assert asyncio.run(main())
    assert len(calls) == 2  # the first call and one retry


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
def test_cancelled_error_from_an_awaited_task_is_a_handler_failure(tmp_path: Path) -> None:
    """A CancelledError raised in a handler whose own task was not cancelled
    (it awaited a task something else cancelled) is retried and dead-lettered;
    the subscription goes on with the next message."""
    seen: list[int] = []

    async def handler(msg: Message) -> None:
        seen.append(msg.payload["n"])
        if msg.payload["n"] == 1:
            shared = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
            asyncio.get_running_loop().call_soon(shared.cancel)
            await shared

    async def main() -> bool:
        async with AsyncMessenger(make_config(tmp_path, max_retries=1)) as m:
            sub = await m.subscribe("jobs", "w", handler, backoff=(0.01, 0.01))
            await m.publish("jobs", "t.Job", {"n": 1})
            await wait_for_count(tmp_path, "jobs.dead-letter", 1)
            await m.publish("jobs", "t.Job", {"n": 2})
            deadline = time.monotonic() + WAIT_S
            while 2 not in seen:
                assert time.monotonic() < deadline, "the next message was not delivered"
                await asyncio.sleep(0.02)
            return sub.active

    assert asyncio.run(main())
    assert seen == [1, 1, 2]
    dead = [e.message.payload for e in read_channel(tmp_path / "data", "jobs.dead-letter")]
    assert "HandlerCancelledError" in dead[0]["last_error"]


# -- interpreter exit with an async handler left running ---------------------------

_EXIT_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import keyop_messenger as km

    async def main(data_dir, seconds):
        m = km.AsyncMessenger({"name": "exit", "storage": {"data_dir": data_dir}})
        await m.open()
        started = asyncio.Event()

        async def handler(msg):
            started.set()
            await asyncio.sleep(seconds)

        await m.subscribe("ch", "s", handler)
        await m.publish("ch", "t", 1)
        await started.wait()
        await m.close(timeout=0.05)  # leaves the handler running

    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
    """
)


def test_exit_after_close_left_an_async_handler_running_does_not_abort(tmp_path: Path) -> None:
    """The engine thread waiting for the handler must not be inside Python when
    the interpreter finalizes (that aborted: 'Fatal Python error:
    PyGILState_Release'). Runs the scenario in several processes at once."""
    script = tmp_path / "exit_scenario.py"
    script.write_text(_EXIT_SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"d{i}"), seconds],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i, seconds in enumerate(["3600", "0.3"] * 4)
    ]
    try:
        outcomes = [(p.wait(timeout=60), p.stdout.read().decode() if p.stdout else "")
                    for p in procs]  # fmt: skip
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
    failed = [out for code, out in outcomes if code != 0]
    assert not failed, failed[0]


# -- one messenger, two event loops ---------------------------------------------------


def test_two_event_loops_publish_at_once(tmp_path: Path) -> None:
    """Each loop gets its own completer: a publish of one loop is never left
    waiting because another loop published (it hung)."""
    config = make_config(tmp_path)
    m = AsyncMessenger(config)
    asyncio.run(m.open())
    barrier = threading.Barrier(2, timeout=WAIT_S)
    results: dict[str, int] = {}
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        async def go() -> None:
            barrier.wait()
            n = 0
            for i in range(200):
                await asyncio.wait_for(m.publish(name, "t", i), WAIT_S)
                n += 1
            results[name] = n

        try:
            asyncio.run(go())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"ch{k}",)) for k in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WAIT_S)
        assert not any(t.is_alive() for t in threads)
    finally:
        asyncio.run(m.close())
    assert not errors, errors
    assert results == {"ch0": 200, "ch1": 200}
    assert count(tmp_path, "ch0") == count(tmp_path, "ch1") == 200


# -- garbage collection ------------------------------------------------------------


def test_dropped_unclosed_messenger_with_a_subscription_releases_its_directory(
    tmp_path: Path,
) -> None:
    """As for a sync Messenger: nothing the engine holds (the handler bridge)
    keeps a dropped AsyncMessenger, hence its data directory, alive."""
    config = make_config(tmp_path)

    async def main() -> bool:
        m = AsyncMessenger(config)
        await m.open()
        await m.publish("ch", "t", 1)
        await m.subscribe("ch", "s", lambda msg: None)
        del m
        deadline = time.monotonic() + WAIT_S
        while True:  # the engine's threads end on their own once it is dropped
            gc.collect()
            if lock_is_free(config):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)

    assert asyncio.run(main())


# -- calls after close --------------------------------------------------------------


def test_subscription_calls_after_close_raise_closed_error(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncMessenger(make_config(tmp_path)) as m:
            await m.publish("ch", "t", 1)
            own = await m.subscribe("ch", "a", lambda msg: None)
            await own.close()
            with pytest.raises(ClosedError):
                await own.seek("earliest")
            other = await m.subscribe("ch", "b", lambda msg: None)
        with pytest.raises(ClosedError):
            await other.seek("earliest")
        await other.close()  # idempotent, no error
        with pytest.raises(ClosedError):
            await m.publish("ch", "t", 2)

    asyncio.run(main())


# -- unsubscribe from the subscription's own handler --------------------------------


def test_unsubscribe_from_its_own_handler_does_not_wait_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As the sync unsubscribe called in its handler: it does not wait for the
    handler (it used to stall it for the 10 s close timeout, with a WARNING)."""
    outcome: list[object] = []

    async def main() -> bool:
        async with AsyncMessenger(make_config(tmp_path)) as m:
            done = asyncio.Event()

            async def handler(msg: Message) -> None:
                try:
                    await m.unsubscribe("ch", "s")
                    outcome.append("returned")
                except BaseException as exc:
                    outcome.append(exc)
                done.set()

            sub = await m.subscribe("ch", "s", handler)
            await m.publish("ch", "t", 1)
            # Less than the 10 s the engine would wait for the handler.
            await asyncio.wait_for(done.wait(), 8)
            return sub.active

    caplog.set_level(logging.WARNING, logger="keyop_messenger")
    assert asyncio.run(main()) is False
    assert outcome == ["returned"]
    assert not (tmp_path / "data" / "subscribers" / "ch" / "s.offset").exists()
    assert not [r for r in caplog.records if "did not return" in r.getMessage()]


def test_a_task_a_handler_spawned_is_not_the_handler(tmp_path: Path) -> None:
    """A task spawned by a handler inherits its context but is not the
    handler: its close() waits until the directory is released (it returned
    at once, as a handler's must), and its unsubscribe of the handler's own
    subscription, after the handler returned, is done."""
    results: list[object] = []

    async def main() -> None:
        m = AsyncMessenger(make_config(tmp_path))
        await m.open()
        spawned: list[asyncio.Task[None]] = []

        async def later() -> None:
            await m.unsubscribe("ch", "s")
            results.append("unsubscribed")
            await m.close()
            # Released once close() returns: another messenger may open it.
            with Messenger(make_config(tmp_path)):
                results.append("reopened")

        async def handler(msg: Message) -> None:
            spawned.append(asyncio.create_task(later()))

        await m.subscribe("ch", "s", handler)
        await m.publish("ch", "t", 1)
        for _ in range(int(WAIT_S / 0.02)):
            if spawned:
                break
            await asyncio.sleep(0.02)
        await asyncio.wait_for(spawned[0], WAIT_S)

    asyncio.run(main())
    assert results == ["unsubscribed", "reopened"]
    assert not (tmp_path / "data" / "subscribers" / "ch" / "s.offset").exists()


# -- ephemeral publish cancelled while queued ------------------------------------


def test_cancelled_ephemeral_publish_is_still_made(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """As documented for publish: cancelling stops the wait, not the publish,
    also for one still queued for a pool thread."""
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1", publish=["up"])]))
    config = client_config(pki, tmp_path / "unused", "node1", hub_port(hub), publish=["up"])

    async def main() -> None:
        async with AsyncEphemeralMessenger(config, max_workers=1) as m:
            await m.publish("up", "t.Up", {"i": -1})
            tasks = [asyncio.create_task(m.publish("up", "t.Up", {"i": i})) for i in range(20)]
            await asyncio.sleep(0)  # every publish started (queued on the one thread)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await m.flush(WAIT_S)  # queued behind them on the same thread

    asyncio.run(asyncio.wait_for(main(), 2 * WAIT_S))
    assert len(stored_ids(tmp_path / "hub", "up")) == 21


# -- messages(): a normal stop is no handler failure ------------------------------


def test_break_out_of_messages_logs_no_handler_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> list[int]:
        got: list[int] = []
        async with AsyncMessenger(make_config(tmp_path)) as m:
            await m.publish_batch("jobs", [("t.Job", {"n": i}) for i in range(50)])
            for _ in range(5):  # each round takes one, leaves the next pending
                async with m.messages("jobs", "w", start="earliest") as stream:
                    async for msg in stream:
                        got.append(msg.payload["n"])
                        break
        return got

    caplog.set_level(logging.WARNING, logger="keyop_messenger")
    assert asyncio.run(asyncio.wait_for(main(), WAIT_S)) == [0, 1, 2, 3, 4]
    assert not [r for r in caplog.records if "handler failed" in r.getMessage()]


# -- pickling -------------------------------------------------------------------


def test_async_objects_refuse_pickling_naming_their_class(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncMessenger(make_config(tmp_path)) as m:
            sub = await m.subscribe("ch", "s", lambda msg: None)
            stream = m.messages("ch", "q")
            for obj in (m, sub, stream):
                with pytest.raises(TypeError, match=type(obj).__name__):
                    pickle.dumps(obj)
            await stream.aclose()

    asyncio.run(main())
