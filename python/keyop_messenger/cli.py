"""The ``keyop-messenger`` command: version, certificates and operator commands.

Commands (``shared/spec/cli.md`` for ``version`` and ``keygen``)::

    keyop-messenger version
    keyop-messenger keygen ca        [--out-cert F] [--out-key F] [--days N] [--force]
    keyop-messenger keygen instance  --ca F --ca-key F --name NAME
                                     [--out-cert F] [--out-key F] [--days N] [--force]
                                     [--san NAME ...]
    keyop-messenger keygen inspect   FILE

    keyop-messenger pub   --config F [--ephemeral] CHANNEL PAYLOAD_TYPE [JSON]
    keyop-messenger sub   --config F CHANNEL [--id ID | --ephemeral] [--count N] [--timeout S]
    keyop-messenger tail  --data-dir D CHANNEL [-n N] [-f]
    keyop-messenger stats --config F [--json]
    keyop-messenger dead-letters [list] --data-dir D CHANNEL [--json]
    keyop-messenger dead-letters replay --config F CHANNEL [--id ID ...] [--force]

Keys are ECDSA P-384, written as SEC 1 ``EC PRIVATE KEY`` PEM files of mode
0600 together with their certificates.

``pub``, ``sub``, ``stats`` and ``dead-letters replay`` open the data directory
of the configuration with federation and the metrics listener off (a running
messenger holds the directory: they then fail with a one-line error; ``pub``
and ``sub`` can go through the configuration's first hub with
``--ephemeral``). ``tail`` and ``dead-letters list`` only read segment files,
so they work next to a running messenger and on data directories of
keyop-messenger 1.4.

Messages are printed as JSON lines with the keys ``id``, ``ts``, ``channel``,
``origin``, ``payload_type``, ``payload``, ``service_name`` and
``correlation_id`` (``tail`` adds ``offset`` first). Errors are printed to
stderr as one line ``Error: <message>``; the exit status is 1 (2 for a usage
error of an operator command; ``keygen`` keeps 1, as in 1.4).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

if TYPE_CHECKING:
    from .config import Config
    from .message import Message
    from .messenger import Messenger

__all__ = ["main"]

DEFAULT_DAYS = 730
#: Lines ``tail`` prints without ``-n``.
DEFAULT_TAIL_LINES = 10
#: Longest sleep of ``tail -f`` between two looks at the channel (seconds).
FOLLOW_MAX_SLEEP_S = 0.5
#: At most this many stdin lines, or bytes of them, go into one ``publish_batch``.
PUB_BATCH_ITEMS = 500
PUB_BATCH_BYTES = 1 << 20
#: Seconds between progress updates on a terminal.
PROGRESS_INTERVAL_S = 0.25
DEAD_LETTER_SUFFIX = ".dead-letter"
DEAD_LETTER_PAYLOAD_TYPE = "com.keyop.messenger.DeadLetterPayload"
#: Replay log of ``dead-letters replay``, under ``subscribers/<channel>.dead-letter/``.
REPLAY_LOG = "replayed.jsonl"

log = logging.getLogger("keyop_messenger")


class _UsageError(Exception):
    """A command-line error: printed as ``Error: <message>``, exit status 1."""


class _OpsUsageError(_UsageError):
    """A usage error of an operator command: exit status 2, as argparse's."""


class _CommandError(Exception):
    """A failure of an operator command: ``Error: <message>``, exit status 1."""


class _StopDelivery(Exception):
    """Raised by ``sub``'s handler for messages it must not acknowledge."""


class _PipeClosed(Exception):
    """stdout was closed by the reader (``| head``)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that reports errors the way the 1.4 command does
    (exit status 1); operator commands set ``ops`` for argparse's status 2."""

    ops = False

    def error(self, message: str) -> NoReturn:
        if self.ops:
            raise _OpsUsageError(f"{self.prog}: {message} (see {self.prog} --help)")
        raise _UsageError(message)


class _OpsParser(_Parser):
    """Parser of the operator commands: usage errors exit with status 2."""

    ops = True


