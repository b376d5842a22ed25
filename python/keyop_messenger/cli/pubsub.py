"""``keyop-messenger pub``, ``sub`` and ``tail``: publishing and reading messages."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .common import (
    CONFIG_HELP,
    CommandError,
    OpsUsageError,
    Out,
    PipeClosed,
    Progress,
    check_data_dir,
    ephemeral_config,
    handle_sigterm,
    load,
    log,
    message_doc,
    non_negative_int,
    open_local,
    ops_command,
    positive_float,
)

if TYPE_CHECKING:
    from ..message import Message

#: Lines ``tail`` prints without ``-n``.
DEFAULT_TAIL_LINES = 10
#: Longest sleep of ``tail -f`` between two looks at the channel (seconds).
FOLLOW_MAX_SLEEP_S = 0.5
#: At most this many stdin lines, or bytes of them, go into one ``publish_batch``.
PUB_BATCH_ITEMS = 500
PUB_BATCH_BYTES = 1 << 20


def add_parsers(commands: Any) -> None:
    """Adds ``pub``, ``sub`` and ``tail`` to the subcommands ``commands``."""
    pub = ops_command(
        commands,
        "pub",
        _cmd_pub,
        help="publish a message (or JSON lines from stdin)",
        description="Publishes JSON to CHANNEL and prints each message id once committed. "
        "Without JSON, every line of stdin is one payload (lines available together are "
        "published as one batch: all or none); a line that is not JSON stops the command "
        "after the lines before it are published, and the error says how many were.",
    )
    pub.add_argument("--config", required=True, metavar="F", help=CONFIG_HELP)
    pub.add_argument(
        "--ephemeral",
        action="store_true",
        help="publish through the configuration's first hub (client.hubs[0]) instead of "
        "the local data directory; ids are printed once the hub committed",
    )
    pub.add_argument("--service-name", metavar="NAME", help="service_name of the messages")
    pub.add_argument("--correlation-id", metavar="ID", help="correlation_id of the messages")
    pub.add_argument("channel", metavar="CHANNEL")
    pub.add_argument("payload_type", metavar="PAYLOAD_TYPE")
    pub.add_argument("json", metavar="JSON", nargs="?", help="the payload (default: stdin)")

    sub = ops_command(
        commands,
        "sub",
        _cmd_sub,
        help="print the messages of a channel as JSON lines",
        description="Prints the messages of CHANNEL as JSON lines. With --id, as that "
        "durable subscriber (a new id starts at the end, a known id resumes, printed "
        "messages are acknowledged); without it, as a temporary subscriber starting at the "
        "end and removed on exit; with --ephemeral, live messages through the "
        "configuration's first hub. Stops after --count messages, after --timeout seconds "
        "(an error if --count was not reached), or on Ctrl-C / SIGTERM.",
    )
    sub.add_argument("--config", required=True, metavar="F", help=CONFIG_HELP)
    how = sub.add_mutually_exclusive_group()
    how.add_argument("--id", metavar="ID", help="durable subscriber id")
    how.add_argument("--ephemeral", action="store_true", help="live messages through the first hub")
    how.add_argument(
        "--from", dest="from_offset", type=non_negative_int, metavar="OFFSET",
        help="read the channel's files from OFFSET (0: the beginning; or an offset "
        "tail printed) without taking the data directory, so also next to a running "
        "messenger; messages are printed with their offset and nothing is acknowledged",
    )  # fmt: skip
    sub.add_argument("--count", type=non_negative_int, metavar="N", help="stop after N messages")
    sub.add_argument("--timeout", type=positive_float, metavar="S", help="stop after S seconds")
    sub.add_argument("channel", metavar="CHANNEL")

    tail = ops_command(
        commands,
        "tail",
        _cmd_tail,
        help="print the last messages of a channel from its segment files",
        description="Reads the segment files of CHANNEL directly (also next to a running "
        "messenger, and in data directories of keyop-messenger 1.4) and prints the last "
        "messages as JSON lines with their offset.",
    )
    tail.add_argument("--data-dir", required=True, metavar="D", help="the data directory")
    tail.add_argument(
        "-n",
        "--lines",
        type=non_negative_int,
        default=DEFAULT_TAIL_LINES,
        metavar="N",
        help=f"print the last N messages (default {DEFAULT_TAIL_LINES})",
    )
    tail.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new messages until Ctrl-C / SIGTERM (a channel that does not "
        "exist yet is waited for, with a note on stderr)",
    )
    tail.add_argument("channel", metavar="CHANNEL")


class _StopDelivery(Exception):
    """Raised by ``sub``'s handler for messages it must not acknowledge."""


# ---------------------------------------------------------------------------
# pub
# ---------------------------------------------------------------------------


