# why this file is long: five operator commands (pub, sub, tail, stats, dead-letters)
# sharing one set of subprocess helpers and fixtures.
"""The operator commands of ``keyop-messenger`` (pub, sub, tail, stats,
dead-letters), each run as a subprocess with a bounded timeout."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import fed_helpers
from fed_helpers import (
    PKI,
    Starter,
    client_config,
    hub_config,
    hub_port,
    hub_status,
    peer,
    stored,
    wait_until,
)
from keyop_messenger import Config, Message, Messenger, read_channel

pki = fed_helpers.pki
start = fed_helpers.start

TIMEOUT_S = 60.0
WAIT_S = 15.0
MESSAGE_KEYS = [
    "id",
    "ts",
    "channel",
    "origin",
    "payload_type",
    "payload",
    "service_name",
    "correlation_id",
]


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def cli(
    *argv: str | Path, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyop_messenger.cli", *map(str, argv)],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
    )


def popen(*argv: str | Path) -> subprocess.Popen[str]:
    """Starts the CLI with Ctrl-C (SIGINT) as a terminal gives it, even when
    these tests run in a shell's background job, which ignores SIGINT (an
    ignored signal stays ignored across exec, and Python then never raises
    KeyboardInterrupt; a handled one is reset to the default)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "keyop_messenger.cli", *map(str, argv)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