def _add_output_flags(parser: argparse.ArgumentParser, cert: str, key: str) -> None:
    parser.add_argument("--out-cert", metavar="FILE", help=f"certificate output (default {cert})")
    parser.add_argument("--out-key", metavar="FILE", help=f"private key output (default {key})")
    parser.add_argument(
        "--days",
        type=int,
        default=DEFAULT_DAYS,
        metavar="N",
        help=f"validity period in days (default {DEFAULT_DAYS})",
    )
    parser.add_argument(
        "--force", action="store_true", help="allow overwriting existing output files"
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_non_negative_int.__name__ = "non-negative integer"


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


_positive_float.__name__ = "positive number"


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="keyop-messenger",
        description="keyop-messenger: certificates and operator commands.",
    )
    parser.set_defaults(print_help=parser.print_help, kind=None, func=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.add_parser("version", help="print the version")
    commands.add_parser(
        "bench",
        help="run the benchmark suite (options: --quick, --json, --one-core; see bench --help)",
    )

    keygen = commands.add_parser("keygen", help="create or inspect TLS certificates")
    keygen.set_defaults(print_help=keygen.print_help)
    kinds = keygen.add_subparsers(dest="kind", metavar="KIND", parser_class=_Parser)

    ca = kinds.add_parser("ca", help="create a self-signed certificate authority")
    _add_output_flags(ca, "ca.crt", "ca.key")

    inst = kinds.add_parser("instance", help="create an instance certificate signed by a CA")
    inst.add_argument("--ca", metavar="FILE", help="CA certificate PEM (required)")
    inst.add_argument("--ca-key", metavar="FILE", help="CA private key PEM (required)")
    inst.add_argument(
        "--name", help="instance name: the subject CN and the first DNS SAN (required)"
    )
    _add_output_flags(inst, "<name>.crt", "<name>.key")
    inst.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="extra subject alternative name: a DNS name or an IP address, optionally "
        "prefixed DNS: or IP:; repeatable. An IP SAN is added by itself when the name "
        "is an IP address (or the host of a host:port name)",
    )

    inspect = kinds.add_parser("inspect", help="describe the certificates in a file")
    inspect.add_argument("file", metavar="FILE", help="certificate file (PEM or DER)")

    _add_operator_commands(commands)
    return parser


def _add_operator_commands(commands: Any) -> None:
    def command(name: str, func: Callable[[argparse.Namespace], int], **kw: Any) -> _Parser:
        sub: _Parser = commands.add_parser(name, **kw)
        sub.ops = True
        sub.set_defaults(func=func)
        return sub

    config_help = "configuration file (YAML) of the messenger"

    pub = command(
        "pub",
        _cmd_pub,
        help="publish a message (or JSON lines from stdin)",
        description="Publishes JSON to CHANNEL and prints each message id once committed. "
        "Without JSON, every line of stdin is one payload (lines available together are "
        "published as one batch: all or none).",
    )
    pub.add_argument("--config", required=True, metavar="F", help=config_help)
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

    sub = command(
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
    sub.add_argument("--config", required=True, metavar="F", help=config_help)
    how = sub.add_mutually_exclusive_group()
    how.add_argument("--id", metavar="ID", help="durable subscriber id")
    how.add_argument("--ephemeral", action="store_true", help="live messages through the first hub")
    sub.add_argument("--count", type=_non_negative_int, metavar="N", help="stop after N messages")
    sub.add_argument("--timeout", type=_positive_float, metavar="S", help="stop after S seconds")
    sub.add_argument("channel", metavar="CHANNEL")

    tail = command(
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
        type=_non_negative_int,
        default=DEFAULT_TAIL_LINES,
        metavar="N",
        help=f"print the last N messages (default {DEFAULT_TAIL_LINES})",
    )
    tail.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new messages until Ctrl-C / SIGTERM",
    )
    tail.add_argument("channel", metavar="CHANNEL")

    stats = command(
        "stats",
        _cmd_stats,
        help="show channels, subscribers and their lag",
        description="Opens the data directory (it must not be held by a running "
        "messenger: that one serves the same figures on metrics.listen_addr) and prints "
        "per channel its size and per subscriber its lag. Counters and latencies count "
        "from the moment a messenger opened, so they are zero here.",
    )
    stats.add_argument("--config", required=True, metavar="F", help=config_help)
    stats.add_argument("--json", action="store_true", help="print the snapshot as JSON")

    dead = commands.add_parser(
        "dead-letters",
        help="list or replay the dead letters of a channel",
        description="'dead-letters --data-dir D CHANNEL' lists; 'dead-letters replay ...' "
        "republishes.",
    )
    dead.ops = True
    dead.set_defaults(print_help=dead.print_help, kind=None)
    actions = dead.add_subparsers(dest="kind", metavar="ACTION", parser_class=_OpsParser)
    listing: _OpsParser = actions.add_parser(
        "list",
        help="list the dead letters of CHANNEL (the default action)",
        description="Lists the records of CHANNEL.dead-letter: id, failed_at, retries, "
        "original id, last_error, and the id it was replayed as (if it was).",
    )
    listing.set_defaults(func=_cmd_dead_letters)
    listing.add_argument("--data-dir", required=True, metavar="D", help="the data directory")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument("channel", metavar="CHANNEL")
    replay: _OpsParser = actions.add_parser(
        "replay",
        help="republish dead letters onto their channel",
        description="Republishes the original payload_type, payload, service_name and "
        "correlation_id of dead letters of CHANNEL onto CHANNEL (new message ids). Each "
        "replay is recorded in subscribers/CHANNEL.dead-letter/replayed.jsonl, and dead "
        "letters recorded there are not replayed again (unless --force).",
    )
    replay.set_defaults(func=_cmd_replay)
    replay.add_argument("--config", required=True, metavar="F", help=config_help)
    replay.add_argument(
        "--id",
        dest="ids",
        action="append",
        default=[],
        metavar="ID",
        help="replay only this dead letter (its id or its original's id); repeatable",
    )
    replay.add_argument(
        "--force", action="store_true", help="replay dead letters already replayed, too"
    )
    replay.add_argument("channel", metavar="CHANNEL")


