"""Child process of test_crash.py: publishes forever and prints each acknowledged id.

Usage: ``python crash_child.py <data_dir> <mode> [<deliveries_dir>]`` with mode
``single`` (one ``publish`` per message), ``batch`` (``publish_batch`` of 50),
or ``subscribed`` (``publish_batch`` of 50 while subscribers and compaction
run; needs ``deliveries_dir``). An id is printed (and flushed) only after the
call that published it returned, so every printed id was acknowledged as
committed. The parent kills this process with SIGKILL at a random point, or
where the engine stopped itself (``KEYOP_TEST_STOP_AT``, see the storage test
hooks).

In mode ``subscribed``, subscribers ``fast`` and ``slow`` (which sleeps a
little per message, so it lags) append each delivered id to
``<deliveries_dir>/<subscriber>.delivered``, one line written and flushed
before the handler returns: every line is a delivery whose handler call had
returned or was about to. Offsets are written after every delivered batch and
a thread runs a retention pass every few milliseconds, deleting the 1 MiB
segments both subscribers have passed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from keyop_messenger import Config, Message, Messenger

CHANNEL = "crash"
BATCH_SIZE = 50
SUBSCRIBERS = ("fast", "slow")
# Large enough that 1 MiB segments roll every ~250 messages.
BLOB = "c" * 4000
#: Mode ``subscribed``: pause after each batch (about 2,500 messages/s, so
#: both subscribers keep up on average and retention bounds the disk use),
#: pause of subscriber ``slow`` after every 10th message, and time between
#: retention passes (each pass deletes a few segments).
PUBLISH_PAUSE_S = 0.02
SLOW_PAUSE_S = 0.01
COMPACT_EVERY_S = 0.25


def publish_some(m: Messenger, mode: str, n: int) -> list[str]:
    """Publishes the next message(s), numbered from ``n``; returns their ids."""
    if mode == "single":
        return [m.publish(CHANNEL, "crash.Test", {"n": n, "blob": BLOB})]
    items = [("crash.Test", {"n": n + i, "blob": BLOB}) for i in range(BATCH_SIZE)]
    return m.publish_batch(CHANNEL, items)


def recorder(out: TextIO, pause: float) -> Callable[[Message], None]:
    """A handler writing each delivered id to ``out`` before it returns and
    sleeping ``pause`` after every 10th message."""
    count = 0

    def handle(msg: Message) -> None:
        nonlocal count
        out.write(msg.id + "\n")
        out.flush()
        count += 1
        if pause and count % 10 == 0:
            time.sleep(pause)

    return handle


def start_subscribers(m: Messenger, deliveries_dir: Path) -> None:
    for sub in SUBSCRIBERS:
        out = (deliveries_dir / f"{sub}.delivered").open("a", encoding="ascii")
        m.subscribe(CHANNEL, sub, recorder(out, SLOW_PAUSE_S if sub == "slow" else 0.0))


def compact_forever(m: Messenger) -> None:
    while True:
        m.compact()
        time.sleep(COMPACT_EVERY_S)


def main(data_dir: str, mode: str, deliveries_dir: str | None) -> None:
    if mode not in ("single", "batch", "subscribed"):
        raise SystemExit(f"unknown mode {mode!r}; use 'single', 'batch' or 'subscribed'")
    config = Config.from_dict(
        {
            "name": "crash-child",
            "storage": {
                "data_dir": data_dir,
                "sync_interval_ms": 0,
                "segment_size_mb": 1,
                "offset_flush_interval_ms": 0,
            },
        }
    )
    with Messenger(config) as m:
        if mode == "subscribed":
            if deliveries_dir is None:
                raise SystemExit("mode 'subscribed' needs <deliveries_dir>")
            start_subscribers(m, Path(deliveries_dir))
            threading.Thread(target=compact_forever, args=(m,), daemon=True).start()
        n = 0
        while True:
            ids = publish_some(m, "single" if mode == "single" else "batch", n)
            sys.stdout.write("".join(f"{mid}\n" for mid in ids))
            sys.stdout.flush()
            n += len(ids)
            if mode == "subscribed":
                time.sleep(PUBLISH_PAUSE_S)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
