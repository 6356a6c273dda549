"""A UDP relay between workers and an aggregator that holds back the RESULTs of chosen slots for a
while: reordering on loopback, the same every run. Worker r sends to relay socket r, which forwards
to the aggregator (so the job pins the relay's sockets, ``addresses``); the aggregator's answers to
socket r go to worker r, at once or, for a slow slot, ``delay`` seconds later, in order."""

from __future__ import annotations

import heapq
import itertools
import select
import socket
import threading
import time

from switchagg import protocol

POOL_OFFSET = 8  # the header's pool field (docs/PROTOCOL.md): version, type, flags, exp, job, rank


class DelayingRelay:
    def __init__(
        self,
        aggregator: tuple[str, int],
        workers: list[tuple[str, int]],
        slow_slots: set[int],
        delay: float,
        max_packets: int = 1_000_000,
    ) -> None:
        self.aggregator, self.workers = aggregator, workers
        self.slow_slots, self.delay, self.max_packets = slow_slots, delay, max_packets
        self.socks = []
        for _ in workers:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            self.socks.append(s)
        self.held = 0  # RESULTs held back so far
        self._queue: list[tuple[float, int, int, bytes]] = []  # (due, order, worker, datagram)
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delaying-relay", daemon=True)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Relay socket r's address: where worker r sends, and what the aggregator pins for rank r."""
        return [s.getsockname() for s in self.socks]

    def start(self) -> DelayingRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.socks:
            s.close()

    def _slot(self, datagram: bytes) -> int:
        if len(datagram) < protocol.HEADER_LEN:
            return -1
        return int.from_bytes(datagram[POOL_OFFSET : POOL_OFFSET + 2], "big") & protocol.POOL_SLOT_MASK

    def _run(self) -> None:
        relayed = 0
        while not self._stop.is_set() and relayed < self.max_packets:  # bounded in count and by stop()
            now = time.monotonic()
            while self._queue and self._queue[0][0] <= now:
                _, _, r, datagram = heapq.heappop(self._queue)
                self.socks[r].sendto(datagram, self.workers[r])
            wait = min(0.05, self._queue[0][0] - now) if self._queue else 0.05
            ready, _, _ = select.select(self.socks, [], [], max(0.0, wait))
            for sock in ready:
                r = self.socks.index(sock)
                datagram, source = sock.recvfrom(65536)
                relayed += 1
                if source == self.workers[r]:
                    sock.sendto(datagram, self.aggregator)
                elif self._slot(datagram) in self.slow_slots:
                    self.held += 1
                    due = time.monotonic() + self.delay
                    heapq.heappush(self._queue, (due, next(self._order), r, datagram))
                else:
                    sock.sendto(datagram, self.workers[r])