def _missing_required(args: argparse.Namespace) -> None:
    """Fails as cobra does when required flags of ``keygen instance`` are absent."""
    missing = [flag for flag in ("ca", "ca_key", "name") if getattr(args, flag) is None]
    if missing:
        names = ", ".join(f'"{flag.replace("_", "-")}"' for flag in missing)
        raise _UsageError(f"required flag(s) {names} not set")


def _run(args: argparse.Namespace) -> int:
    if args.command == "version":
        from . import __version__

        print(f"version: {__version__}")
        return 0
    if args.func is not None:
        return int(args.func(args))
    if args.command is None or args.kind is None:
        args.print_help()
        return 0

    from . import _core

    if args.kind == "ca":
        summary = _core.keygen_ca(
            args.out_cert or "ca.crt", args.out_key or "ca.key", args.days, args.force
        )
    elif args.kind == "instance":
        _missing_required(args)
        summary = _core.keygen_instance(
            args.ca,
            args.ca_key,
            args.name,
            out_cert=args.out_cert,
            out_key=args.out_key,
            days=args.days,
            force=args.force,
            sans=args.san,
        )
    else:
        summary = _core.inspect_cert(args.file)
    print(summary)
    return 0


# ---------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------


class _Out:
    """Thread-safe line output to stdout, flushed per line."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            try:
                self._stream.write(text + "\n")
                self._stream.flush()
            except BrokenPipeError:
                raise _PipeClosed() from None

    def json(self, doc: Any) -> None:
        self.line(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))


class _Progress:
    """``label: N`` on stderr, rewritten in place at most 4 times a second, only
    when stderr is a terminal; :meth:`done` prints the final summary line."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self.count = 0

    def add(self, n: int = 1) -> None:
        self.count += n
        now = time.monotonic()
        if self._tty and now - self._last >= PROGRESS_INTERVAL_S:
            self._last = now
            sys.stderr.write(f"\r{self._label}: {self.count}")
            sys.stderr.flush()

    def clear(self) -> None:
        """Erases the progress line (before a summary or an error)."""
        if self._tty and self._last:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._last = 0.0

    def done(self, summary: str) -> None:
        self.clear()
        sys.stderr.write(summary + "\n")
        sys.stderr.flush()


def _rfc3339_nanos(ns: int) -> str:
    """RFC 3339 UTC with the fraction's trailing zeros trimmed (the envelope format)."""
    secs, frac = divmod(ns, 1_000_000_000)
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    text = (epoch + datetime.timedelta(seconds=secs)).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        text += "." + f"{frac:09d}".rstrip("0")
    return text + "Z"


