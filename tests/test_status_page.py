"""The status page at the metrics listener's ``/``: one static file shipped in
the package, served with a restrictive Content-Security-Policy, and drawn live
from ``/status`` in a real headless browser (Debian's ``chromium`` driven by
Playwright; ``.ci/run`` installs it). Without that browser the browser tests
fail, saying what to install: they are never skipped."""

from __future__ import annotations

import importlib.resources
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyop_messenger import Config, Messenger
from keyop_messenger._metrics_http import STATUS_PAGE, status_page
from keyop_messenger.health import Health
from keyop_messenger.metrics import MetricsServer
from run_helpers import http_json, poll

WAIT_MS = 15_000
"""Bound of every wait on the page (it polls /status every second)."""


def _page_text() -> str:
    return importlib.resources.files("keyop_messenger").joinpath(STATUS_PAGE).read_text()


def test_the_installed_package_ships_the_page() -> None:
    page = importlib.resources.files("keyop_messenger").joinpath(STATUS_PAGE)
    assert page.is_file(), f"{STATUS_PAGE} is missing from the installed package"
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!doctype html>") and 'fetch("/status"' in text


def test_the_page_loads_nothing_from_elsewhere() -> None:
    text = _page_text()
    # No absolute or protocol-relative URL anywhere, no external resource tags.
    assert not re.search(r"(?i)\b[a-z][a-z0-9+.-]*://", text), "an absolute URL in the page"
    assert not re.search(r"""(?i)(src|href|action)\s*=\s*["']?//""", text)
    assert not re.search(r"(?i)<(link|iframe|object|embed|img|base)\b", text)
    assert not re.search(r"(?i)@import|url\(", text)
    assert not re.search(r"(?i)<script[^>]*\bsrc\b", text)
    # Links stay on this server.
    assert set(re.findall(r'href="([^"]*)"', text)) == {
        "/status", "/metrics", "/healthz", "/readyz",
    }  # fmt: skip
    # Values from the server are set as text, never parsed as HTML.
    assert "innerHTML" not in text and "insertAdjacentHTML" not in text
    assert "eval(" not in text and "document.write" not in text


