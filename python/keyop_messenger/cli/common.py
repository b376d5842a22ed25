"""What every command of the ``keyop-messenger`` CLI shares: errors, parsers,
output, opening a messenger from a configuration file, and SIGTERM handling."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

if TYPE_CHECKING:
    from ..config import Config
    from ..message import Message
    from ..messenger import Messenger

#: Seconds between progress updates on a terminal.
PROGRESS_INTERVAL_S = 0.25

log = logging.getLogger("keyop_messenger")


class UsageError(Exception):
    """A command-line error: printed as ``Error: <message>``, exit status 1."""


class OpsUsageError(UsageError):
    """A usage error of an operator command: exit status 2, as argparse's."""


class CommandError(Exception):
    """A failure of an operator command: ``Error: <message>``, exit status 1."""


class PipeClosed(Exception):
    """stdout was closed by the reader (``| head``)."""


class Parser(argparse.ArgumentParser):
    """An argument parser that reports errors the way the 1.4 command does
    (exit status 1); operator commands set ``ops`` for argparse's status 2."""

    ops = False

    def error(self, message: str) -> NoReturn:
        """Raises the usage error (status 2 for operator commands, else 1) rather than exiting."""
        if self.ops:
            raise OpsUsageError(f"{self.prog}: {message} (see {self.prog} --help)")
        raise UsageError(message)


class OpsParser(Parser):
    """Parser of the operator commands: usage errors exit with status 2."""

    ops = True


#: Names of the operator commands (see :func:`ops_command`).
OPS_COMMANDS: set[str] = set()


def ops_command(
    commands: Any, name: str, func: Callable[[argparse.Namespace], int], **kw: Any
) -> Parser:
    """Adds operator command ``name`` (usage errors exit with status 2) running ``func``."""
    sub: Parser = commands.add_parser(name, **kw)
    sub.ops = True
    OPS_COMMANDS.add(name)
    sub.set_defaults(func=func)
    return sub


#: Help text of every ``--config`` option.
CONFIG_HELP = "configuration file (YAML) of the messenger"


def non_negative_int(text: str) -> int:
    """Parses a whole number >= 0 (an argparse ``type``)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


non_negative_int.__name__ = "non-negative integer"


def positive_float(text: str) -> float:
    """Parses a number > 0 (an argparse ``type``)."""
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


positive_float.__name__ = "positive number"


# ---------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------


class Out:
    """Thread-safe line output to stdout, flushed per line."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """Writes ``text`` and a line break, then flushes; a closed pipe raises ``PipeClosed``."""
        with self._lock:
            try:
                self._stream.write(text + "\n")
                self._stream.flush()
            except BrokenPipeError:
                raise PipeClosed() from None

    def json(self, doc: Any) -> None:
        """Writes ``doc`` as one compact JSON line; text stdout cannot encode
        (a lone surrogate from a record another writer stored) is written as
        JSON escapes, so the line still decodes to the same document."""
        try:
            self.line(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))
        except UnicodeEncodeError:
            self.line(json.dumps(doc, ensure_ascii=True, separators=(",", ":")))


class Progress:
    """``label: N`` on stderr, rewritten in place at most 4 times a second, only
    when stderr is a terminal; :meth:`done` prints the final summary line."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self.count = 0

    def add(self, n: int = 1) -> None:
        """Counts ``n`` more items and redraws the line if a quarter second has passed."""
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
        """Erases the progress line and prints ``summary`` on stderr."""
        self.clear()
        sys.stderr.write(summary + "\n")
        sys.stderr.flush()


def rfc3339_nanos(ns: int) -> str:
    """RFC 3339 UTC with the fraction's trailing zeros trimmed (the envelope format)."""
    secs, frac = divmod(ns, 1_000_000_000)
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    text = (epoch + datetime.timedelta(seconds=secs)).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        text += "." + f"{frac:09d}".rstrip("0")
    return text + "Z"


def rfc3339(dt: datetime.datetime) -> str:
    """``dt`` as RFC 3339 UTC with the fraction's trailing zeros trimmed (microseconds)."""
    dt = dt.astimezone(datetime.timezone.utc)
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    if dt.microsecond:
        text += "." + f"{dt.microsecond:06d}".rstrip("0")
    return text + "Z"


def message_doc(msg: Message, offset: int | None = None) -> dict[str, Any]:
    """The JSON object printed for one message."""
    raw_ts = getattr(msg, "_ts", None)  # nanoseconds, until first converted
    ts = rfc3339_nanos(raw_ts) if isinstance(raw_ts, int) else rfc3339(msg.timestamp)
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