def _parse_json(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CommandError(f"{where}: invalid JSON: {exc}") from None


def _parse_json_argument(text: str) -> Any:
    """The JSON argument of ``pub``: a usage error (exit 2) when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise OpsUsageError(f"JSON argument: invalid JSON: {exc}") from None


def _stdin_batches(payload_type: str) -> Iterator[list[tuple[str, Any]]]:
    """Batches of ``(payload_type, payload)`` from the JSON lines of stdin: the
    complete lines available at once, up to the batch limits. A bad line ends
    the iteration with an error after the lines before it were yielded."""
    fd = sys.stdin.fileno()
    pending = b""
    line_no = 0
    eof = False
    while not eof:
        chunk = os.read(fd, PUB_BATCH_BYTES)
        if chunk:
            pending += chunk
            *lines, pending = pending.split(b"\n")
        else:
            eof = True
            lines, pending = ([pending] if pending.strip() else []), b""
        batch: list[tuple[str, Any]] = []
        size = 0
        for raw in lines:
            line_no += 1
            if not raw.strip():
                continue
            try:
                payload = json.loads(raw)
            except ValueError as exc:
                if batch:
                    yield batch
                raise CommandError(f"stdin line {line_no}: invalid JSON: {exc}") from None
            batch.append((payload_type, payload))
            size += len(raw)
            if len(batch) >= PUB_BATCH_ITEMS or size >= PUB_BATCH_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def _cmd_pub(args: argparse.Namespace) -> int:
    config = load(args.config)
    out = Out()
    meta = {"service_name": args.service_name, "correlation_id": args.correlation_id}
    publisher: Any
    # Checked before anything is opened.
    payload = None if args.json is None else _parse_json_argument(args.json)
    if args.ephemeral:
        from ..ephemeral import EphemeralMessenger

        publisher = EphemeralMessenger(ephemeral_config(config))  # connects in ``with``
    else:
        publisher = open_local(args.config, "use --ephemeral to publish through a hub")
    with publisher:
        if args.json is not None:
            out.line(publisher.publish(args.channel, args.payload_type, payload, **meta))
            return 0
        progress = Progress(f"published to {args.channel}")
        try:
            for batch in _stdin_batches(args.payload_type):
                for msg_id in publisher.publish_batch(args.channel, batch, **meta):
                    out.line(msg_id)
                progress.add(len(batch))
        except CommandError as err:
            raise CommandError(f"{err} ({progress.count} published before it)") from None
        finally:
            progress.clear()
    noun = "message" if progress.count == 1 else "messages"
    progress.done(f"published {progress.count} {noun} to {args.channel}")
    return 0


# ---------------------------------------------------------------------------
# sub
# ---------------------------------------------------------------------------


class _Silence(logging.Filter):
    """Drops the "handler failed" warnings of ``sub``'s deliberate refusals."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(a, (_StopDelivery, PipeClosed)) for a in args)


def _cmd_sub(args: argparse.Namespace) -> int:
    config = load(args.config)
    if args.from_offset is not None:
        return _sub_from_files(Path(config.storage.data_dir), args)
    out = Out()
    lock = threading.Lock()
    done = threading.Event()
    state: dict[str, Any] = {"count": 0, "pipe_closed": False, "lost": ""}
    limit: int | None = args.count

    refuse = not args.ephemeral  # durable delivery: leave the rest unacknowledged

    def handler(msg: Message) -> None:
        with lock:
            if done.is_set():
                if refuse:
                    raise _StopDelivery()  # a later subscriber with the id gets it
                return
            try:
                out.json(message_doc(msg))
            except PipeClosed:
                state["pipe_closed"] = True
                done.set()
                if refuse:
                    raise
                return
            state["count"] += 1
            if limit is not None and state["count"] >= limit:
                done.set()

    if limit == 0:
        return 0
    handle_sigterm()
    silence = _Silence()
    log.addFilter(silence)
    try:
        if args.ephemeral:
            from ..ephemeral import EphemeralMessenger

            def lost(hub: str, reason: str) -> None:
                # Live messages only and no reconnecting: a lost link ends the
                # command (with an error) rather than leaving it waiting.
                with lock:
                    state["lost"] = f"the connection to hub {hub} was lost: {reason}"
                done.set()

            eph_config = ephemeral_config(config, [args.channel])
            with EphemeralMessenger(eph_config, on_disconnect=lost) as eph:
                eph.subscribe(args.channel, handler)
                _wait(done, args.timeout)
        else:
            m = open_local(args.config, "use --ephemeral to subscribe through a hub")
            _note_new_channel(Path(config.storage.data_dir), args.channel)
            temporary = args.id is None
            sub_id = args.id or f"cli-{uuid.uuid4().hex[:12]}"
            try:
                subscription = m.subscribe(args.channel, sub_id, handler)
                try:
                    _wait(done, args.timeout)
                finally:
                    subscription.close()
                    if temporary:
                        m.unsubscribe(args.channel, sub_id)
            finally:
                m.close()
    except KeyboardInterrupt:
        return 0
    finally:
        log.removeFilter(silence)
    if state["pipe_closed"]:
        raise PipeClosed()
    if state["lost"]:
        raise CommandError(f"{state['lost']} (after {state['count']} messages)")
    if limit is not None and state["count"] < limit:
        raise CommandError(
            f"timed out after {args.timeout:g} s: received {state['count']} of {limit} messages"
        )
    return 0


def _note_new_channel(data_dir: Path, channel: str) -> None:
    """Subscribing creates a channel that does not exist yet (as
    ``subscribe()`` does: a subscriber may come before the first message);
    say so on stderr, where a mistyped name shows at once."""
    from .. import _core
    from ..errors import ChannelNotFoundError

    try:
        _core.read_channel(os.fspath(data_dir), channel, 0)
    except ChannelNotFoundError:
        print(f"keyop-messenger sub: channel {channel!r} does not exist yet in {data_dir}; "
              "subscribing creates it and waits for its messages", file=sys.stderr, flush=True)


def _sub_from_files(data_dir: Path, args: argparse.Namespace) -> int:
    """``sub --from OFFSET``: the channel's records from its files (no lock),
    following new ones until --count, --timeout or a signal."""
    from .. import _core
    from ..message import entry_from_row

    check_data_dir(data_dir)
    limit: int | None = args.count
    if limit == 0:
        return 0
    out = Out()
    count, position, sleep = 0, args.from_offset, 0.05
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    handle_sigterm()
    try:
        while True:
            try:
                rows = _core.read_channel(os.fspath(data_dir), args.channel, position)
            except ConfigError as err:
                if position != args.from_offset:
                    raise
                # The engine's reason, in the command line's words.
                why = str(err).split("; use", 1)[0].rsplit(": ", 1)[-1]
                raise OpsUsageError(
                    f"--from {args.from_offset} (channel {args.channel!r}): {why}; give an "
                    "offset that sub, tail or stats printed, or leave --from out"
                ) from None
            got = False
            for row in rows:
                entry = entry_from_row(row, None)
                out.json(message_doc(entry.message, entry.offset))
                count, got = count + 1, True
                if limit is not None and count >= limit:
                    return 0
            position = rows.position
            sleep = 0.05 if got else min(sleep * 2, FOLLOW_MAX_SLEEP_S)
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                sleep = min(sleep, remaining)
            time.sleep(sleep)
    except KeyboardInterrupt:
        return 0
    if limit is not None:
        raise CommandError(
            f"timed out after {args.timeout:g} s: received {count} of {limit} messages"
        )
    return 0


def _wait(done: threading.Event, timeout: float | None) -> None:
    """Waits for ``done`` or ``timeout`` seconds, in short slices so that
    Ctrl-C and SIGTERM are handled at once."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done.is_set():
        slice_s = 0.2
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            slice_s = min(slice_s, remaining)
        done.wait(slice_s)


# ---------------------------------------------------------------------------
# tail
# ---------------------------------------------------------------------------


def _segment_starts(channel_dir: Path) -> list[int]:
    starts = []
    for path in channel_dir.glob("*.jsonl"):
        if path.stem.isdigit():
            starts.append(int(path.stem))
    return sorted(starts)


def _last_records(data_dir: Path, channel: str, n: int) -> tuple[list[tuple[Any, ...]], int]:
    """The last ``n`` rows of ``channel`` and the offset after them. Reads
    from the last segment back only as far as needed."""
    from .. import _core
    from ..errors import ChannelNotFoundError

    starts = _segment_starts(data_dir / "channels" / channel) or [0]
    for index in range(len(starts) - 1, -1, -1):
        try:
            rows = _core.read_channel(os.fspath(data_dir), channel, starts[index])
        except ChannelNotFoundError:
            return [], 0
        last = deque(rows, maxlen=n)
        if len(last) >= n or index == 0:
            return list(last), rows.position
    raise AssertionError("unreachable")


def _cmd_tail(args: argparse.Namespace) -> int:
    from .. import _core
    from ..errors import ChannelNotFoundError
    from ..message import entry_from_row

    data_dir = Path(args.data_dir)
    channel: str = args.channel
    check_data_dir(data_dir)
    try:
        _core.read_channel(os.fspath(data_dir), channel, 0)  # InvalidNameError first
    except ChannelNotFoundError as err:
        if not args.follow:
            raise
        # --follow waits for the channel to appear, and says so.
        print(f"keyop-messenger tail: {err}; waiting for it to appear (Ctrl-C to stop)",
              file=sys.stderr, flush=True)
    out = Out()

    def emit(row: tuple[Any, ...]) -> None:
        entry = entry_from_row(row, None)
        out.json(message_doc(entry.message, entry.offset))

    handle_sigterm()
    try:
        rows, position = _last_records(data_dir, channel, args.lines)
        for row in rows:
            emit(row)
        sleep = 0.05
        while args.follow:
            try:
                it = _core.read_channel(os.fspath(data_dir), channel, position)
            except ChannelNotFoundError:
                check_data_dir(data_dir)  # it may go away meanwhile
                time.sleep(FOLLOW_MAX_SLEEP_S)
                continue
            got = False
            for row in it:
                emit(row)
                got = True
            position = it.position
            sleep = 0.05 if got else min(sleep * 2, FOLLOW_MAX_SLEEP_S)
            time.sleep(sleep)
    except KeyboardInterrupt:
        pass
    return 0
