"""Storage limits and faults seen from Python:

* segment files are a bounded pool (a quarter of ``RLIMIT_NOFILE``): a
  process limited to 128 descriptors publishes to 1,000 channels, reads
  them back, and its subscribers get everything, with the files open into
  the data directory staying under the pool's budget;
* the active segment unlinked or replaced under a running messenger is
  found before the next acknowledgement: the publish raises StorageError
  naming the file and what happened, and nothing acknowledged is lost;
* ``Messenger.close()`` leaves no descriptor into the data directory open
  (no garbage collection needed), with subscribers, federation off and on;
* EIO, EROFS and ENOSPC during a publish raise StorageError with the path
  and ``errno``, commit nothing, leave whole records only, and publishing
  resumes without a reopen; a read-only data directory fails at open.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from conftest import make_config
from fed_helpers import client_config, hub_config, hub_port, peer, wait_connected, wait_peers
from keyop_messenger import Message, Messenger, StorageError, read_channel

pki = fed_helpers.pki

WAIT_S = 30.0


def wait_until(pred: Any, what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def fds_into(directory: Path) -> list[str]:
    """Targets of this process's open descriptors that lie in ``directory``."""
    root = str(directory.resolve()) + os.sep
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(root):
            out.append(target)
    return out


def open_sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return n


def active_segment(data_dir: Path, channel: str) -> Path:
    return sorted((data_dir / "channels" / channel).glob("*.jsonl"))[-1]


def ids_on_disk(data_dir: Path, channel: str) -> list[str]:
    return [e.message.id for e in read_channel(data_dir, channel)]


# ---------------------------------------------------------------------------
# 1. Bounded open files: 1,000 channels under RLIMIT_NOFILE = 128
# ---------------------------------------------------------------------------

MANY_CHANNELS_CHILD = textwrap.dedent(
    r"""
    import json, os, resource, sys, time
    from keyop_messenger import Config, Messenger

    data_dir, channels, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    root = os.path.realpath(data_dir) + os.sep

    def open_into_data_dir():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                    n += 1
            except OSError:
                pass
        return n

    cfg = Config.from_dict({"name": "many", "storage": {"data_dir": data_dir}})
    m = Messenger(cfg)
    names = [f"ch-{i:04d}" for i in range(channels)]
    watched = names[::channels // 5]
    got = {c: [] for c in watched}
    subs = [m.subscribe(c, "watcher", lambda msg, c=c: got[c].append(msg.id)) for c in watched]
    acked = {c: [] for c in names}
    peak = 0
    for rnd in range(2):
        for i, c in enumerate(names):
            acked[c].append(m.publish(c, "t", {"c": c, "r": rnd}))
            if i % 50 == 0:
                peak = max(peak, open_into_data_dir())
    read_back = {c: [e.message.id for e in m.read_channel(c)] for c in names}
    peak = max(peak, open_into_data_dir())
    deadline = time.monotonic() + 60
    while any(len(got[c]) < 2 for c in watched) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Another round after the subscribers caught up and went idle.
    for c in watched:
        acked[c].append(m.publish(c, "t", {"c": c, "r": 2}))
    deadline = time.monotonic() + 60
    while any(len(got[c]) < 3 for c in watched) and time.monotonic() < deadline:
        time.sleep(0.05)
    peak = max(peak, open_into_data_dir())
    for s in subs:
        s.close()
    m.close()
    print(json.dumps({
        "missing": [c for c in names if read_back[c] != acked[c][:2]],
        "undelivered": {c: [i for i in acked[c] if i not in got[c]] for c in watched},
        "duplicates": {c: len(got[c]) - len(set(got[c])) for c in watched},
        "peak": peak, "after_close": open_into_data_dir(),
        "budget": max(8, limit // 4),
    }))
    """
)


