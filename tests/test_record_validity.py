"""One definition of a valid record (hostile-input issue, item 1).

The rules live in rust/core/src/envelope.rs: payload nesting at most 100
levels (checked without recursion), ids of 1-64 bytes of ``A-Za-z0-9-_.:``,
channel names by the name rule, ``origin``/``payload_type``/
``service_name``/``correlation_id`` at most 255 bytes without control
characters, values a reader can hold (no half of a surrogate pair, finite
doubles, integers of at most 4300 digits, in any key of a received record),
and the size limit. They apply to local publishes (nothing is
written) and to records received by a hub (refused with reason ``invalid``,
never stored, the acknowledgement never echoing a bad id).
"""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from conftest import make_config
from fed_helpers import (
    PKI,
    RawPeer,
    Starter,
    audit_events,
    envelope,
    hub_config,
    hub_port,
    peer,
    stored_ids,
)
from keyop_messenger import (
    ChannelNotFoundError,
    InvalidNameError,
    Messenger,
    PayloadTypeError,
    read_channel,
)

pki = fed_helpers.pki
start = fed_helpers.start

#: The documented limit (envelope.rs MAX_PAYLOAD_DEPTH).
MAX_DEPTH = 100


def nested(depth: int) -> Any:
    """``depth`` lists inside each other, built without recursion."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def raw_record(msg_id: str, payload_json: bytes, channel: str = "temps") -> bytes:
    head = json.dumps(
        {
            "v": 1,
            "id": msg_id,
            "ts": "2026-03-31T14:22:01Z",
            "channel": channel,
            "origin": "node1",
            "payload_type": "test.Raw",
        },
        separators=(",", ":"),
    ).encode()
    return head[:-1] + b',"payload":' + payload_json + b"}"


def frame(*records: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(r)) + r for r in records)


def hello(name: str) -> str:
    return json.dumps(
        {"instance_name": name, "role": "client", "version": "1", "features": ["refusals"]},
        separators=(",", ":"),
    )


# ---------------------------------------------------------------------------
# Federation inbound
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("features", [True, False], ids=["refusals-peer", "go-1.4-peer"])
def test_hub_refuses_a_100000_deep_payload_and_a_9_mib_id(
    pki: PKI, tmp_path: Path, start: Starter, features: bool
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1", publish=["temps"])]))
    deep_id = str(uuid.uuid4())
    deep = raw_record(deep_id, b"[" * 100_000 + b"]" * 100_000)
    huge_id = raw_record("x" * (9 * 1024 * 1024), b"{}")
    good = envelope("temps", "node1", {"ok": True})
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        if features:
            raw.send_text(hello("node1"))
            raw.recv_text()
        else:
            raw.handshake("node1")
        raw.send_binary(frame(deep, huge_id, good))
        ack = raw.recv_text(timeout=60)
    assert len(ack) < 1000, "the huge id is not echoed"
    doc = json.loads(ack)
    assert doc["last_id"] == json.loads(good)["id"]
    if features:
        assert doc["refused"] == [
            {"id": deep_id, "channel": "temps", "reason": "invalid"},
            {"id": "", "channel": "temps", "reason": "invalid"},
        ]
    else:
        assert list(doc) == ["last_id"]
    assert stored_ids(hub_dir, "temps") == [json.loads(good)["id"]], "neither was stored"
    refused = audit_events(hub_dir, "record_refused")
    assert [r.get("message_id", "") for r in refused] == [deep_id, ""]
    assert "nested deeper than 100" in refused[0]["detail"]
    assert all(len(json.dumps(r)) < 1000 for r in refused), "the audit does not echo it either"


def test_hub_accepts_the_deepest_valid_payload_and_refuses_bad_fields(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1")]))
    at_limit = raw_record(str(uuid.uuid4()), json.dumps(nested(MAX_DEPTH)).encode())
    over = raw_record(str(uuid.uuid4()), json.dumps(nested(MAX_DEPTH + 1)).encode())
    bad_fields = [
        envelope("temps", "node1", {}, msg_id="has space"),
        envelope("temps", "o" * 256, {}),
        envelope("temps", "node1\nforged", {}),
    ]
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        raw.send_text(hello("node1"))
        raw.recv_text()
        raw.send_binary(frame(at_limit, over, *bad_fields))
        doc = json.loads(raw.recv_text())
    assert [r["reason"] for r in doc["refused"]] == ["invalid"] * 4
    assert doc["refused"][1]["id"] == "", "an invalid id is not echoed"
    assert stored_ids(hub_dir, "temps") == [json.loads(at_limit)["id"]]
    (entry,) = list(read_channel(hub_dir, "temps"))
    assert entry.message.payload == nested(MAX_DEPTH), "what is stored is readable"


def test_hub_refuses_values_its_readers_cannot_hold(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """Well-formed JSON that no Python reader can take back (half a surrogate
    pair, a number beyond a double, an integer of over 4300 digits) is
    refused, not acknowledged, stored and then dead-lettered by every
    subscriber; so is a key besides the envelope's that nests too deep."""
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [peer("node1")]))
    poison = [
        raw_record(str(uuid.uuid4()), b'"\\ud800"'),
        raw_record(str(uuid.uuid4()), b'{"n":1e999999}'),
        raw_record(str(uuid.uuid4()), b"9" * 5000),
    ]
    deep_key = json.loads(envelope("temps", "node1", {}))
    deep_key["x"] = nested(MAX_DEPTH + 1)
    poison.append(json.dumps(deep_key).encode())
    fine_json = b'{"s":"\\ud83d\\ude00","n":1e308,"i":' + b"9" * 4300 + b"}"
    fine = raw_record(str(uuid.uuid4()), fine_json)
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        raw.send_text(hello("node1"))
        raw.recv_text()
        raw.send_binary(frame(*poison, fine))
        doc = json.loads(raw.recv_text())
    assert [r["reason"] for r in doc["refused"]] == ["invalid"] * 4
    assert stored_ids(hub_dir, "temps") == [json.loads(fine)["id"]]
    (entry,) = list(read_channel(hub_dir, "temps"))
    assert entry.message.payload["s"] == "\U0001f600"
    details = [r["detail"] for r in audit_events(hub_dir, "record_refused")]
    assert sum("unreadable value" in d for d in details) == 3, details