def _rfc3339(dt: datetime.datetime) -> str:
    dt = dt.astimezone(datetime.timezone.utc)
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    if dt.microsecond:
        text += "." + f"{dt.microsecond:06d}".rstrip("0")
    return text + "Z"


def _message_doc(msg: Message, offset: int | None = None) -> dict[str, Any]:
    """The JSON object printed for one message."""
    raw_ts = getattr(msg, "_ts", None)  # nanoseconds, until first converted
    ts = _rfc3339_nanos(raw_ts) if isinstance(raw_ts, int) else _rfc3339(msg.timestamp)
    doc: dict[str, Any] = {} if offset is None else {"offset": offset}
    doc.update(
        id=msg.id,
        ts=ts,
        channel=msg.channel,
        origin=msg.origin,
        payload_type=msg.payload_type,
        payload=msg.payload,
        service_name=msg.service_name,
        correlation_id=msg.correlation_id,
    )
    return doc


# ---------------------------------------------------------------------------
# Opening messengers
# ---------------------------------------------------------------------------


def _load(path: str) -> Config:
    from .config import load_config

    return load_config(path)


def _local_only(config: Config) -> Config:
    """``config`` with federation and the metrics listener off: a command
    works on the data directory only (anything to forward is read from the
    files by the application's own messenger later)."""
    changes: dict[str, Any] = {
        "hub": dataclasses.replace(config.hub, enabled=False),
        "client": dataclasses.replace(config.client, enabled=False),
    }
    metrics: Any = getattr(config, "metrics", None)  # the metrics section, if known
    if metrics is not None:
        changes["metrics"] = dataclasses.replace(metrics, listen_addr="")
    return dataclasses.replace(config, **changes)


def _open_local(config_path: str, hint: str = "") -> Messenger:
    """A messenger on the configuration's data directory (federation off);
    a held data directory becomes one clear error line."""
    from .errors import DataDirLockedError
    from .messenger import Messenger

    config = _local_only(_load(config_path))
    try:
        return Messenger(config)
    except DataDirLockedError as err:
        if hint:
            raise _CommandError(f"{err} ({hint})") from err
        raise


def _ephemeral_config(config: Config, subscribe: list[str] | None = None) -> Config:
    from .errors import ConfigError

    if not config.client.hubs:
        raise ConfigError(["client.hubs: --ephemeral needs a hub in client.hubs"])
    if subscribe is None:
        return config
    first = dataclasses.replace(config.client.hubs[0], subscribe=subscribe)
    client = dataclasses.replace(config.client, hubs=[first, *config.client.hubs[1:]])
    return dataclasses.replace(config, client=client)


