"""Fork safety: objects opened before ``os.fork()`` belong to the parent.

In a forked child an inherited Messenger / EphemeralMessenger /
AsyncMessenger raises :class:`ForkedProcessError` on every call, and its
``close()`` (explicit, at exit or by garbage collection) releases nothing and
touches no file. The parent loses nothing and its segments stay valid; the
child does not keep the parent's data-directory lock alive; message ids stay
unique across the processes (the random generator is reseeded in the child).

Covered with ``os.fork`` and with multiprocessing's ``fork`` start method
(the PySpark case is in test_fork_spark.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import make_config
from keyop_messenger import (
    Config,
    DataDirLockedError,
    EphemeralMessenger,
    ForkedProcessError,
    Messenger,
    read_channel,
)
from keyop_messenger.aio import AsyncMessenger

#: Bound on a child's life (it only does a few quick calls).
CHILD_S = 60.0


def in_child(fn: Callable[[], Any]) -> tuple[int, Callable[[], Any]]:
    """Forks; the child runs ``fn`` and sends back its result (or the repr
    of its exception) through a pipe, then leaves with ``os._exit``. Returns
    the child's pid and a function that waits (bounded) for the result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            try:
                out: Any = ("ok", fn())
            except BaseException as exc:
                out = ("error", f"{type(exc).__name__}: {exc}")
            with os.fdopen(w, "wb") as f:
                pickle.dump(out, f)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)

    def result() -> Any:
        deadline = time.monotonic() + CHILD_S
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child did not finish within {CHILD_S}s (hung)")
        with os.fdopen(r, "rb") as f:
            data = f.read()
        assert os.waitstatus_to_exitcode(status) == 0, f"child exit status {status}"
        kind, value = pickle.loads(data)
        if kind == "error":
            pytest.fail(f"the child failed: {value}")
        return value

    return pid, result


def records_on_disk(data_dir: Path, channel: str) -> list[dict[str, Any]]:
    """Every line of every segment of ``channel``, each parsed as JSON (a
    torn or interleaved line makes this fail)."""
    out = []
    for seg in sorted((data_dir / "channels" / channel).glob("*.jsonl")):
        data = seg.read_bytes()
        assert data == b"" or data.endswith(b"\n"), f"{seg} ends in a partial line"
        out.extend(json.loads(line) for line in data.splitlines())
    return out


def forked_error(call: Callable[[], Any]) -> str:
    """The ForkedProcessError text ``call`` raises (fails if it does not)."""
    try:
        result = call()
        if hasattr(result, "__next__"):
            next(result)
    except ForkedProcessError as exc:
        return str(exc)
    raise AssertionError(f"{call} did not raise ForkedProcessError")


def test_inherited_messenger_refuses_every_call_and_loses_nothing(
    tmp_path: Path, config: Config
) -> None:
    m = Messenger(config)
    before = [m.publish("temps", "test.Reading", {"n": i}) for i in range(5)]
    m.subscribe("temps", "rec", lambda msg: None)
    parent_pid = os.getpid()

    def child() -> dict[str, Any]:
        texts = [
            forked_error(lambda: m.publish("temps", "test.Reading", {"child": 1})),
            forked_error(lambda: m.publish_batch("temps", [("test.Reading", {"child": 2})])),
            forked_error(lambda: m.read_channel("temps")),
            forked_error(lambda: m.stream_end("temps")),
            forked_error(m.stats),
            forked_error(m.compact),
            forked_error(lambda: m.subscribe("temps", "child-sub", lambda msg: None)),
            forked_error(lambda: m.unsubscribe("temps", "rec")),
        ]
        m.close()  # releases nothing, raises nothing
        m.close()
        return {"texts": texts, "pid": os.getpid()}

    _pid, result = in_child(child)
    # The parent keeps publishing while the child runs.
    during = [m.publish("temps", "test.Reading", {"n": 100 + i}) for i in range(50)]
    got = result()
    after = [m.publish("temps", "test.Reading", {"n": 200 + i}) for i in range(5)]
    m.close()

    for text in got["texts"]:
        assert f"opened in process {parent_pid}" in text, text
        assert f"this is process {got['pid']}" in text, text
        assert "open a new one in the child" in text, text
    acked = before + during + after
    assert [e.message.id for e in read_channel(config.storage.data_dir, "temps")] == acked
    assert [r["id"] for r in records_on_disk(Path(config.storage.data_dir), "temps")] == acked


