"""The benchmark suite (same as ``keyop-messenger bench``).

    python benches/bench.py [--quick] [--json] [--one-core]

Prints durable publish from 1/4/16/64 threads and publish_batch of 10/100/1000
next to a raw write+fdatasync probe, relaxed publish, subscribe into a no-op
handler, federated throughput and round trip next to a loopback TLS echo, the
memory of an idle client, and the CPU microseconds per published and per
delivered message; with ``--one-core``, the main throughput figures pinned to
one CPU and to two, and their ratio. A benchmark, not a test: it asserts
nothing.
"""

from __future__ import annotations

import sys

from keyop_messenger.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