class Lines:
    """Reads a child's stdout lines in a thread, so waits can be bounded."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self._queue: queue.Queue[str | None] = queue.Queue()
        stream = proc.stdout

        def pump() -> None:
            for line in stream:
                self._queue.put(line)
            self._queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def get(self, timeout: float = WAIT_S) -> str:
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output line within {timeout} s") from None
        assert line is not None, "the command ended early"
        return line

    def empty_for(self, seconds: float) -> bool:
        try:
            self._queue.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def kill_at_end() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=TIMEOUT_S)


def write_config(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def local_config(tmp_path: Path, **subscribers: Any) -> tuple[Path, Path, Config]:
    """(config file, data dir, Config) of a plain local instance."""
    data_dir = tmp_path / "data"
    doc = {"name": "ops-node", "storage": {"data_dir": str(data_dir)}, "subscribers": subscribers}
    return write_config(tmp_path / "keyop.yaml", doc), data_dir, Config.from_dict(doc)


def assert_one_error_line(proc: subprocess.CompletedProcess[str], status: int = 1) -> str:
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------
# pub
# ---------------------------------------------------------------------------


def test_pub_json_argument(tmp_path: Path) -> None:
    cfg, data_dir, _ = local_config(tmp_path)
    proc = cli("pub", "--config", cfg, "--service-name", "ops", "orders", "t.Order", '{"n": 1}')
    assert proc.returncode == 0, proc.stderr
    msg_id = proc.stdout.strip()
    assert is_uuid(msg_id) and proc.stdout == msg_id + "\n"
    [msg] = stored(data_dir, "orders")
    assert (msg.id, msg.payload_type, msg.payload) == (msg_id, "t.Order", {"n": 1})
    assert (msg.origin, msg.service_name) == ("ops-node", "ops")


def test_pub_json_lines_from_stdin(tmp_path: Path) -> None:
    cfg, data_dir, _ = local_config(tmp_path)
    proc = cli("pub", "--config", cfg, "orders", "t.Any", stdin='1\n{"a": 2}\n\n[3]\n"last"')
    assert proc.returncode == 0, proc.stderr
    ids = proc.stdout.split()
    assert len(ids) == 4 and all(map(is_uuid, ids))
    assert proc.stderr == "published 4 messages to orders\n"
    msgs = stored(data_dir, "orders")
    assert [m.id for m in msgs] == ids
    assert [m.payload for m in msgs] == [1, {"a": 2}, [3], "last"]


def test_pub_bad_json(tmp_path: Path) -> None:
    cfg, data_dir, _ = local_config(tmp_path)
    # A bad argument is a usage error (2), found before anything is opened.
    err = assert_one_error_line(cli("pub", "--config", cfg, "c", "t", "{nope"), 2)
    assert "JSON argument: invalid JSON" in err
    assert not data_dir.exists()
    err = assert_one_error_line(cli("pub", "--config", cfg, "../x", "t", "1"), 2)
    assert 'invalid channel name "../x"' in err
    proc = cli("pub", "--config", cfg, "c", "t", stdin='{"ok": 1}\n{broken\n{"never": 1}\n')
    err = assert_one_error_line(proc)
    assert "stdin line 2: invalid JSON" in err and "1 published before it" in err
    assert [m.payload for m in stored(data_dir, "c")] == [{"ok": 1}]
    assert proc.stdout.split() == [m.id for m in stored(data_dir, "c")]


def test_pub_invalid_channel_and_usage_errors(tmp_path: Path) -> None:
    cfg, _, _ = local_config(tmp_path)
    err = assert_one_error_line(cli("pub", "--config", cfg, "bad/name", "t", "1"), status=2)
    assert "invalid channel name" in err
    err = assert_one_error_line(cli("pub", "--config", cfg, "only-channel"), status=2)
    assert "PAYLOAD_TYPE" in err
    assert_one_error_line(cli("sub", "--config", cfg, "c", "--id", "x", "--ephemeral"), status=2)
    assert_one_error_line(cli("tail", "--data-dir", tmp_path, "c", "-n", "-1"), status=2)


def test_missing_config_is_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    commands: list[list[str]] = [
        ["pub", "--config", missing, "c", "t", "1"],
        ["sub", "--config", missing, "c", "--timeout", "1"],
        ["stats", "--config", missing],
        ["dead-letters", "replay", "--config", missing, "c"],
    ]
    for argv in commands:  # a missing path: status 2
        err = assert_one_error_line(cli(*argv), 2)
        assert "cannot read configuration file" in err, argv
    bad = write_config(tmp_path / "bad.yaml", {"storage": {"data_dir": "", "bogus": 1}})
    err = assert_one_error_line(cli("stats", "--config", bad), 2)
    assert "storage.data_dir" in err and "storage.bogus" in err


def test_locked_data_dir_is_one_line(tmp_path: Path) -> None:
    cfg, _, config = local_config(tmp_path)
    with Messenger(config):
        err = assert_one_error_line(cli("pub", "--config", cfg, "c", "t", "1"))
        assert "in use" in err and "--ephemeral" in err
        err = assert_one_error_line(cli("sub", "--config", cfg, "c", "--timeout", "1"))
        assert "in use" in err
        err = assert_one_error_line(cli("dead-letters", "replay", "--config", cfg, "c"))
        assert "in use" in err


# ---------------------------------------------------------------------------
# sub
# ---------------------------------------------------------------------------


def test_sub_count_prints_json_lines_and_acknowledges_only_those(tmp_path: Path) -> None:
    cfg, data_dir, _ = local_config(tmp_path)
    # A first run registers subscriber "reader" at the current end (nothing yet).
    first = cli("sub", "--config", cfg, "orders", "--id", "reader", "--timeout", "0.3")
    assert (first.returncode, first.stdout) == (0, ""), first.stderr
    assert (data_dir / "subscribers" / "orders" / "reader.offset").exists()
    pub = cli(
        "pub", "--config", cfg, "--correlation-id", "c-1", "orders", "t.Order",
        stdin='{"n": 1}\n{"n": 2}\n{"n": 3}\n',
    )  # fmt: skip
    ids = pub.stdout.split()
    proc = cli(
        "sub", "--config", cfg, "orders", "--id", "reader", "--count", "2", "--timeout", "20"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["id"] for d in docs] == ids[:2]
    assert list(docs[0]) == MESSAGE_KEYS
    assert docs[0]["payload"] == {"n": 1} and docs[0]["channel"] == "orders"
    assert docs[0]["origin"] == "ops-node" and docs[0]["payload_type"] == "t.Order"
    assert docs[0]["correlation_id"] == "c-1" and docs[0]["service_name"] is None
    assert docs[0]["ts"].endswith("Z") and docs[0]["ts"][:4].isdigit()
    # The third was delivered in the same batch but not printed: not acknowledged.
    again = cli(
        "sub", "--config", cfg, "orders", "--id", "reader", "--count", "1", "--timeout", "20"
    )
    assert again.returncode == 0, again.stderr
    assert [json.loads(line)["id"] for line in again.stdout.splitlines()] == ids[2:]


def test_sub_timeout_before_count_is_an_error(tmp_path: Path) -> None:
    cfg, data_dir, config = local_config(tmp_path)
    with Messenger(config) as m:
        m.publish("c", "t", 0)  # before the subscriber: not delivered
    start_t = time.monotonic()
    err = assert_one_error_line(
        cli("sub", "--config", cfg, "c", "--count", "1", "--timeout", "0.5")
    )
    assert "timed out after 0.5 s: received 0 of 1 messages" in err
    assert time.monotonic() - start_t < TIMEOUT_S
    # Without --id the subscriber is temporary: no offset file is left behind.
    assert list((data_dir / "subscribers").glob("c/*.offset")) == []


def test_sub_without_id_is_temporary_and_stops_on_sigterm(
    tmp_path: Path, kill_at_end: list[subprocess.Popen[str]]
) -> None:
    cfg, data_dir, _ = local_config(tmp_path)
    proc = popen("sub", "--config", cfg, "c")
    kill_at_end.append(proc)
    lines = Lines(proc)
    # Wait until the temporary subscriber's offset file exists.
    deadline = time.monotonic() + WAIT_S
    while not list((data_dir / "subscribers").glob("c/cli-*.offset")):
        assert time.monotonic() < deadline, "sub did not subscribe"
        time.sleep(0.05)
    assert lines.empty_for(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0
    # The channel did not exist: subscribing created it, and said so.
    assert proc.stderr is not None and proc.stderr.read() == (
        f"keyop-messenger sub: channel 'c' does not exist yet in {data_dir}; "
        "subscribing creates it and waits for its messages\n"
    )
    assert list((data_dir / "subscribers").glob("c/*.offset")) == []


def test_sub_from_an_offset_that_starts_no_record_is_refused(tmp_path: Path) -> None:
    """Inside a record or past the end: a usage error (2) naming the offset;
    the read-only command writes nothing (a reader started mid-record would
    take the partial line for an unreadable record and quarantine it)."""
    cfg, data_dir, config = local_config(tmp_path)
    with Messenger(config) as m:
        m.publish_batch("c", [("t", {"n": 1}), ("t", {"n": 2})])
        end = m.stream_end("c")
    err = assert_one_error_line(cli("sub", "--config", cfg, "c", "--from", "5"), 2)
    assert "--from 5 (channel 'c'): offset 5 is not the start of a record;" in err
    assert "Message.offset" not in err  # the command line's words, not the API's
    err = assert_one_error_line(cli("sub", "--config", cfg, "c", "--from", str(end + 1)), 2)
    assert f"offset {end + 1} is past the end of the channel ({end})" in err
    assert not (data_dir / "quarantine").exists()
    ok = cli("sub", "--config", cfg, "c", "--from", str(end), "--timeout", "0.2")
    assert (ok.returncode, ok.stdout) == (0, ""), ok.stderr


def test_pub_beside_a_stopped_client_is_forwarded_once_it_runs(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """``pub`` with a client's configuration while the client is not running
    (before its first run, here): the link's cursor starts before the record,
    so the client forwards it once it runs (it used to start at the end then)."""
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["up"])]))
    doc = client_config(pki, tmp_path / "node1", "node1", hub_port(hub), publish=["up"]).to_dict()
    cfg = write_config(tmp_path / "node1.yaml", doc)
    pub = cli("pub", "--config", cfg, "up", "t.Up", "1")
    assert pub.returncode == 0, pub.stderr
    with Messenger(Config.from_dict(doc)):
        wait_until(lambda: [m.id for m in stored(hub_dir, "up")] == pub.stdout.split(), "forwarded")


def test_pub_and_sub_ephemeral_through_a_hub(
    pki: PKI, tmp_path: Path, start: Starter, kill_at_end: list[subprocess.Popen[str]]
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", subscribe=["news"], publish=["up"])]))
    doc = client_config(pki, tmp_path / "node1", "node1", hub_port(hub)).to_dict()
    cfg = write_config(tmp_path / "node1.yaml", doc)

    pub = cli("pub", "--config", cfg, "--ephemeral", "up", "t.Up", stdin="1\n2\n")
    assert pub.returncode == 0, pub.stderr
    assert [m.id for m in stored(hub_dir, "up")] == pub.stdout.split()
    assert not (tmp_path / "node1" / "channels").exists(), "nothing stored locally"

    proc = popen("sub", "--config", cfg, "--ephemeral", "news", "--count", "1", "--timeout", "30")
    kill_at_end.append(proc)
    lines = Lines(proc)
    published: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while True:  # live only: publish until the connected client prints one
        assert time.monotonic() < deadline, "nothing reached the ephemeral subscriber"
        published.append(hub.publish("news", "t.News", {"n": len(published)}))
        try:
            line = lines.get(timeout=0.3)
            break
        except AssertionError:
            continue
    doc_line = json.loads(line)
    assert doc_line["id"] in published and doc_line["origin"] == "hub1"
    assert proc.wait(timeout=WAIT_S) == 0
    # A channel the hub will not deliver to node1: said at once, not waited on.
    refused = cli("sub", "--config", cfg, "--ephemeral", "secret", "--timeout", "30")
    assert refused.returncode == 1, refused.stderr
    err = refused.stderr.splitlines()[-1]  # after the link's own WARNING
    assert err.startswith("Error: hub ") and "Traceback" not in refused.stderr, refused.stderr
    assert "will not deliver channel 'secret' to 'node1'" in err, err
    # The hub going away ends a live subscription with an error, not a wait.
    proc = popen("sub", "--config", cfg, "--ephemeral", "news")
    kill_at_end.append(proc)
    wait_until(lambda: hub_status(hub)["peers"] == ["node1"], "the subscriber connected")
    hub.close()
    assert proc.wait(timeout=WAIT_S) == 1
    assert proc.stderr is not None
    assert "the connection to hub 127.0.0.1:" in proc.stderr.read()


# ---------------------------------------------------------------------------
# tail
# ---------------------------------------------------------------------------

GO_LINES = [
    '{"v":1,"id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f","ts":"2026-03-31T14:22:01.1234567Z",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"com.example.Alert",'
    '"correlation_id":"01970a3c-0000-7000-8000-000000000001","service_name":"thermostat",'
    '"payload":{"message":"hot"}}',
    '{"v":1,"id":"01970a3c-6000-7000-8000-000000000002","ts":"2026-03-31T14:22:02Z",'
    '"channel":"alerts","origin":"sensor-2","payload_type":"com.example.Note",'
    '"payload":"just a string"}',
    '{"payload":[1,2,3],"origin":"sensor-3","channel":"alerts",'
    '"ts":"2026-03-31T14:22:05.123456789Z","id":"01970a3c-9000-7000-8000-000000000004",'
    '"payload_type":"com.example.List","v":1}',
    '{"v":1,"id":"01970a3c-a000-7000-8000-000000000005","ts":"2026-03-31T14:22:06.5Z",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"com.example.Num",'
    '"service_name":"counter","payload":42}',
]


def go_data_dir(root: Path) -> Path:
    """A data directory as keyop-messenger 1.4 leaves it: two segments, torn tail."""
    folder = root / "channels" / "alerts"
    folder.mkdir(parents=True)
    seg0 = "".join(line + "\n" for line in GO_LINES[:2]).encode()
    (folder / f"{0:020d}.jsonl").write_bytes(seg0)
    seg1 = "".join(line + "\n" for line in GO_LINES[2:]).encode() + b'{"v":1,"id":"tor'
    (folder / f"{len(seg0):020d}.jsonl").write_bytes(seg1)
    (root / "subscribers").mkdir()
    return root


def test_tail_last_n_of_a_go_data_dir_across_segments(tmp_path: Path) -> None:
    data_dir = go_data_dir(tmp_path / "go")
    proc = cli("tail", "--data-dir", data_dir, "alerts", "-n", "3")
    assert proc.returncode == 0, proc.stderr
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["id"][-4:] for d in docs] == ["0002", "0004", "0005"]
    assert list(docs[0]) == ["offset", *MESSAGE_KEYS]
    assert docs[0]["offset"] == len(GO_LINES[0]) + 1
    assert docs[1]["ts"] == "2026-03-31T14:22:05.123456789Z"
    assert docs[2]["payload"] == 42 and docs[2]["service_name"] == "counter"
    everything = cli("tail", "--data-dir", data_dir, "alerts", "-n", "100")
    assert len(everything.stdout.splitlines()) == 4
    default = cli("tail", "--data-dir", data_dir, "alerts")
    assert default.stdout == everything.stdout  # fewer than the default 10
    assert cli("tail", "--data-dir", data_dir, "alerts", "-n", "0").stdout == ""


def test_tail_prints_a_lone_surrogate_another_writer_stored(tmp_path: Path) -> None:
    """1.4 stores a payload string with half a surrogate pair (this
    implementation refuses to); tail prints it as an escape, not a crash."""
    folder = tmp_path / "go" / "channels" / "alerts"
    folder.mkdir(parents=True)
    line = GO_LINES[-1].replace('"payload":42', '"payload":"a\\ud800b"')
    (folder / f"{0:020d}.jsonl").write_text(line + "\n")
    proc = cli("tail", "--data-dir", tmp_path / "go", "alerts")
    assert proc.returncode == 0, proc.stderr
    (doc,) = [json.loads(text) for text in proc.stdout.splitlines()]
    assert doc["payload"] == "a\ud800b"
    assert "\\ud800" in proc.stdout


def test_tail_while_a_messenger_holds_the_data_dir(tmp_path: Path) -> None:
    _, data_dir, config = local_config(tmp_path)
    with Messenger(config) as m:
        ids = m.publish_batch("c", [("t", i) for i in range(5)])
        proc = cli("tail", "--data-dir", data_dir, "c", "-n", "2")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in proc.stdout.splitlines()] == ids[3:]


def test_tail_follow_prints_new_messages_and_exits_cleanly(
    tmp_path: Path, kill_at_end: list[subprocess.Popen[str]]
) -> None:
    _, data_dir, config = local_config(tmp_path)
    with Messenger(config) as m:
        old = m.publish("c", "t", "old")
        for sig in (signal.SIGTERM, signal.SIGINT):
            proc = popen("tail", "--data-dir", data_dir, "c", "-f", "-n", "1")
            kill_at_end.append(proc)
            lines = Lines(proc)
            assert json.loads(lines.get())["id"] == old
            new = m.publish_batch("c", [("t", "new1"), ("t", "new2")])
            got = [json.loads(lines.get())["id"] for _ in range(2)]
            assert got == new
            proc.send_signal(sig)
            assert proc.wait(timeout=WAIT_S) == 0, sig
            assert proc.stderr is not None and proc.stderr.read() == ""
            old = new[-1]


def test_tail_follow_waits_for_a_channel_to_appear(
    tmp_path: Path, kill_at_end: list[subprocess.Popen[str]]
) -> None:
    _, data_dir, config = local_config(tmp_path)
    Messenger(config).close()  # an empty data directory
    proc = popen("tail", "--data-dir", data_dir, "later", "-f")
    kill_at_end.append(proc)
    lines = Lines(proc)
    assert lines.empty_for(0.5)
    with Messenger(config) as m:
        msg_id = m.publish("later", "t", 1)
    assert json.loads(lines.get())["id"] == msg_id
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0


def test_tail_errors(tmp_path: Path) -> None:
    err = assert_one_error_line(cli("tail", "--data-dir", tmp_path / "none", "c"), 2)
    assert "does not exist" in err and not (tmp_path / "none").exists()
    data_dir = go_data_dir(tmp_path / "go")
    err = assert_one_error_line(cli("tail", "--data-dir", data_dir, "nope"), 2)
    assert 'channel "nope" does not exist' in err
    err = assert_one_error_line(cli("tail", "--data-dir", data_dir, "../etc"), 2)
    assert "invalid channel name" in err


# ---------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------


def test_stats_json_and_table(tmp_path: Path) -> None:
    cfg, _, config = local_config(tmp_path)
    with Messenger(config) as m:
        m.subscribe("orders", "billing", lambda msg: None).close()
        m.publish_batch("orders", [("t", i) for i in range(3)])
        m.publish("events", "t", "e")
        end = m.stream_end("orders")
    proc = cli("stats", "--config", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    channels = {c["name"]: c for c in doc["channels"]}
    assert channels["orders"]["stream_bytes"] == end
    assert channels["orders"]["disk_bytes"] == end
    [billing] = channels["orders"]["subscribers"]
    assert billing["id"] == "billing" and billing["lag_bytes"] == end
    assert billing["active"] is False
    assert billing["oldest_pending"] is None or billing["oldest_pending"].endswith("Z")
    assert doc["totals"]["channels"] >= 2
    table = cli("stats", "--config", cfg)
    assert table.returncode == 0, table.stderr
    assert "orders" in table.stdout and "billing" in table.stdout and "events" in table.stdout


# ---------------------------------------------------------------------------
# dead-letters
# ---------------------------------------------------------------------------


def make_dead_letters(config: Config, count: int) -> list[str]:
    """Publishes ``count`` messages to ``orders`` that a subscriber rejects
    at once (max_retries 0); returns their ids once all are dead-lettered."""
    data_dir = Path(config.storage.data_dir)

    def reject(msg: Message) -> None:
        raise RuntimeError(f"cannot handle {msg.payload['n']}")

    with Messenger(config) as m:
        m.subscribe("orders", "worker", reject)
        ids = [
            m.publish("orders", "t.Order", {"n": i}, correlation_id=f"c{i}") for i in range(count)
        ]
        deadline = time.monotonic() + WAIT_S
        while len(list(read_channel(data_dir, "orders.dead-letter"))) < count:
            assert time.monotonic() < deadline, "messages were not dead-lettered"
            time.sleep(0.05)
    return ids


def test_dead_letters_list_and_replay(tmp_path: Path) -> None:
    cfg, data_dir, config = local_config(tmp_path, max_retries=0)
    originals = make_dead_letters(config, 3)

    listing = cli("dead-letters", "--data-dir", data_dir, "orders", "--json")
    assert listing.returncode == 0, listing.stderr
    letters = [json.loads(line) for line in listing.stdout.splitlines()]
    assert [d["original_id"] for d in letters] == originals
    assert letters[0]["retries"] == 0 and "cannot handle 0" in letters[0]["last_error"]
    assert letters[0]["failed_at"].endswith("Z") and letters[0]["replayed_as"] is None
    assert listing.stderr == "3 dead letters of orders (3 not replayed)\n"
    table = cli("dead-letters", "list", "--data-dir", data_dir, "orders.dead-letter")
    assert table.returncode == 0 and table.stdout.count("\n") == 4  # header + 3
    assert letters[1]["id"] in table.stdout

    # Replay one, chosen by its dead-letter id.
    one = cli("dead-letters", "replay", "--config", cfg, "orders", "--id", letters[1]["id"])
    assert one.returncode == 0, one.stderr
    [record] = [json.loads(line) for line in one.stdout.splitlines()]
    assert record["dead_letter_id"] == letters[1]["id"]
    assert record["original_id"] == originals[1]
    assert one.stderr == "replayed 1 dead letter to orders\n"
    replayed = {m.id: m for m in stored(data_dir, "orders")}[record["new_id"]]
    assert (replayed.payload_type, replayed.payload) == ("t.Order", {"n": 1})
    assert replayed.correlation_id == "c1"

    # Replay the rest: the one already replayed is skipped.
    rest = cli("dead-letters", "replay", "--config", cfg, "orders")
    assert rest.returncode == 0, rest.stderr
    records = [json.loads(line) for line in rest.stdout.splitlines()]
    assert [r["original_id"] for r in records] == [originals[0], originals[2]]
    assert rest.stderr == "replayed 2 dead letters to orders (1 skipped: already replayed)\n"
    again = cli("dead-letters", "replay", "--config", cfg, "orders")
    assert again.stdout == "" and "replayed 0 dead letters" in again.stderr
    payloads = [m.payload for m in stored(data_dir, "orders")]
    assert payloads == [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 1}, {"n": 0}, {"n": 2}]

    listing = cli("dead-letters", "--data-dir", data_dir, "orders", "--json")
    after = [json.loads(line) for line in listing.stdout.splitlines()]
    assert all(d["replayed_as"] for d in after)
    assert listing.stderr == "3 dead letters of orders (0 not replayed)\n"
    log = data_dir / "subscribers" / "orders.dead-letter" / "replayed.jsonl"
    assert len(log.read_text().splitlines()) == 3

    # --force replays again; an unknown id replays nothing.
    err = assert_one_error_line(
        cli(
            "dead-letters",
            "replay",
            "--config",
            cfg,
            "orders",
            "--id",
            "nope",
            "--id",
            originals[0],
        )
    )
    assert "nope" in err and "nothing replayed" in err
    forced = cli(
        "dead-letters", "replay", "--config", cfg, "orders", "--id", originals[0], "--force"
    )
    assert forced.returncode == 0 and len(forced.stdout.splitlines()) == 1


def test_dead_letters_of_a_channel_without_any(tmp_path: Path) -> None:
    _, data_dir, config = local_config(tmp_path)
    with Messenger(config) as m:
        m.publish("quiet", "t", 1)
    proc = cli("dead-letters", "--data-dir", data_dir, "quiet")
    assert (proc.returncode, proc.stdout) == (0, "")
    assert proc.stderr == "0 dead letters of quiet (0 not replayed)\n"
    assert_one_error_line(cli("dead-letters", "--data-dir", tmp_path / "none", "c"), 2)


def test_help_of_every_operator_command() -> None:
    for command in ("pub", "sub", "tail", "stats", "dead-letters"):
        proc = cli(command, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout, command
    assert "replay" in cli("dead-letters", "--help").stdout
    assert os.environ.get("KEYOP_UNUSED") is None