@pytest.fixture(scope="module")
def many_channels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data_dir = tmp_path_factory.mktemp("many") / "data"
    proc = subprocess.run(
        [sys.executable, "-c", MANY_CHANNELS_CHILD, str(data_dir), "1000", "128"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-1000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_thousand_channels_under_128_descriptors(many_channels: dict[str, Any]) -> None:
    assert many_channels["missing"] == [], "channels whose records did not read back"
    assert all(not v for v in many_channels["undelivered"].values()), many_channels["undelivered"]
    assert all(n == 0 for n in many_channels["duplicates"].values())


def test_open_segment_files_stay_under_the_budget(many_channels: dict[str, Any]) -> None:
    # The pool's budget, plus the lock file and a file in use by a read or
    # a commit while it was evicted.
    assert 0 < many_channels["peak"] <= many_channels["budget"] + 4, many_channels
    assert many_channels["after_close"] == 0


# ---------------------------------------------------------------------------
# 2. The active segment unlinked or replaced under a running messenger
# ---------------------------------------------------------------------------


#: The active segment is checked at every commit in durable mode, at most
#: once per millisecond in relaxed mode (sync_interval_ms > 0).
CHECK_PAUSE_S = 0.01


@pytest.mark.parametrize("sync_ms", [0, 20])
def test_unlinked_active_segment_fails_the_next_publish_and_loses_nothing(
    tmp_path: Path, sync_ms: int
) -> None:
    cfg = make_config(tmp_path, sync_interval_ms=sync_ms)
    data_dir = tmp_path / "data"
    got: list[str] = []
    with Messenger(cfg) as m:
        sub = m.subscribe("ch", "s", lambda msg: got.append(msg.id))
        acked = [m.publish("ch", "t", {"i": i}) for i in range(3)]
        seg = active_segment(data_dir, "ch")
        seg.unlink()
        time.sleep(CHECK_PAUSE_S)
        with pytest.raises(StorageError) as info:
            m.publish("ch", "t", {"doomed": True})
        text = str(info.value)
        assert str(seg) in text and "unlinked" in text, text
        # The writer put back what was committed from its open descriptor;
        # publishing goes on.
        acked += [m.publish("ch", "t", {"i": i}) for i in range(3, 6)]
        wait_until(lambda: len(got) >= 6, "live delivery of the acknowledged records")
        sub.close()
    assert got == acked, "only acknowledged records were delivered, in order"
    assert ids_on_disk(data_dir, "ch") == acked
    with Messenger(cfg) as again:
        assert [e.message.id for e in again.read_channel("ch")] == acked
        acked.append(again.publish("ch", "t", {"after": "reopen"}))
        assert [e.message.id for e in again.read_channel("ch")] == acked


@pytest.mark.parametrize("sync_ms", [0, 20])
def test_replaced_active_segment_refuses_publishes_until_reopened(
    tmp_path: Path, sync_ms: int
) -> None:
    cfg = make_config(tmp_path, sync_interval_ms=sync_ms)
    data_dir = tmp_path / "data"
    with Messenger(cfg) as m:
        before = [m.publish("ch", "t", {"i": i}) for i in range(3)]
        seg = active_segment(data_dir, "ch")
        stranger = seg.with_name("stranger.tmp")
        shutil.copyfile(seg, stranger)  # same records, another inode
        os.replace(stranger, seg)
        time.sleep(CHECK_PAUSE_S)
        for _ in range(5):
            with pytest.raises(StorageError) as info:
                m.publish("ch", "t", {"doomed": True})
            text = str(info.value)
            assert str(seg) in text and "replaced" in text, text
        with pytest.raises(StorageError):
            m.publish_batch("ch", [("t", {"doomed": 1}), ("t", {"doomed": 2})])
        assert m.stream_end("ch") == seg.stat().st_size, "nothing was committed"
    # Nothing refused reached the file now at the path.
    assert ids_on_disk(data_dir, "ch") == before
    with Messenger(cfg) as again:
        after = again.publish("ch", "t", {"after": "reopen"})
        assert [e.message.id for e in again.read_channel("ch")] == [*before, after]


# ---------------------------------------------------------------------------
# 3. close() releases every descriptor into the data directory
# ---------------------------------------------------------------------------


def test_close_releases_every_file_without_gc(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    cfg = make_config(tmp_path, segment_size_mb=1)
    got: list[Message] = []
    threads_before = len(os.listdir("/proc/self/task"))
    m = Messenger(make_config(tmp_path, segment_size_mb=1, sync_interval_ms=50))
    m.close()  # a first messenger, closed, with its fsync timer and retention thread
    m = Messenger(cfg)
    subs = [m.subscribe(f"ch{i}", "s", got.append) for i in range(3)]
    for i in range(3):
        m.publish_batch(f"ch{i}", [("t", {"pad": "x" * 5000, "j": j}) for j in range(300)])
    wait_until(lambda: len(got) == 900, "delivery")
    reader = m.read_channel("ch0")  # an iterator left half-way
    next(iter(reader))
    assert fds_into(data_dir), "the test proves nothing: no file was open"
    m.close()
    assert fds_into(data_dir) == []
    assert subs  # the subscriptions are still referenced, not collected
    # Subscriber threads, the retention thread and the fsync timer are gone.
    assert len(os.listdir("/proc/self/task")) == threads_before


def test_close_releases_every_file_with_federation(tmp_path: Path, pki: Any) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node"
    sockets_before = open_sockets()
    hub = Messenger(hub_config(pki, hub_dir, [peer("node1", subscribe=["news"], publish=["up"])]))
    node = Messenger(
        client_config(pki, node_dir, "node1", hub_port(hub), subscribe=["news"], publish=["up"])
    )
    try:
        wait_peers(hub, "node1")
        wait_connected(node)
        inbox: list[Message] = []
        up: list[Message] = []
        node.subscribe("news", "n", inbox.append)
        hub.subscribe("up", "h", up.append)
        for i in range(20):
            hub.publish("news", "t", {"i": i})
            node.publish("up", "t", {"i": i})
        wait_until(lambda: len(inbox) == 20 and len(up) == 20, "federated delivery")
        assert fds_into(hub_dir) and fds_into(node_dir)
    finally:
        node.close()
        hub.close()
    assert fds_into(node_dir) == []
    assert fds_into(hub_dir) == []
    assert open_sockets() <= sockets_before, "a listener or connection outlived close()"


def test_federation_read_errors_are_rate_limited(
    tmp_path: Path, pki: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub that cannot read a channel it owes a peer logs the error once
    per interval instead of thousands of times a second."""
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node"
    hub = Messenger(hub_config(pki, hub_dir, [peer("node1", subscribe=["news"])]))
    node_cfg = client_config(pki, node_dir, "node1", hub_port(hub), subscribe=["news"])
    node = Messenger(node_cfg)
    try:
        wait_peers(hub, "node1")
        node.close()  # the hub keeps node1's cursor
        wait_peers(hub)
        for i in range(5):
            hub.publish("news", "t", {"i": i})  # owed to node1
        news = hub_dir / "channels" / "news"
        news.rename(news.with_name("news.moved"))
        news.write_text("not a directory\n")  # every read of the channel fails
        caplog.clear()
        # As the other tests do: never a narrower level (pyo3_log caches levels).
        caplog.set_level(logging.WARNING)
        node = Messenger(node_cfg)
        wait_peers(hub, "node1")
        time.sleep(2.0)
        errors = [r for r in caplog.records if "cannot read for federation" in r.getMessage()]
        assert 1 <= len(errors) <= 2, f"{len(errors)} read errors logged in 2 s"
    finally:
        node.close()
        hub.close()


# ---------------------------------------------------------------------------
# 4. Disk errors during a publish; a read-only data directory at open
# ---------------------------------------------------------------------------


@pytest.fixture
def m(tmp_path: Path) -> Iterator[Messenger]:
    with Messenger(make_config(tmp_path)) as messenger:
        yield messenger


def whole_records(data_dir: Path, channel: str) -> list[str]:
    ids = []
    for seg in sorted((data_dir / "channels" / channel).glob("*.jsonl")):
        content = seg.read_bytes()
        assert content == b"" or content.endswith(b"\n"), f"{seg}: partial record"
        ids += [json.loads(line)["id"] for line in content.split(b"\n")[:-1]]
    return ids


@pytest.mark.parametrize(
    ("kind", "code", "partial"),
    [
        ("write", errno.EIO, 0),
        ("write", errno.EIO, 123),
        ("write", errno.EROFS, 57),
        ("write", errno.ENOSPC, 99),
        ("sync", errno.EIO, 0),
        ("sync", errno.EROFS, 0),
    ],
)
def test_disk_error_names_path_and_errno_and_publishing_resumes(
    m: Messenger, tmp_path: Path, kind: str, code: int, partial: int
) -> None:
    data_dir = tmp_path / "data"
    acked = [m.publish("ch", "t", {"i": i}) for i in range(3)]
    seg = active_segment(data_dir, "ch")
    m._engine._inject_fault("ch", kind, 2, partial, code)
    for attempt in range(2):
        with pytest.raises(StorageError) as info:
            if attempt:
                m.publish_batch("ch", [("t", {"doomed": j}) for j in range(4)])
            else:
                m.publish("ch", "t", {"doomed": True, "pad": "d" * 300})
        assert info.value.errno == code, info.value
        text = str(info.value)
        assert str(seg) in text and "not committed" in text and os.strerror(code) in text, text
        assert whole_records(data_dir, "ch") == acked
    # The condition clears: the next publishes are committed, no reopen.
    acked.append(m.publish("ch", "t", {"after": 1}))
    acked += m.publish_batch("ch", [("t", {"after": 2}), ("t", {"after": 3})])
    assert whole_records(data_dir, "ch") == acked
    assert [e.message.id for e in m.read_channel("ch")] == acked


READ_ONLY_CHILD = textwrap.dedent(
    r"""
    import json, sys
    from keyop_messenger import Config, Messenger, StorageError, read_channel

    mode, mnt = sys.argv[1], sys.argv[2]
    cfg = Config.from_dict({"name": "ro", "storage": {"data_dir": mnt + "/data"}})
    if mode == "fill":  # a process of its own: nothing stays open when it ends
        with Messenger(cfg) as m:
            print(json.dumps([m.publish("ch", "t", {"i": i}) for i in range(3)]))
        sys.exit(0)
    out = {}
    try:
        Messenger(cfg)
        out["opened"] = True
    except StorageError as e:
        out["error"], out["errno"] = str(e), e.errno
    out["read"] = [e.message.id for e in read_channel(mnt + "/data", "ch")]
    print(json.dumps(out))
    """
)


def test_read_only_data_dir_fails_at_open_with_a_clear_error(tmp_path: Path) -> None:
    """A real read-only file system: a tmpfs mounted in a private mount
    namespace (``unshare``), filled, then remounted read-only."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=16m tmpfs {mnt} && "
        f'"{sys.executable}" -c "$0" fill {mnt} && '
        f"mount -o remount,ro {mnt} && "
        f'exec "{sys.executable}" -c "$0" check {mnt}'
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script, READ_ONLY_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-1000:]
    lines = proc.stdout.strip().splitlines()
    acked, out = json.loads(lines[-2]), json.loads(lines[-1])
    assert "opened" not in out, "a messenger opened a read-only data directory for writing"
    assert out["errno"] == errno.EROFS, out
    assert "not writable" in out["error"] and f"{mnt}/data" in out["error"], out["error"]
    assert out["read"] == acked, "the records stay readable with read_channel"


def test_threads_of_concurrent_publishers_see_the_lost_segment(tmp_path: Path) -> None:
    """Publishers racing an unlink: every publish either raises or is on
    disk after a reopen."""
    cfg = make_config(tmp_path)
    data_dir = tmp_path / "data"
    acked: list[str] = []
    lock = threading.Lock()
    with Messenger(cfg) as m:
        m.publish("ch", "t", {"warm": True})
        acked.append(ids_on_disk(data_dir, "ch")[0])
        seg = active_segment(data_dir, "ch")

        def worker(k: int) -> None:
            for r in range(30):
                try:
                    i = m.publish("ch", "t", {"k": k, "r": r})
                except StorageError:
                    continue
                with lock:
                    acked.append(i)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        seg.unlink()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    with Messenger(cfg) as again:
        on_disk = {e.message.id for e in again.read_channel("ch")}
    assert set(acked) <= on_disk, f"{len(set(acked) - on_disk)} acknowledged records lost"


def test_fork_while_threads_use_segment_files(tmp_path: Path) -> None:
    """The pool of open files is process-wide state: a child forked while
    other threads publish and read must not inherit its lock held (it would
    hang at its first segment file). Each child reads a channel and opens a
    messenger of its own."""
    stop = threading.Event()
    data_dir = tmp_path / "data"
    with Messenger(make_config(tmp_path)) as m:
        for k in range(8):
            m.publish_batch(f"ch{k}", [("t", {"j": j}) for j in range(20)])

        def churn(k: int) -> None:
            n = 0
            while not stop.is_set() and n < 1_000_000:
                if k == 0 and n % 50 == 0:
                    m.publish(f"ch{n % 8}", "t", {"n": n})
                list(read_channel(data_dir, f"ch{(n + k) % 8}"))
                n += 1

        threads = [threading.Thread(target=churn, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(60):
                pid = os.fork()
                if pid == 0:  # the child: no pytest from here on
                    code = 1
                    try:
                        ok = len(list(read_channel(data_dir, "ch1"))) >= 20
                        if i % 10 == 0:
                            with Messenger(make_config(tmp_path / f"child{i}")) as c:
                                c.publish("x", "t", {"i": i})
                        code = 0 if ok else 2
                    finally:
                        os._exit(code)
                deadline = time.monotonic() + 30
                while True:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        break
                    if time.monotonic() > deadline:
                        os.kill(pid, 9)
                        os.waitpid(pid, 0)
                        raise AssertionError(f"forked child {i} hung")
                    time.sleep(0.005)
                assert os.waitstatus_to_exitcode(status) == 0, f"child {i} failed"
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
