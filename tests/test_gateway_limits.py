"""The gateway's bounds and edges found by probing it: bytes held per stream
and per long poll, a stalled WebSocket timing out, resuming below retention
with a gap, a reloaded ``max_channels``, refusals that reach clients still
sending their body, and WebSocket frames that are too big, binary or over
the rate."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import OP_BINARY, OP_TEXT, PeerClosed
from gateway_helpers import (
    TIMEOUT_S,
    TOKEN,
    Client,
    WsClient,
    context,
    gateway_doc,
    gateway_stats,
    wait_for,
)
from keyop_messenger import Config, ConfigError, Messenger

pki = fed_helpers.pki

MIB = 1024 * 1024



def _fill(m: Messenger, channel: str, n: int, size: int) -> None:
    for i in range(n):
        m.publish(channel, "blob", {"i": i, "b": "x" * size})


def _raw_sse(pki: fed_helpers.PKI, m: Messenger, path: str) -> socket.socket:
    """An SSE request on a socket with a small receive buffer; never read."""
    addr = m.gateway_address
    assert addr is not None
    raw = socket.socket()
    raw.settimeout(TIMEOUT_S)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", addr[1]))
    s = context(pki).wrap_socket(raw, server_hostname="localhost")
    s.sendall(
        f"GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n"
        f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    return s


def test_a_stream_that_is_not_read_holds_a_few_records(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    """Records of 900 kB; readers that never read. A stream reads a step of
    at most 256 KiB (or one record) at a time and queues two: what it holds
    is a few records, not the 256 a step read before (all 40 here)."""
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        _fill(m, "sensors", 40, 900_000)
        socks = [_raw_sse(pki, m, "/v1/channels/sensors/messages?from=earliest")
                 for _ in range(2)]  # fmt: skip
        try:
            wait_for(lambda: gateway_stats(m).streams_open == 2, "two streams open")
            # Until the streams are blocked on their clients.
            wait_for(lambda: gateway_stats(m).delivered >= 2, "records handed to the streams")
            last, stable_since = -1, time.monotonic()
            while time.monotonic() - stable_since < 1.0:
                now = gateway_stats(m).delivered
                if now != last:
                    last, stable_since = now, time.monotonic()
                time.sleep(0.1)
            # Socket buffers take a few records each; the gateway two or three.
            assert last < 2 * 20, f"{last} records of 900 kB handed to 2 streams"
        finally:
            for s in socks:
                s.close()


def test_a_long_poll_answer_stops_after_about_a_mib(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        _fill(m, "sensors", 6, 400_000)
        c = Client(pki, m)
        got: list[int] = []
        after = 0
        while len(got) < 6:
            status, _, body = c.request(
                "GET", f"/v1/channels/sensors/messages?after={after}&limit=1000"
            )
            assert status == 200
            n = len(body["messages"])
            assert 1 <= n <= 3, f"an answer of {n} records of 400 kB"
            got += [x["message"]["payload"]["i"] for x in body["messages"]]
            after = body["next"]
        assert got == list(range(6))


def test_a_websocket_whose_reader_stalls_times_out(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    doc = gateway_doc(pki, tmp_path / "data", idle_timeout="1s")
    with Messenger(Config.from_dict(doc)) as m:
        _fill(m, "sensors", 30, 900_000)
        ws = WsClient(pki, m, "/v1/channels/sensors/ws?from=earliest", rcvbuf=4096)
        try:
            wait_for(lambda: gateway_stats(m).streams_open == 1, "the WebSocket is open")
            # Never read: the gateway's sends block, then it gives up.
            wait_for(lambda: gateway_stats(m).streams_open == 0, "the stalled WebSocket is closed")
            assert gateway_stats(m).refused["timed_out"] >= 1
        finally:
            ws.close()


def _retained(pki: fed_helpers.PKI, tmp_path: Path) -> Messenger:
    doc = gateway_doc(pki, tmp_path / "data")
    doc["storage"]["segment_size_mb"] = 1
    doc["retention"] = {"max_bytes": 2 * MIB}
    return Messenger(Config.from_dict(doc))


def _sse_blocks(c: Client, path: str, n: int, last_event_id: str | None = None
                ) -> list[dict[str, str]]:  # fmt: skip
    """The first ``n`` SSE blocks that carry data, as ``{field: value}``."""
    conn = c.connection()
    extra = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        extra["Last-Event-ID"] = last_event_id
    try:
        conn.request("GET", path, headers=c.headers(extra))
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        blocks: list[dict[str, str]] = []
        block: dict[str, str] = {}
        while len(blocks) < n:
            line = resp.readline().decode()
            assert line, "the stream ended early"
            line = line.rstrip("\n")
            if not line:
                if "data" in block:
                    blocks.append(block)
                block = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                block[key] = value
        return blocks
    finally:
        conn.close()


def test_resuming_below_retention_reports_the_gap_and_goes_on(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    with _retained(pki, tmp_path) as m:
        _fill(m, "sensors", 300, 10_000)
        m.compact()
        first = next(iter(m.read_channel("sensors", skip_gaps=True))).offset
        assert first > 0, "retention deleted the oldest segments"
        end = m.stream_end("sensors")
        c = Client(pki, m)
        for path, last_id in [
            ("/v1/channels/sensors/messages", "0"),
            ("/v1/channels/sensors/messages?from=0", None),
        ]:
            gap, record = _sse_blocks(c, path, 2, last_event_id=last_id)
            assert gap["event"] == "gap" and json.loads(gap["data"]) == {"from": 0, "to": first}
            assert gap["id"] == str(first)
            assert "event" not in record and json.loads(record["data"])["payload"]["i"] > 0

        status, _, body = c.request("GET", "/v1/channels/sensors/messages?after=0&limit=1")
        assert status == 200, body
        assert body["gaps"] == [{"from": 0, "to": first}]
        assert body["messages"][0]["offset"] == first

        # Inside a kept record, or past the end: still refused.
        for bad in (first + 7, end + 1):
            status, _, err = c.request("GET", f"/v1/channels/sensors/messages?after={bad}")
            assert status == 400 and err["error"] == "invalid", err


def test_a_reloaded_max_channels_applies_to_gateway_publishes(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    doc = gateway_doc(pki, tmp_path / "data")
    doc["hub"]["allowed_peers"] = [{"name": "node1", "max_channels": 1}]
    with Messenger(Config.from_dict(doc)) as m:
        node1 = Client(pki, m, cert="node1", token=None)
        body = {"payload_type": "t", "payload": 1}
        assert node1.publish("new-a", body)[0] == 201
        status, _, err = node1.publish("new-b", body)
        assert status == 403 and err["error"] == "channel_limit", err
        peers = [dataclasses.replace(p, max_channels=3) for p in m.config.hub.allowed_peers]
        m.set_gateway_access(peers, m.config.gateway.tokens)
        assert node1.publish("new-b", body)[0] == 201
        peers = [dataclasses.replace(p, max_channels=2) for p in peers]
        m.set_gateway_access(peers, m.config.gateway.tokens)
        assert node1.publish("new-c", body)[0] == 403


@pytest.mark.parametrize(("token", "channel", "status"), [
    ("wrong", "sensors", 401),
    (TOKEN, "other", 403),
    (TOKEN, "sensors", 413),
])  # fmt: skip
def test_an_early_refusal_reaches_a_client_that_sends_its_whole_body(
    pki: fed_helpers.PKI, tmp_path: Path, token: str, channel: str, status: int
) -> None:
    """``http.client`` sends the whole body before it reads: the refusal
    (answered before the body is read) must not be lost to a reset."""
    doc = gateway_doc(pki, tmp_path / "data", max_body_bytes=300_000)
    body = json.dumps({"payload_type": "t", "payload": "x" * 900_000}).encode()
    if status != 413:
        body = body[:250_000]  # under the limit, refused before it is read
    with Messenger(Config.from_dict(doc)) as m:
        addr = m.gateway_address
        assert addr is not None
        for _ in range(5):
            conn = http.client.HTTPSConnection(
                "localhost", addr[1], context=context(pki), timeout=TIMEOUT_S
            )
            try:
                conn.request("POST", f"/v1/channels/{channel}/messages", body=body,
                             headers={"Authorization": f"Bearer {token}"})
                resp = conn.getresponse()
                assert resp.status == status
                assert json.loads(resp.read())["error"]
            finally:
                conn.close()


def test_websocket_frame_over_the_limit_closes_with_1009(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    doc = gateway_doc(pki, tmp_path / "data", max_body_bytes=10_000)
    with Messenger(Config.from_dict(doc)) as m:
        ws = WsClient(pki, m, "/v1/channels/big/ws")
        try:
            frame = json.dumps({"ref": "big", "payload_type": "t", "payload": "x" * 50_000})
            ws.send_frame(OP_TEXT, frame.encode())
            with pytest.raises(PeerClosed) as closed:
                ws.recv(TIMEOUT_S)
            assert closed.value.code == 1009
        finally:
            ws.close()
        assert gateway_stats(m).refused["too_large"] == 1


def test_websocket_binary_frames_and_frames_over_the_rate_get_error_frames(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    doc = gateway_doc(pki, tmp_path / "data", rate_limit_per_s=0.01, rate_limit_burst=3)
    with Messenger(Config.from_dict(doc)) as m:
        # "big": published to, not read (no message frames between replies).
        ws = WsClient(pki, m, "/v1/channels/big/ws")  # the handshake takes 1 of 3
        try:
            msg = {"ref": "b1", "payload_type": "t", "payload": 1}
            ws.send_frame(OP_BINARY, json.dumps(msg).encode())
            reply = ws.recv_json()
            assert reply["type"] == "error" and reply["ref"] == "b1", reply
            assert reply["status"] == 400 and "text frame" in reply["message"]
            replies = []
            for i in range(3):
                ws.send_text(json.dumps({**msg, "ref": i}))
                replies.append(ws.recv_json())
            assert [r["type"] for r in replies[:2]] == ["published"] * 2, replies
            assert replies[2]["type"] == "error" and replies[2]["status"] == 429, replies
            assert replies[2]["ref"] == 2 and replies[2]["retry_after"] >= 1
        finally:
            ws.close()
        gw = gateway_stats(m)
        assert gw.refused["rate_limited"] >= 1 and gw.refused["bad_request"] == 1
        assert len(list(m.read_channel("big"))) == 2


def test_shutdown_closes_websockets_with_1001(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    m = Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data")))
    ws = WsClient(pki, m, "/v1/channels/sensors/ws")
    try:
        wait_for(lambda: gateway_stats(m).streams_open == 1, "the WebSocket is open")
        m.close()
        with pytest.raises(PeerClosed) as closed:
            ws.recv(TIMEOUT_S)
        assert closed.value.code == 1001
    finally:
        ws.close()
        m.close()


def test_small_edges_of_the_api(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    """405 says what is allowed, ``Accept`` is matched whatever its case, a
    header that is not valid and a body nested too deep say so, and the API
    document lists the WebSocket's 429."""
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        c = Client(pki, m)
        status, headers, _ = c.request("DELETE", "/v1/channels/sensors/messages")
        assert status == 405 and headers["allow"] == "GET, POST"
        conn = c.connection()
        try:
            conn.request("GET", "/v1/channels/sensors/messages",
                         headers=c.headers({"Accept": "TEXT/EVENT-STREAM"}))
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
        finally:
            conn.close()
        status, _, err = c.publish("sensors", {"payload": 1},
                                   headers={"Keyop-Payload-Type": "temp\u00e9rature"})
        assert status == 400 and "Keyop-Payload-Type header is not valid" in err["message"], err
        deep = b'{"payload_type": "t", "payload": ' + b"[" * 130 + b"]" * 130 + b"}"
        status, _, err = c.publish("sensors", deep)
        assert status == 400 and "nested deeper than 100" in err["message"], err
        _, _, doc = c.request("GET", "/v1/openapi.json")
        assert "429" in doc["paths"]["/v1/channels/{channel}/ws"]["get"]["responses"]


