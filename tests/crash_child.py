"""Child process of test_crash.py: publishes forever and prints each acknowledged id.

Usage: ``python crash_child.py <data_dir> <mode>`` with mode ``single`` (one
``publish`` per message) or ``batch`` (``publish_batch`` of 50). An id is
printed (and flushed) only after the call that published it returned, so
every printed id was acknowledged as committed. The parent kills this process
with SIGKILL at a random point.
"""

from __future__ import annotations

import sys

from keyop_messenger import Config, Messenger

CHANNEL = "crash"
BATCH_SIZE = 50
# Large enough that 1 MiB segments roll every ~250 messages.
BLOB = "c" * 4000


def publish_some(m: Messenger, mode: str, n: int) -> list[str]:
    """Publishes the next message(s), numbered from ``n``; returns their ids."""
    if mode == "single":
        return [m.publish(CHANNEL, "crash.Test", {"n": n, "blob": BLOB})]
    items = [("crash.Test", {"n": n + i, "blob": BLOB}) for i in range(BATCH_SIZE)]
    return m.publish_batch(CHANNEL, items)


def main(data_dir: str, mode: str) -> None:
    if mode not in ("single", "batch"):
        raise SystemExit(f"unknown mode {mode!r}; use 'single' or 'batch'")
    config = Config.from_dict(
        {
            "name": "crash-child",
            "storage": {
                "data_dir": data_dir,
                "sync_interval_ms": 0,
                "compaction_threshold_mb": 1,
            },
        }
    )
    with Messenger(config) as m:
        n = 0
        while True:
            ids = publish_some(m, mode, n)
            sys.stdout.write("".join(f"{mid}\n" for mid in ids))
            sys.stdout.flush()
            n += len(ids)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
