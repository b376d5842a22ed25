#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (corpus/<target>/seed-*).

Seeds are valid inputs: the lines of the keyop-messenger 1.4 fixture
channel (tests/fixtures/go-1.4), batches of them as `push_record` frames
them, the handshakes and acknowledgement of `federation::wire` byte for
byte, and channel files with and without torn tails. Run it from anywhere;
it replaces the seeds and leaves other corpus files alone.
"""

import struct
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
ALERTS = FUZZ.parent / "tests/fixtures/go-1.4/channels/alerts"
SEG0 = (ALERTS / "00000000000000000000.jsonl").read_bytes()
SEG1 = (ALERTS / "00000000000000001273.jsonl").read_bytes()
LINES = SEG0.splitlines() + SEG1.splitlines()


def batch(records):
    return b"".join(struct.pack(">I", len(r)) + r for r in records)


SEEDS = {
    "envelope": {f"fixture-line-{i}": line for i, line in enumerate(LINES)},
    "frame_decoder": {
        "one-record": batch(LINES[:1]),
        "fixture-lines": batch(LINES),
        "wire-test": batch([b'{"a":1}', b"{}"]),
        "empty-record": batch([b""]),
    },
    "handshake": {
        "client": b'{"instance_name":"dash-1","role":"client","version":"1","subscribe":["alerts","metrics"]}',
        "client-plain": b'{"instance_name":"sensor-1","role":"client","version":"1"}',
        "client-ephemeral": b'{"instance_name":"kiosk","role":"client","version":"1","subscribe":["alerts"],"ephemeral":true}',
        "hub": b'{"instance_name":"hub1","role":"hub","version":"1"}',
        "ack-empty": b'{"last_id":""}',
        "ack": b'{"last_id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"}',
    },
    # Segments are separated by a 0xFF byte (see fuzz_targets/torn_tail.rs).
    "torn_tail": {
        "fixture": SEG0 + b"\xff" + SEG1,
        "fixture-torn": SEG0 + b"\xff" + SEG1 + LINES[0][:57],
        "sealed-torn": SEG1 + LINES[0][:40] + b"\xff" + SEG1,
        "one-segment-torn": SEG1 + LINES[1][:100],
        "rolled-empty": SEG1 + b"\xff",
    },
}

for target, seeds in SEEDS.items():
    out = FUZZ / "corpus" / target
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("seed-*"):
        old.unlink()
    for name, data in seeds.items():
        (out / f"seed-{name}").write_bytes(data)
