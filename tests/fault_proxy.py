"""A loopback TCP fault proxy for the network-fault tests (tests/test_net_faults.py).

``FaultProxy(target_port)`` listens on ``127.0.0.1:<port>`` (port 0: a free
one) and relays every accepted connection to ``127.0.0.1:<target_port>``,
byte for byte, in both directions. Faults are switched on and off while it
runs:

* :meth:`cut` closes every relayed connection at once (RST on both sides);
* ``refuse = True``: new connections are accepted (and counted) and closed at
  once, like a host whose service is down but whose port still answers;
* :meth:`stall` / :meth:`resume`: stop relaying (nothing is read or written,
  so TCP back-pressure builds up) until resumed;
* ``delay_s``: every chunk is held this long before it is passed on;
* ``truncate_after`` / ``truncate_down_after``: lists of byte budgets, one
  per *new* connection: the connection is cut after that many
  client-to-target (target-to-client) bytes were relayed (mid-TLS-record,
  mid-WebSocket-frame); once a list is used up, connections are relayed whole.

It is bounded: at most ``max_connections`` connections are relayed at once
(more are closed on accept), and it stops itself ``lifetime_s`` seconds after
it started (closing everything). :meth:`close` (or leaving the ``with``
block) stops it and joins every thread it started. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from types import TracebackType

__all__ = ["FaultProxy"]

_CHUNK = 65536
_POLL_S = 0.05
_SEND_TIMEOUT_S = 30.0


def _abort(sock: socket.socket) -> None:
    """Closes ``sock`` with an RST (SO_LINGER 0), ignoring errors."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Pair:
    """One relayed connection: client socket, target socket, two pump threads."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: socket.socket,
        target: socket.socket,
        budget_up: int | None,
        budget_down: int | None,
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.target = target
        # Bytes relayed per direction before the cut, or None (no cut).
        self.budgets = {True: budget_up, False: budget_down}
        self.dead = threading.Event()
        self.bytes_up = 0
        self.bytes_down = 0
        self._lock = threading.Lock()
        self._ended = 0
        self.threads = [
            threading.Thread(
                target=self._pump, args=(client, target, True), daemon=True, name="fault-proxy-up"
            ),
            threading.Thread(
                target=self._pump,
                args=(target, client, False),
                daemon=True,
                name="fault-proxy-down",
            ),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def kill(self) -> None:
        """Ends the connection: both pumps stop within a poll interval and the
        last one closes both sockets with an RST."""
        self.dead.set()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        proxy = self.proxy
        clean = False
        try:
            while not self.dead.is_set() and not proxy.stopped.is_set():
                if proxy.stalled.is_set():
                    time.sleep(_POLL_S)
                    continue
                ready, _, _ = select.select([src], [], [], _POLL_S)
                if not ready or proxy.stalled.is_set() or self.dead.is_set():
                    continue  # re-check: no byte moves while stalled or cut
                data = src.recv(_CHUNK)
                if not data:
                    # Pass the FIN on; the other direction may still flow.
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    clean = True
                    return
                if proxy.delay_s > 0 and proxy.stopped.wait(proxy.delay_s):
                    return
                if self.dead.is_set():
                    return
                budget = self.budgets[up]
                done = self.bytes_up if up else self.bytes_down
                if budget is not None and len(data) >= budget - done:
                    if budget - done > 0:
                        dst.sendall(data[: budget - done])
                    proxy._count("truncated")
                    return
                dst.sendall(data)
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
        except (OSError, ValueError):
            pass
        finally:
            if not clean:
                self.dead.set()  # an error, a truncation, a cut or a stop
            with self._lock:
                self._ended += 1
                last = self._ended == 2
            if last:
                # Both pumps are done: nobody else uses the sockets now.
                for sock in (self.client, self.target):
                    if self.dead.is_set():
                        _abort(sock)
                    else:
                        with contextlib.suppress(OSError):
                            sock.close()


class FaultProxy:
    """See the module docstring."""

    def __init__(
        self,
        target_port: int,
        *,
        port: int = 0,
        lifetime_s: float = 120.0,
        max_connections: int = 64,
    ) -> None:
        self.target = ("127.0.0.1", target_port)
        self.lifetime_s = lifetime_s
        self.max_connections = max_connections
        self.refuse = False
        self.delay_s = 0.0
        self.truncate_after: list[int] = []
        self.truncate_down_after: list[int] = []
        self.stalled = threading.Event()
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._finished: list[_Pair] = []
        #: monotonic() time of every connection accepted (refused ones included).
        self.accept_times: list[float] = []
        self.counts: dict[str, int] = {
            "accepted": 0,
            "refused": 0,
            "relayed": 0,
            "truncated": 0,
            "cut": 0,
            "target_down": 0,
        }
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._accept_loop, daemon=True, name="fault-proxy-accept"
        )
        self._thread.start()

    # -- faults --------------------------------------------------------------

    def cut(self) -> int:
        """Closes every relayed connection now; returns how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._finished += pairs
        live = [p for p in pairs if not p.dead.is_set()]
        for p in pairs:
            p.kill()
        self._count("cut", len(live))
        return len(live)

    def stall(self) -> None:
        """Stops relaying bytes (connections stay open) until :meth:`resume`."""
        self.stalled.set()

    def resume(self) -> None:
        self.stalled.clear()

    def accepted_since(self, t0: float) -> list[float]:
        """Accept times (monotonic) at or after ``t0``."""
        with self._lock:
            return [t for t in self.accept_times if t >= t0]

    @property
    def live(self) -> int:
        """Relayed connections currently open."""
        with self._lock:
            return sum(1 for p in self._pairs if not p.dead.is_set())

    # -- internals -------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def _accept_loop(self) -> None:
        try:
            while not self.stopped.is_set():
                if time.monotonic() - self._started > self.lifetime_s:
                    break  # bounded: stop by itself
                ready, _, _ = select.select([self._listener], [], [], _POLL_S)
                if not ready:
                    continue
                try:
                    client, _ = self._listener.accept()
                except OSError:
                    continue
                with self._lock:
                    self.accept_times.append(time.monotonic())
                    self.counts["accepted"] += 1
                    self._finished += [p for p in self._pairs if p.dead.is_set()]
                    self._pairs = [p for p in self._pairs if not p.dead.is_set()]
                    too_many = len(self._pairs) >= self.max_connections
                if self.refuse or too_many:
                    self._count("refused")
                    _abort(client)
                    continue
                try:
                    target = socket.create_connection(self.target, timeout=5)
                except OSError:
                    self._count("target_down")
                    _abort(client)
                    continue
                # Blocking sends, bounded: a peer that stops reading for this
                # long ends the connection instead of wedging a pump.
                target.settimeout(_SEND_TIMEOUT_S)
                client.settimeout(_SEND_TIMEOUT_S)
                for s in (client, target):
                    with contextlib.suppress(OSError):
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    up = self.truncate_after.pop(0) if self.truncate_after else None
                    down = self.truncate_down_after.pop(0) if self.truncate_down_after else None
                    pair = _Pair(self, client, target, up, down)
                    self._pairs.append(pair)
                    self.counts["relayed"] += 1
                pair.start()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self.stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pairs = self._pairs + self._finished
            self._pairs, self._finished = [], []
        for p in pairs:
            p.kill()
        for p in pairs:
            for t in p.threads:
                if t.is_alive() and t is not threading.current_thread():
                    t.join(timeout=5)

    def close(self) -> None:
        """Stops accepting, closes every connection and joins every thread."""
        self.stopped.set()
        self.stalled.clear()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._shutdown()  # idempotent; also covers a loop that never ran

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
