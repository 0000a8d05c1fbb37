"""A loopback TCP proxy whose path fails the ways networks fail, for the store tests.

Put it between a worker and PostgreSQL (``proxy.conninfo(url)`` points a URL at it) and
set its mode while the worker runs:

* ``PASS``: bytes flow both ways.
* ``BLACKHOLE``: bytes from either side are accepted and dropped; nothing is closed, so
  each end sees a path that went silent (a partition behind a NAT or load balancer,
  where TCP acknowledgements still come back from the middle box).
* ``DROP_REPLIES``: the worker's bytes reach the server, the server's replies are
  dropped (an asymmetric failure: the server commits, the worker never hears so).
* ``HOLD``: bytes from both sides are kept, in order, until :meth:`Proxy.set` goes back
  to ``PASS``, which delivers them (a stall that loses nothing).

Going from a dropping mode back to ``PASS`` makes a blip that lost bytes: connections
that were open keep their sockets but their protocol streams are broken, while new
connections work. One thread serves every connection with a selector; nothing here
blocks a test's event loop but :meth:`Proxy.set`'s brief lock.
"""

from __future__ import annotations

import contextlib
import enum
import selectors
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit


class Mode(enum.Enum):
    PASS = "pass"
    BLACKHOLE = "blackhole"
    DROP_REPLIES = "drop replies"
    HOLD = "hold"


@dataclass(eq=False)
class _Pair:
    client: socket.socket
    server: socket.socket
    held: list[tuple[socket.socket, bytes]] = field(default_factory=list)

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.server if sock is self.client else self.client


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; use it as a context manager."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._mode = Mode.PASS
        self._lock = threading.Lock()
        self._pairs: dict[socket.socket, _Pair] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="test-proxy", daemon=True)

    @classmethod
    def before(cls, url: str) -> Proxy:
        """A proxy to the server a ``postgresql://`` URL names."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432)

    def __enter__(self) -> Proxy:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for sock in [*self._pairs, self._listener, self._wake_r, self._wake_w]:
            sock.close()

    @property
    def mode(self) -> Mode:
        return self._mode

    def set(self, mode: Mode) -> None:
        """Change how bytes are treated from now on; back to ``PASS``, held bytes go on."""
        with self._lock:
            self._mode = mode
            if mode is Mode.PASS:
                for pair in {id(p): p for p in self._pairs.values()}.values():
                    for destination, data in pair.held:
                        _send(destination, data)
                    pair.held.clear()

    def conninfo(self, url: str) -> str:
        """``url`` (a ``postgresql://`` URL) with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        user = parts.netloc.rpartition("@")[0]
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def connections(self) -> int:
        """How many client connections are open through the proxy."""
        with self._lock:
            return len(self._pairs) // 2

    def _serve(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=1.0):
                sock = key.fileobj
                if sock is self._wake_r:
                    self._wake_r.recv(64)
                elif sock is self._listener:
                    self._accept()
                else:
                    assert isinstance(sock, socket.socket)
                    self._forward(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        client.setblocking(True)
        server = socket.create_connection(self._target)
        pair = _Pair(client, server)
        with self._lock:
            self._pairs[client] = self._pairs[server] = pair
        for sock in (client, server):
            self._selector.register(sock, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        with self._lock:
            pair = self._pairs.get(sock)
            if pair is None:
                return
            if not data:
                self._drop(pair)
                return
            destination = pair.peer(sock)
            mode = self._mode
            if mode is Mode.HOLD:
                pair.held.append((destination, data))
            elif mode is Mode.PASS or (mode is Mode.DROP_REPLIES and sock is pair.client):
                _send(destination, data)

    def _drop(self, pair: _Pair) -> None:
        """One side closed: close both (lock held)."""
        for sock in (pair.client, pair.server):
            self._pairs.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()


def _send(destination: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # that side is gone; its read closes the pair
        destination.sendall(data)