def test_two_tokens_with_one_hash_are_refused(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    doc = gateway_doc(pki, tmp_path / "data")
    first = doc["gateway"]["tokens"][0]
    doc["gateway"]["tokens"].append({**first, "name": "twin", "publish": []})
    with pytest.raises(ConfigError) as info:
        Config.from_dict(doc).validate()
    text = "\n".join(info.value.problems)
    assert "gateway.tokens[1].hash: duplicate token hash" in text, text
    assert "'twin'" in text and "gateway.tokens[0] ('app')" in text, text


def test_a_websocket_reads_its_client_while_it_delivers_a_backlog(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    """A publish sent while the socket delivers a backlog is answered between
    its steps (it waited for the whole backlog), and a Close is answered with
    a Close (it was ignored, then the connection dropped)."""
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        _fill(m, "sensors", 60, 300_000)
        ws = WsClient(pki, m, "/v1/channels/sensors/ws?from=earliest")
        try:
            ws.send_text(json.dumps({"ref": "p1", "payload_type": "t", "payload": 1}))
            before = 0
            while ws.recv_json()["type"] != "published":
                before += 1
            assert before < 60, "the reply came after the whole backlog"
            ws.send_frame(fed_helpers.OP_CLOSE, (1000).to_bytes(2, "big"))
            with pytest.raises(PeerClosed) as closed:
                for _ in range(61):  # what was in flight, then the Close
                    ws.recv(TIMEOUT_S)
            assert closed.value.code == 1000
        finally:
            ws.close()