CHILD_EXIT_SCRIPT = """
import gc, json, os, sys
from pathlib import Path
from keyop_messenger import Config, Messenger

data = Path(sys.argv[1])
m = Messenger(Config.from_dict({"name": "n", "storage": {"data_dir": str(data)}}))
m.subscribe("temps", "rec", lambda msg: None)
first = m.publish("temps", "test.Reading", {"n": 0})
segs = lambda: {p.name: p.stat().st_size for p in (data / "channels" / "temps").iterdir()}
before = segs()
pid = os.fork()
if pid == 0:
    del m  # the engine is dropped here: no join, no flush, no unlock
    gc.collect()
    sys.exit(0)  # the interpreter's exit (atexit) runs as usual
_, status = os.waitpid(pid, 0)
after = segs()
second = m.publish("temps", "test.Reading", {"n": 1})
m.close()
print(json.dumps({"status": status, "same": before == after, "ids": [first, second]}))
"""


def test_child_exit_and_gc_touch_nothing(tmp_path: Path) -> None:
    """A child that drops the inherited messenger (with a subscriber
    running) and exits normally neither waits for the parent's threads nor
    flushes, truncates or unlocks the parent's files."""
    data = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_EXIT_SCRIPT, str(data)],
        capture_output=True,
        text=True,
        timeout=CHILD_S,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == 0 and out["same"], out
    assert [e.message.id for e in read_channel(data, "temps")] == out["ids"]


def test_child_does_not_keep_the_parents_lock(tmp_path: Path, config: Config) -> None:
    """flock locks belong to the open file: a child's inherited descriptor
    would hold the parent's lock after the parent closed. It must not."""
    m = Messenger(config)
    m.publish("temps", "test.Reading", {})
    go_r, go_w = os.pipe()

    def child() -> bool:
        os.close(go_w)
        os.read(go_r, 1)  # waits until the parent has closed and reopened
        return True

    _pid, result = in_child(child)
    os.close(go_r)
    try:
        m.close()
        reopened = Messenger(config)  # DataDirLockedError if the child kept the lock
        reopened.publish("temps", "test.Reading", {})
        reopened.close()
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
    assert result() is True


def test_new_messenger_in_the_child(tmp_path: Path, config: Config) -> None:
    m = Messenger(config)
    other = make_config(tmp_path / "child")

    def child() -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            Messenger(config)
        except DataDirLockedError as exc:
            out["same_dir"] = type(exc).__name__
        with Messenger(other) as mine:
            out["ids"] = [mine.publish("temps", "test.Reading", {"n": i}) for i in range(3)]
        return out

    _pid, result = in_child(child)
    got = result()
    m.close()
    assert got["same_dir"] == "DataDirLockedError"
    assert [e.message.id for e in read_channel(other.storage.data_dir, "temps")] == got["ids"]


def test_ids_are_unique_across_a_fork(tmp_path: Path, config: Config) -> None:
    """The child's copy of the parent's random generator must not repeat the
    parent's numbers: both the ids and their random parts are disjoint."""
    m = Messenger(config)
    m.publish("temps", "test.Reading", {})  # the generator is in use before the fork
    other = make_config(tmp_path / "child")

    def child() -> list[str]:
        with Messenger(other) as mine:
            return [mine.publish("temps", "test.Reading", {"n": i}) for i in range(200)]

    _pid, result = in_child(child)
    mine = [m.publish("temps", "test.Reading", {"n": i}) for i in range(200)]
    theirs = result()
    m.close()
    assert not set(mine) & set(theirs)
    # "tttttttt-tttt-7rrr-rrrr-rrrrrrrrrrrr": everything after the version
    # digit comes from the counter seed and the generator.
    assert not {i[15:] for i in mine} & {i[15:] for i in theirs}


