"""``keyop-messenger dead-letters [list]`` and ``dead-letters replay``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import (
    CONFIG_HELP,
    CommandError,
    OpsParser,
    Out,
    Progress,
    check_data_dir,
    open_local,
    rfc3339,
    table,
)

if TYPE_CHECKING:
    from ..message import Message

DEAD_LETTER_SUFFIX = ".dead-letter"
DEAD_LETTER_PAYLOAD_TYPE = "com.keyop.messenger.DeadLetterPayload"
#: Replay log of ``dead-letters replay``, under ``subscribers/<channel>.dead-letter/``.
REPLAY_LOG = "replayed.jsonl"


def add_parsers(commands: Any) -> None:
    """Adds ``dead-letters`` with its actions ``list`` and ``replay`` to ``commands``."""
    dead = commands.add_parser(
        "dead-letters",
        help="list or replay the dead letters of a channel",
        description="'dead-letters --data-dir D CHANNEL' lists; 'dead-letters replay ...' "
        "republishes.",
    )
    dead.ops = True
    dead.set_defaults(print_help=dead.print_help, kind=None)
    actions = dead.add_subparsers(dest="kind", metavar="ACTION", parser_class=OpsParser)
    listing: OpsParser = actions.add_parser(
        "list",
        help="list the dead letters of CHANNEL (the default action)",
        description="Lists the records of CHANNEL.dead-letter: id, failed_at, retries, "
        "original id, last_error, and the id it was replayed as (if it was).",
    )
    listing.set_defaults(func=_cmd_dead_letters)
    listing.add_argument("--data-dir", required=True, metavar="D", help="the data directory")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument("channel", metavar="CHANNEL")
    replay: OpsParser = actions.add_parser(
        "replay",
        help="republish dead letters onto their channel",
        description="Republishes the original envelopes of dead letters of CHANNEL onto "
        "CHANNEL unchanged (same id, origin and timestamp; checked like any received record). "
        "Each "
        "replay is recorded in subscribers/CHANNEL.dead-letter/replayed.jsonl, and dead "
        "letters recorded there are not replayed again (unless --force).",
    )
    replay.set_defaults(func=_cmd_replay)
    replay.add_argument("--config", required=True, metavar="F", help=CONFIG_HELP)
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
    """The dead letters of ``channel``: none when it exists but nothing
    failed yet; :class:`ChannelNotFoundError` when ``channel`` does not exist."""
    from ..errors import ChannelNotFoundError
    from ..reading import read_channel

    dl_channel = channel + DEAD_LETTER_SUFFIX
    try:
        return [entry.message for entry in read_channel(data_dir, dl_channel)]
    except ChannelNotFoundError:
        read_channel(data_dir, channel)  # the channel itself must exist
        return []


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
        # An original too large to embed is named, and copied aside.
        "original_id": original.get("id") or payload.get("original_id"),
        "original_payload_type": original.get("payload_type"),
        "quarantine_file": payload.get("quarantine_file"),
    }


def _replayable(msg: Message) -> bool:
    """A dead letter carrying its original, or naming its copy (an original
    too large to embed; an unreadable record's copy is refused when read)."""
    if msg.payload_type != DEAD_LETTER_PAYLOAD_TYPE or not isinstance(msg.payload, dict):
        return False
    original = msg.payload.get("original")
    if isinstance(original, dict):
        return isinstance(original.get("payload_type"), str)
    return original is None and isinstance(msg.payload.get("original_id"), str)


def _cmd_dead_letters(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir)
    channel = _base_channel(args.channel)
    check_data_dir(data_dir)
    letters = _dead_letters(data_dir, channel)
    replayed = _replayed(data_dir, channel)
    out = Out()
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
        for text in table(rows, {2}):
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
    from ..errors import ChannelNotFoundError

    m = open_local(
        args.config, "stop it first: replay publishes into the data directory", existing=True
    )
    with m:
        data_dir = Path(m.config.storage.data_dir)
        try:
            entries = list(m.read_channel(channel + DEAD_LETTER_SUFFIX))
        except ChannelNotFoundError:
            m.read_channel(channel)  # the channel itself must exist
            entries = []
        if args.ids:
            wanted = set(args.ids)
            entries = [
                e
                for e in entries
                if e.message.id in wanted
                or _dead_letter_fields(e.message)["original_id"] in wanted
            ]
            found = {e.message.id for e in entries} | {
                _dead_letter_fields(e.message)["original_id"] for e in entries
            }
            missing = sorted(wanted - found)
            if missing:
                raise CommandError(
                    f"no dead letter of {channel} with id {', '.join(missing)} (nothing replayed)"
                )
        done = {} if args.force else _replayed(data_dir, channel)
        log_path = _replay_log_path(data_dir, channel)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        new_log = not log_path.exists()
        out = Out()
        progress = Progress(f"replayed to {channel}")
        already = invalid = 0
        try:
            with open(log_path, "a", encoding="utf-8") as replay_log:
                if new_log:
                    _fsync_dir(log_path.parent)
                for entry in entries:
                    msg = entry.message
                    if msg.id in done:
                        already += 1
                        continue
                    if not _replayable(msg):
                        copy = _dead_letter_fields(msg)["quarantine_file"]
                        why = (
                            f"its original was unreadable (its bytes are in {copy})"
                            if copy
                            else "not a dead-letter record"
                        )
                        print(f"skipping {msg.id}: {why}", file=sys.stderr)
                        invalid += 1
                        continue
                    # The original envelope as it was stored, byte for byte.
                    new_id = m._engine._replay_dead_letter(channel, entry.offset)
                    record = {
                        "dead_letter_id": msg.id,
                        "original_id": _dead_letter_fields(msg)["original_id"],
                        "new_id": new_id,
                        "replayed_at": rfc3339(datetime.datetime.now(datetime.timezone.utc)),
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
    notes += [f"{invalid} skipped: nothing to replay (see above)"] if invalid else []
    extra = f" ({'; '.join(notes)})" if notes else ""
    progress.done(f"replayed {progress.count} {noun} to {channel}{extra}")
    return 0