def table(rows: Sequence[Sequence[Any]], right: set[int]) -> list[str]:
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


# ---------------------------------------------------------------------------
# Opening messengers
# ---------------------------------------------------------------------------


def load(path: str, overrides: Sequence[str] = ()) -> Config:
    """The configuration file ``path`` as every command reads it: relative paths
    relative to the file's folder, ``KEYOP_<SECTION>__<KEY>`` environment
    variables and then ``overrides`` (``section.key=value``) over its keys."""
    import os

    from ..config import load_config

    return load_config(path, resolve_paths=True, environ=os.environ, overrides=overrides)


def local_only(config: Config) -> Config:
    """``config`` with federation, the gateway and the metrics listener off: a
    command works on the data directory only (anything to forward is read from
    the files by the application's own messenger later)."""
    changes: dict[str, Any] = {
        "hub": dataclasses.replace(config.hub, enabled=False),
        "client": dataclasses.replace(config.client, enabled=False),
        "gateway": dataclasses.replace(config.gateway, enabled=False),
    }
    metrics: Any = getattr(config, "metrics", None)  # the metrics section, if known
    if metrics is not None:
        changes["metrics"] = dataclasses.replace(metrics, listen_addr="")
    return dataclasses.replace(config, **changes)


def open_local(config_path: str, hint: str = "", *, existing: bool = False) -> Messenger:
    """A messenger on the configuration's data directory (federation off);
    a held data directory becomes one clear error line. With ``existing``
    the data directory must exist already (it is not created): else
    :class:`DataDirNotFoundError`."""
    from ..errors import DataDirLockedError
    from ..messenger import Messenger

    full = load(config_path)
    config = local_only(full)
    if existing:
        check_data_dir(Path(config.storage.data_dir))
    try:
        m = Messenger(config)
    except DataDirLockedError as err:
        pid = lock_holder(config.storage.data_dir)
        held = f" (held by process {pid})" if pid is not None else ""
        raise CommandError(f"{err}{held}" + (f" ({hint})" if hint else "")) from err
    if full.client.enabled and full.client.hubs:
        # The client links do not run here, but what is published now must be
        # forwarded once they do: their cursors start here if they are new.
        hubs = [dataclasses.asdict(h) for h in full.client.hubs]
        try:
            m._engine.create_client_cursors(json.dumps(hubs))
        except BaseException:
            m.close()
            raise
    return m


def lock_holder(data_dir: str) -> int | None:
    """The process holding the flock of ``data_dir``'s lock file, from
    ``/proc/locks`` (Linux); None when it cannot be told."""
    import os

    try:
        st = os.stat(os.path.join(data_dir, "keyop.lock"))
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:10094676 0 EOF" ("->" marks waiters)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == wanted:
            try:
                pid = int(parts[4])
            except ValueError:
                continue
            if pid > 0:
                return pid
    return None


def ephemeral_config(config: Config, subscribe: list[str] | None = None) -> Config:
    """``config`` for an ephemeral client: its first hub entry, subscribing to ``subscribe`` when
    given."""
    from ..errors import ConfigError

    if not config.client.hubs:
        raise ConfigError(
            [
                "client.hubs: --ephemeral goes through client.hubs[0], and this configuration "
                "has none: use the configuration of a client of the hub (a hub's own data "
                "directory is held by the running hub; its HTTP gateway, if enabled, also "
                "publishes into it)"
            ]
        )
    if subscribe is None:
        return config
    first = dataclasses.replace(config.client.hubs[0], subscribe=subscribe)
    client = dataclasses.replace(config.client, hubs=[first, *config.client.hubs[1:]])
    return dataclasses.replace(config, client=client)


def check_data_dir(data_dir: Path) -> None:
    """Raises :class:`DataDirNotFoundError` (exit status 2) if ``data_dir``
    does not exist, :class:`CommandError` if it is not a data directory."""
    from ..errors import DataDirNotFoundError

    if not data_dir.exists():
        raise DataDirNotFoundError(
            f"data directory {data_dir} does not exist (only opening a messenger creates one)"
        )
    if not (data_dir / "channels").is_dir():
        raise CommandError(f"{data_dir}: not a keyop data directory (no channels/ folder)")


# ---------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def handle_sigterm() -> None:
    """SIGTERM interrupts the main thread like Ctrl-C (clean shutdown)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
