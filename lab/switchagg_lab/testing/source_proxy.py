"""A TCP forwarder whose connections reach their target from another loopback address: gRPC calls
through it come from another client as the job service sees it (its quotas are per source address),
while the test runs on one host. ``SourceProxy(("127.0.0.1", port), "127.0.0.2").address`` is where
to point a channel."""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class SourceProxy:
    def __init__(self, target: tuple[str, int], source: str) -> None:
        self.target, self.source = target, source
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="source-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(self.target, source_address=(self.source, 0))
            except OSError:  # closed
                return
            with self._lock:
                self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()

    def __enter__(self) -> SourceProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:  # the other side or close() ended it
        pass
