"""Ctrl-C during a blocking durable publish, and publishes that do not block:
``publish(..., wait=False)`` receipts and asyncio futures completed per commit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import keyop_messenger as km
from keyop_messenger import Messenger, read_channel

# The injected fdatasync stall; a publish that waited for it would take this long.
STALL_MS = 20_000
# Far below the stall: the interrupt did not wait for the fdatasync.
BOUND_S = 5.0

CHILD = textwrap.dedent(
    """
    import sys, time
    import keyop_messenger as km

    m = km.Messenger({"name": "n", "storage": {"data_dir": sys.argv[1]}})
    m.publish("temps", "t", {"n": 0})
    m._engine._inject_fault("temps", "sync", count=1, delay_ms=int(sys.argv[2]))
    print("publishing", flush=True)
    started = time.monotonic()
    try:
        if sys.argv[3] == "batch":
            m.publish_batch("temps", [("t", {"n": 1})])
        else:
            m.publish("temps", "t", {"n": 1})
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - started:.3f}", flush=True)
    m.close()
    print("closed", flush=True)
    """
)


def config(data_dir: Path, **storage: object) -> dict[str, object]:
    return {"name": "n", "storage": {"data_dir": str(data_dir), **storage}}


@pytest.mark.parametrize("call", ["publish", "batch"])
def test_ctrl_c_during_a_durable_publish_stalled_in_fdatasync(tmp_path: Path, call: str) -> None:
    data = tmp_path / "data"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data), str(STALL_MS), call],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A shell's background job starts with SIGINT ignored; the child must not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "publishing"
        time.sleep(0.5)  # inside publish(), the commit stalled in fdatasync
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().strip()
        noticed = time.monotonic() - sent
        out, err = proc.communicate(timeout=STALL_MS / 1000 + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert line.startswith("interrupted after"), (line, err)
    assert noticed < BOUND_S, f"Ctrl-C took {noticed:.1f}s (the stall is {STALL_MS} ms)"
    # close() waited for the stalled commit: the data is valid, and the
    # interrupted message (never acknowledged) was committed after all.
    assert "closed" in out, err
    rows = [e.message.payload for e in read_channel(data, "temps")]
    assert rows == [{"n": 0}, {"n": 1}]


def test_main_and_other_threads_publish_the_same_records(tmp_path: Path) -> None:
    # The main thread's durable publish goes through the committer thread,
    # other threads commit inline: both give committed, ordered records.
    with Messenger(config(tmp_path / "d")) as m:
        ids = [m.publish("c", "t", {"i": i}) for i in range(20)]

        def other() -> None:
            ids.extend(m.publish("c", "t", {"i": 20 + i}) for i in range(20))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        got = list(m.read_channel("c"))
    assert [e.message.id for e in got] == ids
    assert [e.message.payload["i"] for e in got] == list(range(40))


def test_a_failed_commit_from_the_main_thread_raises_storage_error(tmp_path: Path) -> None:
    with Messenger(config(tmp_path / "d")) as m:
        m.publish("c", "t", {"i": 0})
        m._engine._inject_fault("c", "sync", count=1)
        with pytest.raises(km.StorageError):
            m.publish("c", "t", {"i": 1})
        m.publish("c", "t", {"i": 2})
        assert [e.message.payload["i"] for e in m.read_channel("c")] == [0, 2]


@pytest.mark.parametrize("sync_interval_ms", [0, 20])
def test_receipts_resolve_to_committed_ids_in_order(
    tmp_path: Path, sync_interval_ms: int
) -> None:
    with Messenger(config(tmp_path / "d", sync_interval_ms=sync_interval_ms)) as m:
        receipts = [m.publish("c", "t", {"i": i}, wait=False) for i in range(500)]
        assert all(isinstance(r, km.Receipt) for r in receipts)
        ids = [r.wait(timeout=30) for r in receipts]
        assert ids == [r.id for r in receipts]
        assert all(r.done() for r in receipts)
        got = list(m.read_channel("c"))
    assert [e.message.id for e in got] == ids
    assert [e.message.payload["i"] for e in got] == list(range(500))


def test_pipelined_publishes_share_fdatasyncs(tmp_path: Path) -> None:
    with Messenger(config(tmp_path / "d")) as m:
        m.publish("c", "t", {})
        before = m._engine._counters("c")
        receipts = [m.publish("c", "t", {"i": i}, wait=False) for i in range(2000)]
        for r in receipts:
            r.wait()
        after = m._engine._counters("c")
    records = after["records"] - before["records"]
    fsyncs = after["fsyncs"] - before["fsyncs"]
    assert records == 2000
    assert fsyncs < records / 2, (records, fsyncs)


def test_a_receipt_of_a_failed_commit_raises_and_later_ones_commit(tmp_path: Path) -> None:
    with Messenger(config(tmp_path / "d")) as m:
        m.publish("c", "t", {"i": 0})
        m._engine._inject_fault("c", "sync", count=1, delay_ms=300)  # the next batch waits
        syncs = m._engine._counters("c")["fsyncs"]
        first = m.publish("c", "t", {"i": 1}, wait=False)
        deadline = time.monotonic() + 30
        while m._engine._counters("c")["fsyncs"] == syncs:  # first's batch is in fdatasync
            assert time.monotonic() < deadline, "the first batch never reached fdatasync"
            time.sleep(0.001)
        m._engine._inject_fault("c", "sync", count=1)  # the batch queued behind it fails
        second = m.publish("c", "t", {"i": 2}, wait=False)
        first.wait(timeout=30)
        with pytest.raises(km.StorageError):
            second.wait(timeout=30)
        third = m.publish("c", "t", {"i": 3}, wait=False)
        third.wait(timeout=30)
        assert [e.message.payload["i"] for e in m.read_channel("c")] == [0, 1, 3]


def test_receipt_wait_times_out_and_the_message_still_commits(tmp_path: Path) -> None:
    with Messenger(config(tmp_path / "d")) as m:
        m.publish("c", "t", {})
        m._engine._inject_fault("c", "sync", count=1, delay_ms=1500)
        r = m.publish("c", "t", {"late": True}, wait=False)
        with pytest.raises(km.KeyopTimeoutError, match=r.id):
            r.wait(timeout=0.05)
        assert not r.done()
        assert r.wait(timeout=30) == r.id
    assert [e.message.payload for e in read_channel(tmp_path / "d", "c")][-1] == {"late": True}


def test_receipts_after_close_and_bad_input_raise(tmp_path: Path) -> None:
    m = Messenger(config(tmp_path / "d"))
    with pytest.raises(km.InvalidNameError):
        m.publish("no such/channel", "t", {}, wait=False)
    pending = m.publish("c", "t", {}, wait=False)
    m.close()  # flushes what was handed over
    assert pending.wait(timeout=5) == pending.id
    with pytest.raises(km.ClosedError):
        m.publish("c", "t", {}, wait=False)
    assert len(list(read_channel(tmp_path / "d", "c"))) == 1


def test_close_ends_the_committer_thread(tmp_path: Path) -> None:
    tasks_before = set(os.listdir("/proc/self/task"))
    m = Messenger(config(tmp_path / "d"))
    m.publish("c", "t", {}, wait=False).wait()
    names = {
        Path(f"/proc/self/task/{t}/comm").read_text().strip()
        for t in os.listdir("/proc/self/task")
    }
    assert "keyop-commit" in names
    m.close()
    left = set(os.listdir("/proc/self/task")) - tasks_before
    comms = {Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in left}
    assert "keyop-commit" not in comms, comms


def test_asyncio_publishes_complete_per_commit(tmp_path: Path) -> None:
    calls: list[int] = []

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        real_add_reader = loop.add_reader

        def counting_add_reader(fd: Any, callback: Any, *args: Any) -> None:
            def counted(*a: Any) -> None:
                calls.append(1)
                callback(*a)

            real_add_reader(fd, counted, *args)

        loop.add_reader = counting_add_reader  # type: ignore[method-assign]
        async with km.AsyncMessenger(config(tmp_path / "d")) as am:
            await am.publish("c", "t", {"warm": True})
            calls.clear()

            async def task(k: int) -> list[str]:
                return [await am.publish("c", "t", {"k": k, "i": i}) for i in range(25)]

            results = await asyncio.gather(*(task(k) for k in range(16)))
            return [i for r in results for i in r]

    ids = asyncio.run(main())
    assert len(set(ids)) == 16 * 25
    got = [e.message.id for e in read_channel(tmp_path / "d", "c")][1:]
    assert sorted(got) == sorted(ids)
    # One wake-up of the loop per commit, not per message: 16 tasks share commits.
    assert 0 < len(calls) < len(ids) / 2, len(calls)


def test_asyncio_tasks_ready_together_share_one_commit(tmp_path: Path) -> None:
    rounds = 10
    channels = ("c", "b")  # 8 tasks on each

    async def main() -> tuple[list[str], list[dict[str, int]], list[dict[str, int]]]:
        async with km.AsyncMessenger(config(tmp_path / "d")) as am:
            for ch in channels:
                await am.publish(ch, "t", {"warm": True})
            engine = am._require()._engine  # type: ignore[attr-defined]
            before = [engine._counters(ch) for ch in channels]

            async def task(k: int) -> list[str]:
                ch = channels[k % 2]
                return [await am.publish(ch, "t", {"k": k, "i": i}) for i in range(rounds)]

            results = await asyncio.gather(*(task(k) for k in range(16)))
            after = [engine._counters(ch) for ch in channels]
            return [i for r in results for i in r], before, after

    ids, before, after = asyncio.run(main())
    assert len(set(ids)) == 16 * rounds
    got = [e.message.id for ch in channels for e in list(read_channel(tmp_path / "d", ch))[1:]]
    assert sorted(got) == sorted(ids)
    # The 16 tasks one commit wakes publish in one pass of the loop; their
    # commits start after it, so each round is one batch per channel
    # (without the hold the first task's message goes alone: about two
    # batches a round). A pause of the loop past the hold limit (50 ms) may
    # split one.
    for b, a in zip(before, after, strict=True):
        batches = a["batches"] - b["batches"]
        assert rounds <= batches <= rounds + 2, (batches, a)


def test_a_held_publish_commits_without_its_loop(tmp_path: Path) -> None:
    with km.Messenger(config(tmp_path / "d")) as m:
        loop = asyncio.new_event_loop()
        try:
            completer = km._core.Completer(loop)
            future = completer.publish(m, "c", "t", {"held": True})
            # The loop never runs again: neither the release nor the future's
            # completion happen, yet the message is committed within the limit.
            deadline = time.monotonic() + 15
            while not [e for e in read_channel(tmp_path / "d", "c")]:
                assert time.monotonic() < deadline, "a held message was never committed"
                time.sleep(0.01)
            # Once the loop runs again, the future completes with the id.
            msg_id = loop.run_until_complete(asyncio.wait_for(future, 15))
            assert [e.message.id for e in read_channel(tmp_path / "d", "c")] == [msg_id]
            completer.close()
        finally:
            loop.close()


def test_asyncio_close_completes_every_awaited_publish(tmp_path: Path) -> None:
    async def main() -> list[str]:
        am = km.AsyncMessenger(config(tmp_path / "d"))
        await am.open()
        await am.publish("c", "t", {"warm": True})
        am._require()._engine._inject_fault("c", "sync", count=1, delay_ms=300)  # type: ignore[attr-defined]
        pending = [asyncio.ensure_future(am.publish("c", "t", {"i": i})) for i in range(5)]
        await asyncio.sleep(0.05)  # handed over, the commit stalled
        await am.close()
        return await asyncio.wait_for(asyncio.gather(*pending), 10)

    ids = asyncio.run(main())
    assert [e.message.id for e in read_channel(tmp_path / "d", "c")][1:] == ids


def test_asyncio_publish_error_and_cancellation(tmp_path: Path) -> None:
    async def main() -> None:
        async with km.AsyncMessenger(config(tmp_path / "d")) as am:
            await am.publish("c", "t", {"i": 0})
            with pytest.raises(km.InvalidNameError):
                await am.publish("bad/name", "t", {})
            am._require()._engine._inject_fault("c", "sync", count=1)  # type: ignore[attr-defined]
            with pytest.raises(km.StorageError):
                await am.publish("c", "t", {"i": 1})
            am._require()._engine._inject_fault("c", "sync", count=1, delay_ms=300)  # type: ignore[attr-defined]
            task = asyncio.ensure_future(am.publish("c", "t", {"i": 2}))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await am.publish("c", "t", {"i": 3})  # after the stalled commit

    asyncio.run(main())
    # The cancelled publish was handed over before the cancellation: committed.
    assert [e.message.payload["i"] for e in read_channel(tmp_path / "d", "c")] == [0, 2, 3]