# ---------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def _handle_sigterm() -> None:
    """SIGTERM interrupts the main thread like Ctrl-C (clean shutdown)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


# ---------------------------------------------------------------------------
# pub
# ---------------------------------------------------------------------------


def _parse_json(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _CommandError(f"{where}: invalid JSON: {exc}") from None


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
                raise _CommandError(f"stdin line {line_no}: invalid JSON: {exc}") from None
            batch.append((payload_type, payload))
            size += len(raw)
            if len(batch) >= PUB_BATCH_ITEMS or size >= PUB_BATCH_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def _cmd_pub(args: argparse.Namespace) -> int:
    config = _load(args.config)
    out = _Out()
    meta = {"service_name": args.service_name, "correlation_id": args.correlation_id}
    publisher: Any
    if args.ephemeral:
        from .ephemeral import EphemeralMessenger

        publisher = EphemeralMessenger(_ephemeral_config(config))  # connects in ``with``
    else:
        publisher = _open_local(args.config, "use --ephemeral to publish through a hub")
    with publisher:
        if args.json is not None:
            payload = _parse_json(args.json, "JSON argument")
            out.line(publisher.publish(args.channel, args.payload_type, payload, **meta))
            return 0
        progress = _Progress(f"published to {args.channel}")
        try:
            for batch in _stdin_batches(args.payload_type):
                for msg_id in publisher.publish_batch(args.channel, batch, **meta):
                    out.line(msg_id)
                progress.add(len(batch))
        except _CommandError as err:
            raise _CommandError(f"{err} ({progress.count} published before it)") from None
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
        return not any(isinstance(a, (_StopDelivery, _PipeClosed)) for a in args)


def _cmd_sub(args: argparse.Namespace) -> int:
    config = _load(args.config)
    out = _Out()
    lock = threading.Lock()
    done = threading.Event()
    state = {"count": 0, "pipe_closed": False}
    limit: int | None = args.count

    refuse = not args.ephemeral  # durable delivery: leave the rest unacknowledged

    def handler(msg: Message) -> None:
        with lock:
            if done.is_set():
                if refuse:
                    raise _StopDelivery()  # a later subscriber with the id gets it
                return
            try:
                out.json(_message_doc(msg))
            except _PipeClosed:
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
    _handle_sigterm()
    silence = _Silence()
    log.addFilter(silence)
    try:
        if args.ephemeral:
            from .ephemeral import EphemeralMessenger

            with EphemeralMessenger(_ephemeral_config(config, [args.channel])) as eph:
                eph.subscribe(args.channel, handler)
                _wait(done, args.timeout)
        else:
            m = _open_local(args.config, "use --ephemeral to subscribe through a hub")
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
        raise _PipeClosed()
    if limit is not None and state["count"] < limit:
        raise _CommandError(
            f"timed out after {args.timeout:g} s: received {state['count']} of {limit} messages"
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


def _check_data_dir(data_dir: Path) -> None:
    if not (data_dir / "channels").is_dir():
        raise _CommandError(f"{data_dir}: not a keyop data directory (no channels/ folder)")


def _segment_starts(channel_dir: Path) -> list[int]:
    starts = []
    for path in channel_dir.glob("*.jsonl"):
        if path.stem.isdigit():
            starts.append(int(path.stem))
    return sorted(starts)


def _last_records(data_dir: Path, channel: str, n: int) -> tuple[list[tuple[Any, ...]], int]:
    """The last ``n`` rows of ``channel`` and the offset after them. Reads
    from the last segment back only as far as needed."""
    from . import _core

    starts = _segment_starts(data_dir / "channels" / channel) or [0]
    for index in range(len(starts) - 1, -1, -1):
        rows = _core.read_channel(os.fspath(data_dir), channel, starts[index])
        last = deque(rows, maxlen=n)
        if len(last) >= n or index == 0:
            return list(last), rows.position
    raise AssertionError("unreachable")


def _cmd_tail(args: argparse.Namespace) -> int:
    from . import _core
    from .message import entry_from_row

    data_dir = Path(args.data_dir)
    channel: str = args.channel
    _check_data_dir(data_dir)
    if not (data_dir / "channels" / channel).is_dir() and not args.follow:
        list(_core.read_channel(os.fspath(data_dir), channel, 0))  # InvalidNameError first
        raise _CommandError(f"no channel {channel!r} in {data_dir}")
    out = _Out()

    def emit(row: tuple[Any, ...]) -> None:
        entry = entry_from_row(row, None)
        out.json(_message_doc(entry.message, entry.offset))

    _handle_sigterm()
    try:
        rows, position = _last_records(data_dir, channel, args.lines)
        for row in rows:
            emit(row)
        sleep = 0.05
        while args.follow:
            it = _core.read_channel(os.fspath(data_dir), channel, position)
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


# ---------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return _rfc3339(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _table(rows: Sequence[Sequence[Any]], right: set[int]) -> list[str]:
    """Rows as aligned text columns (``right``: indexes aligned to the right)."""
    texts = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in texts) for i in range(len(texts[0]))]
    lines = []
    for r in texts:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _cmd_stats(args: argparse.Namespace) -> int:
    m = _open_local(
        args.config,
        "a running messenger serves its statistics on metrics.listen_addr",
    )
    with m:
        stats = m.stats()
    out = _Out()
    if args.json:
        out.line(json.dumps(dataclasses.asdict(stats), default=_json_default, indent=2))
        return 0
    t = stats.totals
    rows: list[list[Any]] = [["CHANNEL", "STREAM BYTES", "DISK BYTES", "SUBSCRIBERS", "MAX LAG"]]
    for c in stats.channels:
        max_lag = max((s.lag_bytes for s in c.subscribers), default=0)
        rows.append([c.name, c.stream_bytes, c.disk_bytes, len(c.subscribers), max_lag])
    rows.append([f"total ({t.channels} channels)", t.stream_bytes, t.disk_bytes, t.subscribers, ""])
    for text in _table(rows, {1, 2, 3, 4}):
        out.line(text)
    subs = [(c.name, s) for c in stats.channels for s in c.subscribers]
    if subs:
        out.line("")
        rows = [["CHANNEL", "SUBSCRIBER", "LAG BYTES", "OLDEST PENDING", "STATE"]]
        for name, s in subs:
            pending = _rfc3339(s.oldest_pending) if s.oldest_pending else "-"
            rows.append([name, s.id, s.lag_bytes, pending, "active" if s.active else "idle"])
        for text in _table(rows, {2}):
            out.line(text)
    fed = stats.federation
    if fed.links:
        out.line("")
        rows = [["HUB", "CONNECTED", "RECONNECTS", "UNACKED BYTES", "RTT P50 MS", "RTT P99 MS"]]
        for link in fed.links:
            rows.append(
                [
                    link.addr,
                    "yes" if link.connected else "no",
                    link.reconnects,
                    link.unacked_bytes,
                    f"{link.rtt_p50_us / 1000:.2f}",
                    f"{link.rtt_p99_us / 1000:.2f}",
                ]
            )
        for text in _table(rows, {2, 3, 4, 5}):
            out.line(text)
    if fed.listener is not None:
        lst = fed.listener
        out.line("")
        out.line(
            f"hub {lst.listen_addr}: {len(lst.peers)} peers, {lst.records_received} "
            f"records received, {lst.connections_accepted} connections accepted, "
            f"{lst.connections_rejected} rejected"
        )
    return 0


# ---------------------------------------------------------------------------
# dead-letters
# ---------------------------------------------------------------------------


def _base_channel(channel: str) -> str:
    return channel[: -len(DEAD_LETTER_SUFFIX)] if channel.endswith(DEAD_LETTER_SUFFIX) else channel


def _replay_log_path(data_dir: Path, channel: str) -> Path:
    return data_dir / "subscribers" / f"{channel}{DEAD_LETTER_SUFFIX}" / REPLAY_LOG


def _replayed(data_dir: Path, channel: str) -> dict[str, str]:
    """Dead-letter id -> id it was replayed as, from the replay log."""
    path = _replay_log_path(data_dir, channel)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    done: dict[str, str] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
            done[record["dead_letter_id"]] = record["new_id"]
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line
    return done


def _dead_letters(data_dir: Path, channel: str) -> list[Message]:
    from .messenger import read_channel

    dl_channel = channel + DEAD_LETTER_SUFFIX
    return [entry.message for entry in read_channel(data_dir, dl_channel)]


def _dead_letter_fields(msg: Message) -> dict[str, Any]:
    payload: dict[str, Any] = msg.payload if isinstance(msg.payload, dict) else {}
    original: dict[str, Any] = payload.get("original") or {}
    if not isinstance(original, dict):
        original = {}
    return {
        "id": msg.id,
        "failed_at": payload.get("failed_at"),
        "retries": payload.get("retries"),
        "last_error": payload.get("last_error"),
        "original_id": original.get("id"),
        "original_payload_type": original.get("payload_type"),
    }


def _cmd_dead_letters(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir)
    channel = _base_channel(args.channel)
    _check_data_dir(data_dir)
    letters = _dead_letters(data_dir, channel)
    replayed = _replayed(data_dir, channel)
    out = _Out()
    docs = []
    for msg in letters:
        doc = _dead_letter_fields(msg)
        doc["replayed_as"] = replayed.get(msg.id)
        docs.append(doc)
    if args.json:
        for doc in docs:
            out.json(doc)
    elif docs:
        rows: list[list[Any]] = [
            ["ID", "FAILED AT", "RETRIES", "ORIGINAL ID", "REPLAYED AS", "LAST ERROR"]
        ]
        for d in docs:
            error = " ".join(str(d["last_error"] or "").split())
            rows.append(
                [
                    d["id"],
                    d["failed_at"] or "-",
                    d["retries"],
                    d["original_id"] or "-",
                    d["replayed_as"] or "-",
                    error,
                ]
            )
        for text in _table(rows, {2}):
            out.line(text)
    pending = sum(1 for d in docs if d["replayed_as"] is None)
    noun = "dead letter" if len(docs) == 1 else "dead letters"
    print(f"{len(docs)} {noun} of {channel} ({pending} not replayed)", file=sys.stderr)
    return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cmd_replay(args: argparse.Namespace) -> int:
    channel = _base_channel(args.channel)
    m = _open_local(args.config, "stop it first: replay publishes into the data directory")
    with m:
        data_dir = Path(m.config.storage.data_dir)
        letters = [e.message for e in m.read_channel(channel + DEAD_LETTER_SUFFIX)]
        if args.ids:
            wanted = set(args.ids)
            letters = [
                msg
                for msg in letters
                if msg.id in wanted or _dead_letter_fields(msg)["original_id"] in wanted
            ]
            found = {msg.id for msg in letters} | {
                _dead_letter_fields(msg)["original_id"] for msg in letters
            }
            missing = sorted(wanted - found)
            if missing:
                raise _CommandError(
                    f"no dead letter of {channel} with id {', '.join(missing)} (nothing replayed)"
                )
        done = {} if args.force else _replayed(data_dir, channel)
        log_path = _replay_log_path(data_dir, channel)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        new_log = not log_path.exists()
        out = _Out()
        progress = _Progress(f"replayed to {channel}")
        already = invalid = 0
        try:
            with open(log_path, "a", encoding="utf-8") as replay_log:
                if new_log:
                    _fsync_dir(log_path.parent)
                for msg in letters:
                    if msg.id in done:
                        already += 1
                        continue
                    payload = msg.payload if isinstance(msg.payload, dict) else {}
                    original = payload.get("original")
                    if msg.payload_type != DEAD_LETTER_PAYLOAD_TYPE or not (
                        isinstance(original, dict) and isinstance(original.get("payload_type"), str)
                    ):
                        print(f"skipping {msg.id}: not a dead-letter record", file=sys.stderr)
                        invalid += 1
                        continue
                    new_id = m.publish(
                        channel,
                        original["payload_type"],
                        original.get("payload"),
                        service_name=original.get("service_name"),
                        correlation_id=original.get("correlation_id"),
                    )
                    record = {
                        "dead_letter_id": msg.id,
                        "original_id": original.get("id"),
                        "new_id": new_id,
                        "replayed_at": _rfc3339(datetime.datetime.now(datetime.timezone.utc)),
                    }
                    replay_log.write(json.dumps(record, separators=(",", ":")) + "\n")
                    replay_log.flush()
                    os.fsync(replay_log.fileno())
                    out.json(record)
                    progress.add()
        finally:
            progress.clear()
    noun = "dead letter" if progress.count == 1 else "dead letters"
    notes = [f"{already} skipped: already replayed"] if already else []
    notes += [f"{invalid} skipped: not dead-letter records"] if invalid else []
    extra = f" ({'; '.join(notes)})" if notes else ""
    progress.done(f"replayed {progress.count} {noun} to {channel}{extra}")
    return 0


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def _normalise(argv: list[str]) -> list[str]:
    """``dead-letters --data-dir D CHANNEL`` means ``dead-letters list ...``."""
    if argv[:1] == ["dead-letters"] and len(argv) > 1:
        if argv[1] not in ("list", "replay", "-h", "--help"):
            return ["dead-letters", "list", *argv[1:]]
    return argv


def _one_line(err: BaseException) -> str:
    from .errors import ConfigError

    if isinstance(err, ConfigError) and len(err.problems) > 1:
        return "invalid configuration: " + "; ".join(err.problems)
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from .errors import KeyopError

    parser = _build_parser()
    args_list = _normalise(list(sys.argv[1:] if argv is None else argv))
    if args_list[:1] == ["bench"]:
        from . import bench

        return bench.main(args_list[1:])
    try:
        args = parser.parse_args(args_list)
        return _run(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except _PipeClosed:
        # The reader went away (``| head``): not an error; stop writing to the pipe.
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), sys.stdout.fileno())
        return 0
    except _OpsUsageError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    except (_UsageError, _CommandError, KeyopError, OSError) as err:
        print(f"Error: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
