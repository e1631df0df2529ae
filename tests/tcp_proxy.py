"""A loopback TCP proxy that can slow or stall a server, for failure tests and benchmarks.

``TcpProxy(target_port)`` listens on a free 127.0.0.1 port and forwards every connection to
``127.0.0.1:target_port``. ``mode`` can be switched at any time:

- ``"pass"``: bytes go through as they come;
- ``"delay"``: every chunk of the server's replies is held ``delay_s`` first (a slow server:
  each round trip takes at least that long);
- ``"stall"``: nothing is forwarded either way (a server that accepts and never answers);
  bytes held meanwhile are dropped, as a stalled peer's would time out.

Bounded in time and place: threads are daemons, loopback only, ``close()`` ends them all.
"""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_port: int, *, delay_s: float = 0.5) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.mode = "pass"
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while not self._closed:
                data = src.recv(65536)
                if not data:
                    break
                if self.mode == "stall":
                    continue  # swallowed: the peer hears nothing
                if reply and self.mode == "delay":
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            for s in self._sockets:
                s.close()
            self._sockets.clear()
