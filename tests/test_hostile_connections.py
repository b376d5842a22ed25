"""Connection fairness of a hub under floods (hostile-input issue, item 3).

A flood of connections that never finish opening (TCP only, a TLS
ClientHello and nothing more, or an allowed peer's upgraded WebSocket with
no application handshake) must not keep another allowed peer out: the hub
caps unfinished connections apart from established ones and drops the
OLDEST unfinished one for a newcomer, limits the connections of one peer
(its oldest go), and when it runs out of file descriptors it drops an
unfinished connection and backs off instead of spinning.

The hub runs in a child process (hub_flood.HubProcess) so that the floods'
descriptors and its own limits stay apart from the test process. Each
flood re-opens, at a bounded pace, the connections the hub drops: an
attacker that keeps coming back.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, stored_ids, wait_until
from hub_flood import Flood, HubProcess, round_trip

pki = fed_helpers.pki

FLOOD = 1100


@pytest.fixture
def hub(pki: PKI, tmp_path: Path) -> HubProcess:
    with HubProcess(pki, tmp_path / "hub") as h:
        yield h


def settle(flood: Flood) -> None:
    """Waits (bounded) until the flood is re-opening connections the hub
    dropped, then lets it run a moment longer."""
    tried = flood.opened + flood.failed
    assert tried >= FLOOD, f"the flood tried only {tried} connections"
    wait_until(lambda: flood.reopened > 0, "the flood re-opening dropped connections")
    time.sleep(0.5)


@pytest.mark.parametrize("kind", ["tcp", "tls"])
def test_half_open_flood_does_not_keep_an_allowed_peer_out(
    hub: HubProcess, pki: PKI, tmp_path: Path, kind: str
) -> None:
    with Flood(hub.port, kind, FLOOD) as flood:  # type: ignore[arg-type]
        flood.open_all()
        flood.start()
        settle(flood)
        rid = round_trip(pki, hub.port, "node2")
    assert rid in stored_ids(tmp_path / "hub", "temps")
    assert hub.alive()
    # The connections dropped to make room are counted for the operator: of
    # the 1,100 opened at first, at most 256 may be opening at once.
    evicted = hub.metric('keyop_hub_connections_failed_total{stage="evicted"}')
    assert evicted > FLOOD // 2, (evicted, flood.opened)


@pytest.mark.parametrize("kind", ["ws", "link"])
def test_idle_links_of_one_peer_do_not_starve_another(
    hub: HubProcess, pki: PKI, tmp_path: Path, kind: str
) -> None:
    """``ws``: upgraded, no application handshake (the hub's handshake
    timeout ends them after 10 s, so the flood must keep re-opening);
    ``link``: ephemeral links established and then silent."""
    flood = Flood(hub.port, kind, FLOOD, pki=pki, cert="node1", workers=8, pass_s=0.01)  # type: ignore[arg-type]
    with flood:
        flood.open_all()
        flood.start()
        settle(flood)
        rid = round_trip(pki, hub.port, "node2")
    assert rid in stored_ids(tmp_path / "hub", "temps")
    assert hub.alive()


def test_out_of_descriptors_hub_still_serves_promptly(pki: PKI, tmp_path: Path) -> None:
    """RLIMIT_NOFILE 64 and 100 half-open connections: the allowed round
    trip completes within a generous bound (it used to wait for the
    half-open ones to time out, ~10 s)."""
    with HubProcess(pki, tmp_path / "hub", nofile=64) as hub:
        with Flood(hub.port, "tcp", 100, per_pass=10, pass_s=0.5) as flood:
            flood.open_all()
            flood.start()
            time.sleep(1.0)
            t0 = time.monotonic()
            rid = round_trip(pki, hub.port, "node2", timeout=5.0)
            took = time.monotonic() - t0
        assert took < 5.0, f"the round trip took {took:.1f}s"
        assert rid in stored_ids(tmp_path / "hub", "temps")
        assert hub.alive(), hub.log()
    # Failed accepts (EMFILE) are logged at most once per 10 s, not per try.
    failed_accepts = hub.log_path.read_text(errors="replace").count("accept failed")
    assert failed_accepts <= 2, hub.log()
