"""A hub gives memory back after a flood (hostile-input issue, item 5).

After a flood of connections (half of them stuck in the TLS handshake, half
upgraded and silent) or a burst of large records has ended, the hub's
resident set size returns near what it was before: per-connection buffers
are small and bounded, the dedup window is bounded in bytes, and freed heap
memory is handed back to the system.

The hub runs in a child process (hub_flood.HubProcess); its RSS is read
from /proc/PID/status (VmRSS) after a warm-up (so one-time allocations are
in the baseline) and again, polling for a bounded time, after the flood.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import fed_helpers
from fed_helpers import PKI, stored_ids
from hub_flood import Flood, HubProcess, round_trip, send_binary_fast

pki = fed_helpers.pki

#: How far above its baseline the hub's RSS may stay once a flood of
#: connections ended (it used to stay at 3.8 times).
FACTOR = 2.0
#: The same after large records. Measured on a debug build: back to within
#: 1 % of the baseline; it used to stay 1.2 to 2 times above (4 MiB buffers
#: kept in glibc's thread arenas), which the 2x bound would not see.
LARGE_FACTOR = 1.1
#: Bound on the wait for the RSS to come back down.
RSS_WAIT_S = 30.0
#: A record as large as max_batch_bytes (4 MiB) allows, minus the envelope.
LARGE_PAYLOAD = 4 * 1024 * 1024 - 512
#: The burst of large records: this many peers at once, each sending this many.
PUBLISHERS, RECORDS_EACH = 4, 4


def warm_up(hub: HubProcess, pki: PKI) -> int:
    """A few round trips and a small flood of each kind, then the RSS (KiB)
    once it stopped moving."""
    for _ in range(3):
        round_trip(pki, hub.port, "node2")
    round_trip(pki, hub.port, "node2", payload={"blob": "x" * LARGE_PAYLOAD}, send=send_binary_fast)
    with Flood(hub.port, "tls", 20) as a, Flood(hub.port, "ws", 20, pki=pki) as b:
        a.open_all()
        b.open_all()
    return settled_rss(hub)


def settled_rss(hub: HubProcess, quiet_s: float = 2.0) -> int:
    """The RSS once two readings ``quiet_s`` apart differ by under 5 %
    (bounded by RSS_WAIT_S)."""
    deadline = time.monotonic() + RSS_WAIT_S
    last = hub.rss_kib()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = hub.rss_kib()
        if abs(now - last) <= last * 0.05:
            return now
        last = now
    return last


def assert_comes_back(hub: HubProcess, before: int, peak: int, factor: float) -> None:
    """Polls (bounded) until the RSS is within ``factor`` of ``before``."""
    deadline = time.monotonic() + RSS_WAIT_S
    now = hub.rss_kib()
    while now > before * factor and time.monotonic() < deadline:
        time.sleep(0.5)
        now = hub.rss_kib()
    print(f"hub RSS: before {before} KiB, peak {peak} KiB, after {now} KiB")
    assert now <= before * factor, (
        f"hub RSS {now} KiB, {RSS_WAIT_S:.0f}s after the flood ended: "
        f"before {before} KiB, peak {peak} KiB"
    )


def test_rss_comes_back_after_a_connection_flood(pki: PKI, tmp_path: Path) -> None:
    with HubProcess(pki, tmp_path / "hub") as hub:
        before = warm_up(hub, pki)
        with (
            Flood(hub.port, "tls", 550) as half_open,
            Flood(hub.port, "ws", 550, pki=pki, workers=8) as idle,
        ):
            half_open.open_all()
            idle.open_all()
            peak = hub.rss_kib()
            tried = half_open.opened + half_open.failed + idle.opened + idle.failed
            assert tried >= 1100
        assert_comes_back(hub, before, peak, FACTOR)
        # And it still serves.
        rid = round_trip(pki, hub.port, "node2")
        assert rid in stored_ids(tmp_path / "hub", "temps")


def test_rss_comes_back_after_large_records(pki: PKI, tmp_path: Path) -> None:
    with HubProcess(pki, tmp_path / "hub") as hub:
        before = warm_up(hub, pki)
        ids: list[str] = []
        errors: list[BaseException] = []
        blob = {"blob": "y" * LARGE_PAYLOAD}

        def publisher() -> None:
            try:
                for _ in range(RECORDS_EACH):
                    ids.append(
                        round_trip(
                            pki, hub.port, "node2", payload=blob, ephemeral=True,
                            send=send_binary_fast, timeout=60,
                        )
                    )  # fmt: skip
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=publisher) for _ in range(PUBLISHERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a publisher did not finish"
        assert errors == [], errors
        peak = hub.rss_kib()
        assert len(ids) == PUBLISHERS * RECORDS_EACH
        assert set(ids) <= set(stored_ids(tmp_path / "hub", "temps"))
        assert_comes_back(hub, before, peak, LARGE_FACTOR)