# ---------------------------------------------------------------------------
# Local publish
# ---------------------------------------------------------------------------


def test_local_publish_refuses_payloads_nested_deeper_than_the_limit(tmp_path: Path) -> None:
    with Messenger(make_config(tmp_path)) as m:
        for too_deep in (nested(MAX_DEPTH + 1), nested(100_000)):
            with pytest.raises(PayloadTypeError, match="nested deeper than 100"):
                m.publish("temps", "test.Deep", too_deep)
            with pytest.raises(PayloadTypeError, match="nested deeper than 100"):
                m.publish_batch("temps", [("test.Ok", {}), ("test.Deep", too_deep)])
        with pytest.raises(ChannelNotFoundError):  # nothing was written: not even the channel
            read_channel(tmp_path / "data", "temps")
        mid = m.publish("temps", "test.Deep", nested(MAX_DEPTH))
    (entry,) = list(read_channel(tmp_path / "data", "temps"))
    assert (entry.message.id, entry.message.payload) == (mid, nested(MAX_DEPTH))


def test_local_publish_refuses_bad_header_fields(tmp_path: Path) -> None:
    with Messenger(make_config(tmp_path)) as m:
        with pytest.raises(InvalidNameError, match="correlation_id"):
            m.publish("temps", "test.X", {}, correlation_id="a\nforged line")
        with pytest.raises(InvalidNameError, match="service_name"):
            m.publish("temps", "test.X", {}, service_name="s" * 256)
        with pytest.raises(InvalidNameError, match="payload_type"):
            m.publish("temps", "t" * 256, {})
        assert list(read_channel(tmp_path / "data", "temps")) == []
        m.publish("temps", "t" * 255, {}, service_name="s" * 255, correlation_id="c-1")