def _mp_child(m: Messenger, other: Config, q: Any) -> None:
    out: dict[str, Any] = {}
    try:
        m.publish("temps", "test.Reading", {"child": True})
        out["inherited"] = "published"
    except ForkedProcessError as exc:
        out["inherited"] = str(exc)
    m.close()
    with Messenger(other) as mine:
        out["ids"] = [mine.publish("temps", "test.Reading", {"n": i}) for i in range(3)]
    q.put(out)


def test_multiprocessing_fork_start_method(tmp_path: Path, config: Config) -> None:
    ctx = multiprocessing.get_context("fork")
    m = Messenger(config)
    first = m.publish("temps", "test.Reading", {})
    other = make_config(tmp_path / "child")
    q = ctx.Queue()
    proc = ctx.Process(target=_mp_child, args=(m, other, q))
    proc.start()
    try:
        out = q.get(timeout=CHILD_S)
        proc.join(CHILD_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    second = m.publish("temps", "test.Reading", {})
    m.close()
    assert "open a new one in the child" in out["inherited"]
    assert [e.message.id for e in read_channel(config.storage.data_dir, "temps")] == [
        first,
        second,
    ]
    assert [e.message.id for e in read_channel(other.storage.data_dir, "temps")] == out["ids"]


def test_inherited_async_messenger_refuses(tmp_path: Path, config: Config) -> None:
    am = AsyncMessenger(config)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(am.open())
        first = loop.run_until_complete(am.publish("temps", "test.Reading", {}))

        def child() -> str:
            # A fresh loop: the parent's is not usable in the child either.
            inner = asyncio.new_event_loop()
            try:
                text = forked_error(
                    lambda: inner.run_until_complete(am.publish("temps", "test.Reading", {}))
                )
                inner.run_until_complete(am.close())  # releases nothing
                inner.run_until_complete(am.aclose())
                return text
            finally:
                inner.close()

        _pid, result = in_child(child)
        text = result()
        second = loop.run_until_complete(am.publish("temps", "test.Reading", {}))
        loop.run_until_complete(am.close())
    finally:
        loop.close()
    assert "open a new one in the child" in text
    assert [e.message.id for e in read_channel(config.storage.data_dir, "temps")] == [
        first,
        second,
    ]


def test_inherited_ephemeral_messenger_refuses(tmp_path: Path) -> None:
    """Without a hub: connect in the child raises ForkedProcessError (not a
    connection error), and close there is a no-op."""
    from fed_helpers import free_port, make_pki, tls_section

    pki = make_pki(tmp_path / "pki")
    cfg = Config.from_dict(
        {
            "name": "node1",
            "storage": {"data_dir": str(tmp_path / "unused")},
            "client": {"enabled": True, "hubs": [{"addr": f"127.0.0.1:{free_port()}"}]},
            "tls": tls_section(pki, "node1"),
        }
    )
    eph = EphemeralMessenger(cfg)

    def child() -> list[str]:
        texts = [
            forked_error(lambda: eph.connect(timeout=1)),
            forked_error(lambda: eph.publish("temps", "test.Reading", {})),
        ]
        eph.close()
        return texts

    _pid, result = in_child(child)
    texts = result()
    eph.close()
    for text in texts:
        assert "open a new one in the child" in text, text


def test_fork_while_a_subscriber_delivers(tmp_path: Path, config: Config) -> None:
    """A fork while engine threads run: the child's close and exit do not
    wait for threads it does not have (they would never end)."""
    m = Messenger(config)
    seen: list[str] = []
    m.subscribe("temps", "rec", lambda msg: seen.append(msg.id))
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            m.publish("temps", "test.Reading", {})

    t = threading.Thread(target=pump)
    t.start()
    try:

        def child() -> bool:
            m.close()
            gc.collect()
            return True

        _pid, result = in_child(child)
        assert result() is True
    finally:
        stop.set()
        t.join(CHILD_S)
    m.close()
    records = records_on_disk(Path(config.storage.data_dir), "temps")
    assert len({r["id"] for r in records}) == len(records)