def _get(url: str) -> tuple[int, Any, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers, resp.read()


def test_root_serves_the_page_with_a_restrictive_policy(tmp_path: Path) -> None:
    with Messenger(_config(tmp_path)) as m:
        base = _base(m)
        status, headers, body = _get(base + "/")
        assert status == 200
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert body == _page_text().encode()
        policy = headers["Content-Security-Policy"]
        directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
        assert directives["default-src"] == "'none'"
        assert directives["connect-src"] == "'self'"
        assert directives["frame-ancestors"] == "'none'"
        for kind in ("script-src", "style-src"):
            sources = directives[kind].split()
            assert sources and all(s.startswith("'sha256-") for s in sources), policy
        assert "unsafe" not in policy
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert _get(base + "/index.html")[2] == body
        assert status_page()[1] == policy


# ---------------------------------------------------------------------------
# In a real browser
# ---------------------------------------------------------------------------


def _chromium() -> str:
    path = os.environ.get("KEYOP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.isfile(path):
        pytest.fail(
            f"no Chromium at {path}: the status page is tested in a real browser; "
            "install Debian's chromium (apt-get install -y chromium; .ci/run does) "
            "or set KEYOP_CHROMIUM to a Chromium binary",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"playwright is not installed ({exc}): pip install -e '.[test]'", pytrace=False)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)
    context = browser.new_context()
    p = context.new_page()
    problems: list[str] = []
    p.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    p.on(
        "console",
        lambda msg: (
            problems.append(f"console: {msg.text}")
            if "Content Security Policy" in msg.text
            else None
        ),
    )
    p.problems = problems
    try:
        yield p
    finally:
        context.close()


def _config(tmp_path: Path) -> Config:
    return Config.from_dict(
        {
            "name": "statuspage",
            "storage": {"data_dir": str(tmp_path / "data")},
            "metrics": {"listen_addr": "127.0.0.1:0"},
        }
    )


def _base(m: Messenger) -> str:
    assert m.metrics_address is not None
    return f"http://127.0.0.1:{m.metrics_address[1]}"


def _screenshot(page: Any, name: str) -> None:
    """With KEYOP_STATUS_SCREENSHOTS=DIR, saves a screenshot for a person to look at."""
    out = os.environ.get("KEYOP_STATUS_SCREENSHOTS")
    if out:
        page.screenshot(path=str(Path(out) / f"{name}.png"), full_page=True)


def test_page_shows_channels_and_lag_live_then_disconnected(tmp_path: Path, page: Any) -> None:
    from playwright.sync_api import expect

    m = Messenger(_config(tmp_path))
    try:
        base = _base(m)
        for n in range(3):
            m.publish("orders", "order", {"n": n})
        m.publish("alerts", "alert", {"level": "high"})
        received: list[Any] = []
        billing_sub = m.subscribe("orders", "billing", received.append, start="earliest")
        m.subscribe("alerts", "pager", received.append, start="earliest")
        poll(lambda: len(received) == 4, "the four messages handled")
        caught_up = m.stream_end("orders")
        poll(
            lambda: _sub(http_json(base + "/status"), "orders", "billing")["lag_bytes"] == 0,
            "billing caught up",
        )
        billing_sub.close()  # its offset stays: billing falls behind from here
        m.publish("orders", "order", {"n": 3})
        m.publish("orders", "order", {"n": 4})
        lag = m.stream_end("orders") - caught_up

        page.goto(base + "/")
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#name")).to_have_text("statuspage")
        orders = page.locator('#channels tbody tr[data-channel="orders"]')
        alerts = page.locator('#channels tbody tr[data-channel="alerts"]')
        expect(orders.locator("td.published")).to_have_attribute("data-value", "5")
        expect(alerts.locator("td.published")).to_have_attribute("data-value", "1")
        expect(orders.locator("td.end")).to_have_attribute(
            "data-value", str(m.stream_end("orders"))
        )
        status = http_json(base + "/status")
        (orders_doc,) = [c for c in status["channels"] if c["name"] == "orders"]
        expect(orders.locator("td.size")).to_have_attribute(
            "data-value", str(orders_doc["disk_bytes"])
        )
        expect(orders.locator("td.last")).to_have_text(re.compile(r" ago$"))
        expect(orders.locator("td.last")).to_have_attribute(
            "data-value", orders_doc["last_message_at"]
        )

        billing = page.locator(
            '#subscribers tbody tr[data-channel="orders"][data-subscriber="billing"]'
        )
        expect(billing).to_have_class("lagging")
        expect(billing.locator("td.lag-bytes")).to_have_attribute("data-value", str(lag))
        expect(billing.locator("td.state")).to_have_text("inactive")
        expect(billing.locator("td.lag-time")).to_have_text(re.compile(r"\d"))
        pager = page.locator(
            '#subscribers tbody tr[data-channel="alerts"][data-subscriber="pager"]'
        )
        expect(pager.locator("td.lag-bytes")).to_have_attribute("data-value", "0")
        expect(pager.locator("td.state")).to_have_text("active")
        expect(page.locator("#peers-empty")).to_be_visible()
        expect(page.locator("#banner")).to_be_hidden()
        _screenshot(page, "status-live")

        # A new publish shows up without a reload: the same document updates.
        page.evaluate("window.__sameDocument = true")
        m.publish("orders", "order", {"n": 5})
        expect(orders.locator("td.published")).to_have_attribute("data-value", "6")
        expect(billing.locator("td.lag-bytes")).to_have_attribute(
            "data-value", str(m.stream_end("orders") - caught_up)
        )
        expect(orders.locator("td.msg-rate")).to_have_attribute(
            "data-value", re.compile(r"^(0\.\d*[1-9]|[1-9])")
        )
        assert page.evaluate("window.__sameDocument") is True
    finally:
        m.close()

    # The server is gone: the page says so and keeps the last figures.
    expect(page.locator("#banner")).to_be_visible()
    expect(page.locator("#conn")).to_have_text("disconnected")
    expect(page.locator("body")).to_have_class("disconnected")
    expect(page.locator("#banner-reason")).to_contain_text("cannot reach /status")
    expect(orders.locator("td.published")).to_have_attribute("data-value", "6")
    _screenshot(page, "status-disconnected")
    assert page.problems == []


def _sub(status: dict[str, Any], channel: str, sub_id: str) -> dict[str, Any]:
    (c,) = [c for c in status["channels"] if c["name"] == channel]
    (s,) = [s for s in c["subscribers"] if s["id"] == sub_id]
    assert isinstance(s, dict)
    return s


class _FederatedSource:
    """The figures of an instance that is a hub (one peer connected, one
    connection rejected) and a client of another hub that refuses records."""

    def stats(self) -> Any:
        from keyop_messenger.stats import (
            FederationStats,
            HubLinkStats,
            HubListenerStats,
            Stats,
            Totals,
        )

        link = HubLinkStats(
            addr="upstream:7740", connected=True, reconnects=1, unacked_bytes=0,
            rtt_p50_us=1.0, rtt_p99_us=2.0, refused={"temps": 3, "alerts": 2},
            refused_channels=["secret"],
        )  # fmt: skip
        listener = HubListenerStats(
            listen_addr="127.0.0.1:7740", peers=["node1"], records_received=9,
            connections_accepted=2, connections_rejected=1,
            records_refused={"policy": 6, "invalid": 1}, connections_failed={"tls": 3},
        )  # fmt: skip
        return Stats(
            channels=[], totals=Totals(0, 0, 0, 0, 0), latency={},
            federation=FederationStats(links=[link], listener=listener),
        )  # fmt: skip

    def federation_status(self) -> Any:
        from keyop_messenger import FederationStatus, HubLinkStatus, HubStatus

        link = HubLinkStatus(
            addr="upstream:7740", connected=True, reconnects=1, failed_attempts=4,
            refused={"temps": 3, "alerts": 2}, refused_channels=["secret"],
            refused_subscriptions=["audit"],
        )  # fmt: skip
        hub = HubStatus(accepted=2, rejected=1, peers=["node1"])
        return FederationStatus(hub=hub, clients=[link])


def test_page_shows_peers_and_refusals(page: Any) -> None:
    from playwright.sync_api import expect

    health = Health(_FederatedSource(), ready=True)
    with MetricsServer(None, "127.0.0.1:0", health=health) as server:
        page.goto(f"http://127.0.0.1:{server.address[1]}/")
        expect(page.locator("#conn")).to_have_text("live")
        node1 = page.locator('#peers tbody tr[data-peer="node1"]')
        expect(node1.locator("td.state")).to_have_text("connected")
        expect(node1.locator("td.kind")).to_have_text("peer of this hub")
        upstream = page.locator('#peers tbody tr[data-peer="upstream:7740"]')
        expect(upstream.locator("td.kind")).to_have_text("link to hub")
        expect(upstream.locator("td.state")).to_have_text("connected")
        expect(upstream.locator("td.refused")).to_have_attribute("data-value", "5")
        expect(upstream.locator("td.refused-channels")).to_have_text("secret, audit (subscribe)")
        expect(page.locator("#refused-connections")).to_have_text("1")
        expect(page.locator("#failed-connections")).to_have_text("3")
        expect(page.locator("#refused-inbound")).to_have_text("7")
        expect(page.locator("#refused-dials")).to_have_text("4")
        expect(page.locator("#refused-records")).to_have_text("5")
        expect(page.locator("#hub")).to_contain_text("127.0.0.1:7740")
        expect(page.locator("#channels-empty")).to_be_visible()
        _screenshot(page, "status-peers")
    assert page.problems == []
